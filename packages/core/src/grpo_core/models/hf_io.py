"""Hugging Face safetensors checkpoints: load (straight onto a mesh) and export.

Loading never holds more than one tensor on the host: the model is built abstractly
(`nnx.eval_shape`), then each checkpoint tensor is read with `safe_open`, laid out by
`hf_names.HF_TABLE`, cast, and placed on its NamedSharding (or the default device).
A decoder-layer tensor is placed as one slice of its stacked [L, ...] parameter (a MoE
expert's, of its [L, E, ...] one): the stack is allocated on its sharding once and each
slice is written into it in place. A checkpoint that holds the model as the language model of a
larger one (a family's `OuterCheckpoint`: Gemma 3's multimodal checkpoints) is read by that kind's
table; its other parts' tensors are skipped.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import re
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

import grpo_core.models.hf_names as hf_names
from grpo_core.model_families import outer_checkpoint_of
from grpo_core.models.config import QwenConfig, read_config_json
from grpo_core.models.hf_names import CheckpointNames
from grpo_core.models.qwen import QwenModel, resolve_dtype
from grpo_core.sharding import DEFAULT_RULES, Rules, param_shardings

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # the HF save_pretrained default ("5GB")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


# ---- locating files -------------------------------------------------------------------
def resolve_model_dir(path_or_hub_id: str | os.PathLike) -> str:
    """A local directory as is; an `org/name` Hub id downloaded with huggingface_hub."""
    path = os.fspath(path_or_hub_id)
    if os.path.isdir(path):
        return path
    if os.path.exists(path) or not _HUB_ID.match(path):
        raise FileNotFoundError(
            f"{path!r} is not a model directory (config.json + safetensors) nor a Hub id 'org/name'."
        )
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
    try:
        return snapshot_download(repo_id=path, allow_patterns=patterns)
    except Exception as e:
        raise FileNotFoundError(f"{path!r} is not a local directory and downloading it from the Hub failed: {e}") from e


def _read_index(index_path: str) -> dict[str, str]:
    try:
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index_path} is not a valid safetensors index (needs a 'weight_map'): {e!r}") from e
    folder = os.path.dirname(index_path)
    for shard in sorted(set(weight_map.values())):
        if not os.path.isfile(os.path.join(folder, shard)):
            raise FileNotFoundError(f"{os.path.join(folder, shard)} is listed in {index_path} but does not exist.")
    return {name: os.path.join(folder, shard) for name, shard in weight_map.items()}


def checkpoint_tensor_files(model_dir: str) -> dict[str, str]:
    """{HF tensor name: safetensors file}, from the index if there is one."""
    index_path = os.path.join(model_dir, INDEX_FILE)
    single_path = os.path.join(model_dir, SINGLE_FILE)
    if os.path.isfile(single_path):
        with open_safetensors(single_path) as f:
            names = f.keys()  # a safetensors handle, not a dict
        return dict.fromkeys(names, single_path)
    if os.path.isfile(index_path):
        return _read_index(index_path)
    raise FileNotFoundError(
        f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}; only safetensors checkpoints are supported "
        "(convert pytorch_model.bin with transformers' save_pretrained(safe_serialization=True))."
    )


@contextmanager
def open_safetensors(path: str) -> Iterator[Any]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"safetensors file {path} does not exist.")
    try:
        handle = safe_open(path, framework="numpy")
    except Exception as e:  # safetensors raises its own error type for bad headers
        raise ValueError(f"cannot read safetensors file {path} (corrupt or truncated?): {e}") from e
    with handle as f:
        yield f


def _read_tensor(f: Any, name: str, path: str) -> np.ndarray:
    try:
        return f.get_tensor(name)
    except Exception as e:
        raise ValueError(f"cannot read tensor {name!r} from safetensors file {path}: {e}") from e


# ---- loading --------------------------------------------------------------------------
def _dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def abstract_model(cfg: QwenConfig, dtype: Any = "float32", remat: str = "none", scan_layers: bool = True) -> QwenModel:
    """The model with ShapeDtypeStruct params, built by shape evaluation only (no memory)."""
    return nnx.eval_shape(lambda: QwenModel(cfg, dtype=dtype, rngs=nnx.Rngs(0), remat=remat, scan_layers=scan_layers))


def _place(host: np.ndarray, sharding: jax.sharding.Sharding | None) -> jax.Array:
    if sharding is None:
        return jax.device_put(host)
    # Each device receives only its own slice of the host tensor.
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _checkpoint_names(model_dir: str, cfg: QwenConfig, skip: frozenset) -> CheckpointNames:
    """The names of an outer checkpoint when its config.json names one, else of `cfg`'s family."""
    has_config = os.path.isfile(os.path.join(model_dir, "config.json"))
    found = outer_checkpoint_of(read_config_json(model_dir)) if has_config else None
    if found is None:
        return CheckpointNames(cfg.family.hf_table, skip=skip)
    return CheckpointNames(found[1].hf_table, hf_names.HF_IGNORED + found[1].not_loaded, skip)


def _target_path(hf_name: str, cfg: QwenConfig, targets: dict, file: str,
                 names: CheckpointNames) -> tuple[str, Any, tuple] | None:
    found = hf_names.hf_to_ours(hf_name, names.table)
    if found is None and names.skipped(hf_name):
        return None
    if found and found[0] in targets and all(i < n for i, n in zip(found[2], targets[found[0]].shape)):
        return found
    if found and found[0].startswith("lm_head.") and cfg.tie_word_embeddings:
        return None  # some tied checkpoints also store the (identical) head
    raise ValueError(
        f"tensor {hf_name!r} in {file} has no parameter in a {cfg.model_type} model with this config.json "
        f"(tie_word_embeddings={cfg.tie_word_embeddings}, attention_bias={cfg.attention_bias}); "
        "is the config from the same checkpoint?"
    )


def _load_tensor(f, hf_name: str, file: str, shape: tuple, transform, dtype, sharding) -> jax.Array:
    raw = _read_tensor(f, hf_name, file)
    try:
        host = transform.to_ours(raw, shape)
    except ValueError:  # reshape of the wrong number of elements
        host = None
    if host is None or host.shape != shape:
        raise ValueError(
            f"tensor {hf_name!r} in {file} has shape {raw.shape}, which does not fit the parameter shape "
            f"{shape} implied by config.json; are config.json and the weights from the same model?"
        )
    return _place(host.astype(dtype), sharding)


@functools.partial(jax.jit, donate_argnums=0)
def _write_slice(stacked: jax.Array, value: jax.Array, index: jax.Array) -> jax.Array:
    """stacked[index] = value, index [d] over the d leading axes."""
    depth = index.shape[0]
    starts = (*(index[i] for i in range(depth)), *(0,) * value.ndim)
    return jax.lax.dynamic_update_slice(stacked, value.reshape((1,) * depth + value.shape), starts)


def _slice_sharding(sharding: jax.sharding.Sharding | None, depth: int) -> jax.sharding.Sharding | None:
    """The sharding of one slice: the stacked one without its `depth` leading axes."""
    if sharding is None:
        return None
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[depth:]))


class _StackedBuffers:
    """Stacked [L, ...] parameters being filled one slice at a time, on their shardings."""

    def __init__(self, shardings: dict):
        self.shardings = shardings
        self.arrays: dict[str, jax.Array] = {}

    def write(self, path: str, variable, index: tuple[int, ...], value: jax.Array) -> None:
        if path not in self.arrays:
            zeros = functools.partial(jnp.zeros, variable.shape, value.dtype)
            self.arrays[path] = jax.jit(zeros, out_shardings=self.shardings.get(path))()
        self.arrays[path] = _write_slice(self.arrays[path], value, jnp.asarray(index, jnp.int32))

    def finished(self) -> dict[str, jax.Array]:
        # device_put is a no-op unless propagation picked another layout for an update.
        return {p: jax.device_put(a, self.shardings[p]) if p in self.shardings else a for p, a in self.arrays.items()}


def _names_by_file(model_dir: str) -> list[tuple[str, list[str]]]:
    by_file: dict[str, list[str]] = defaultdict(list)
    for name, file in checkpoint_tensor_files(model_dir).items():
        by_file[file].append(name)
    return sorted(by_file.items())


def _shardings_by_path(state: nnx.State, mesh, rules: Rules) -> dict[str, jax.sharding.Sharding]:
    if mesh is None:
        return {}
    return {_dotted(p): v.get_value() for p, v in nnx.to_flat_state(param_shardings(state, mesh, rules))}


def _fill_state(state: nnx.State, cfg: QwenConfig, model_dir: str, dtype, shardings: dict,
                names: CheckpointNames) -> None:
    """Set every Variable of the abstract `state` from the checkpoint, one tensor at a time;
    tensors `names` skips are left to the caller."""
    targets = {_dotted(p): v for p, v in nnx.to_flat_state(state)}
    stacks = _StackedBuffers(shardings)
    loaded: set[tuple[str, tuple]] = set()
    for file, hf_list in _names_by_file(model_dir):
        with open_safetensors(file) as f:
            for hf_name in hf_list:
                target = _target_path(hf_name, cfg, targets, file, names)
                if target is None:
                    continue
                path, transform, index = target
                if (path, index) in loaded:  # two layouts of one outer checkpoint mixed in its files
                    where = f"{path} (slice {index})" if index else path
                    raise ValueError(f"tensor {hf_name!r} in {file} is a second copy of parameter {where}; "
                                     f"is the checkpoint in {model_dir} written by one tool?")
                _load_into(f, hf_name, file, (targets[path], path, index), transform, dtype, shardings, stacks)
                loaded.add((path, index))
    _check_complete(targets, loaded, names.table, model_dir)
    for path, array in stacks.finished().items():
        targets[path].set_value(array)


def _load_into(f, hf_name: str, file: str, where: tuple, transform, dtype, shardings: dict, stacks) -> None:
    variable, path, index = where
    if not index:
        variable.set_value(_load_tensor(f, hf_name, file, variable.shape, transform, dtype, shardings.get(path)))
        return
    sharding = _slice_sharding(shardings.get(path), len(index))
    value = _load_tensor(f, hf_name, file, variable.shape[len(index):], transform, dtype, sharding)
    stacks.write(path, variable, index, value)


def load_pretrained(
    path_or_hub_id: str | os.PathLike,
    dtype: Any = "bfloat16",
    mesh: jax.sharding.Mesh | None = None,
    rules: Rules | None = None,
    remat: str = "none",
    scan_layers: bool = True,
    *,
    config: QwenConfig | None = None,
    skip: frozenset[str] = frozenset(),
) -> QwenModel:
    """Load an HF Qwen2/Qwen3 checkpoint (single file or index + shards) from a local
    directory or a Hub id, with parameters in `dtype` ("bfloat16" | "float32").

    With `mesh`, every tensor goes directly onto its NamedSharding from `rules`
    (default `grpo_core.sharding.DEFAULT_RULES`), one tensor at a time, and the model's
    activation sharding is set from the same rules. `config` replaces the directory's
    config.json (a reward model's decoder without an LM head); HF tensors named in `skip`
    are not loaded (its score head, read apart). A multimodal checkpoint a family reads (Gemma 3's
    `gemma3`) loads as its language model; its vision tower and projector are not loaded.
    """
    model_dir = resolve_model_dir(path_or_hub_id)
    cfg = QwenConfig.from_pretrained_dir(model_dir) if config is None else config
    rules = rules or DEFAULT_RULES
    graphdef, state = nnx.split(abstract_model(cfg, resolve_dtype(dtype), remat, scan_layers))
    names = _checkpoint_names(model_dir, cfg, frozenset(skip))
    _fill_state(state, cfg, model_dir, resolve_dtype(dtype), _shardings_by_path(state, mesh, rules), names)
    model = nnx.merge(graphdef, state)
    if mesh is not None:
        model.set_activation_sharding(mesh, rules)
    return model


def _slices(path: str, shape: tuple, table: tuple | None) -> list[tuple[int, ...]]:
    """The indices of the HF tensors parameter `path` of `shape` is stacked from ([()] when one)."""
    return list(itertools.product(*(range(n) for n in shape[:hf_names.index_depth(path, table)])))


def _check_complete(targets: dict, loaded: set, table: tuple | None, model_dir: str) -> None:
    expected = {(p, index) for p, v in targets.items() for index in _slices(p, v.shape, table)}
    missing = sorted(expected - loaded, key=lambda pi: (pi[1], pi[0]))
    if missing:
        names = [hf_names.ours_to_hf(p, index, table)[0] for p, index in missing]
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        raise ValueError(f"checkpoint in {model_dir} is missing {len(names)} tensor(s): {shown}.")


# ---- export ---------------------------------------------------------------------------
def _dtype_name(dtype) -> str:
    return {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}[np.dtype(dtype).name]


def _to_host(x: jax.Array) -> np.ndarray:
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def _hf_tensors(model: QwenModel) -> list[tuple[str, jax.Array, Any]]:
    """(HF name, parameter array, transform) for every parameter; decoder layers are
    unstacked, layer by layer, in between the embedding and the final norm (HF order)."""
    params = {_dotted(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    table, rows = model.config.family.hf_table, []
    for path in (p for p in params if not hf_names.is_stacked(p)):
        rows.append((*hf_names.ours_to_hf(path, table=table), params[path]))
    stacked = [(p, index) for p in params if hf_names.is_stacked(p) for index in _slices(p, params[p].shape, table)]
    for layer in range(model.config.num_hidden_layers):
        rows.extend((*hf_names.ours_to_hf(path, index, table), params[path][index])
                    for path, index in stacked if index[0] == layer)
    return [(name, value, transform) for name, transform, value in rows]


def _plan_shards(rows: list, max_shard_bytes: int, itemsize: int) -> list[list]:
    """Greedy consecutive packing; a tensor larger than the limit gets its own shard."""
    shards: list[list] = [[]]
    size = 0
    for row in rows:
        nbytes = row[1].size * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(row)
        size += nbytes
    return shards


def _remove_stale_weights(out_dir: str) -> None:
    # A leftover model.safetensors would shadow a new index (HF checks it first).
    for name in os.listdir(out_dir):
        if name == INDEX_FILE or (name.startswith("model") and name.endswith(".safetensors")):
            os.remove(os.path.join(out_dir, name))


def _shard_file_name(i: int, n: int) -> str:
    return SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def export_pretrained(
    model: QwenModel,
    out_dir: str | os.PathLike,
    tokenizer: Any = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: Any = None,
) -> str:
    """Write an HF directory (config.json + safetensors, an index above `max_shard_bytes`)
    that `transformers.AutoModelForCausalLM.from_pretrained` loads; the tokenizer too if given.
    Weights are written in `dtype` (None: the model's dtype; float32 masters round to
    nearest for bfloat16, as the forward pass casts them). Returns the directory."""
    out_dir = os.fspath(out_dir)
    if tokenizer is not None:
        model.config.check_tokenizer_fits(len(tokenizer))
    dtype = resolve_dtype(dtype) if dtype is not None else model.dtype
    rows = _hf_tensors(model)
    shards = _plan_shards(rows, max_shard_bytes, dtype.itemsize)
    cfg = model.config.replace(torch_dtype=_dtype_name(dtype))
    if jax.process_index() == 0:
        os.makedirs(out_dir, exist_ok=True)
        _remove_stale_weights(out_dir)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(cfg.to_hf_dict(), f, indent=2)
    weight_map = {}
    for i, shard in enumerate(shards):
        file_name = _shard_file_name(i, len(shards))
        tensors = {name: transform.to_hf(_to_host(value.astype(dtype))) for name, value, transform in shard}
        if jax.process_index() == 0:
            save_file(tensors, os.path.join(out_dir, file_name), metadata={"format": "pt"})
        weight_map.update({name: file_name for name in tensors})
    if jax.process_index() == 0:
        if len(shards) > 1:
            total = sum(math.prod(v.shape) * dtype.itemsize for _, v, _ in rows)
            with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
    return out_dir
