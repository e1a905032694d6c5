"""LoRA runs: a frozen base in `model.dtype` plus float32 adapters (grpo_core.models.lora).

The train state's params are the adapters alone (their optimizer state is adapter-sized);
the base is held once, in the compute dtype, and serves three roles without a copy:
the frozen part of the update (`make_update(..., frozen=base)`), the reference model of
`loss.beta > 0` (the base with the adapters off), and the weights the rollout merges the
adapters into (W + scale * A . B once per rollout) or, when that merged copy would not
fit in device memory, decodes with the adapters applied per token.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from grpo_core.config import LoRAConfig, ModelConfig
from grpo_core.contracts import PlannableRollout, RolloutShapes
from grpo_core.errors import UserError
from grpo_core.models import init_from_config, load_pretrained, lora, peft_io
from grpo_core.models.precision import abstract_compute_params, cast_floating
from grpo_core.sharding import param_shardings, per_device_bytes
from grpo_rollout.gather import GATHER_HEADROOM, GIB, bytes_beyond_arguments, every_process, spare_device_bytes


def lora_spec(lora_cfg: LoRAConfig) -> Optional[lora.LoRASpec]:
    """The run's adapters (model.lora), or None for a full-parameter run."""
    if lora_cfg.rank is None:
        return None
    return lora.LoRASpec(lora_cfg.rank, lora_cfg.alpha, lora.resolve_targets(lora_cfg.target_modules),
                         lora_cfg.rslora)


def check_lora_fits(lora_cfg: LoRAConfig, qcfg: Any) -> None:
    """model.lora.rank against the targets' dims, and model.lora.init_from against the model
    and model.lora (before any device work)."""
    spec = lora_spec(lora_cfg)
    if spec is None:
        return
    try:
        lora.check_targets(spec, qcfg)
    except ValueError as exc:
        raise UserError(f"model.lora.target_modules: {exc}") from None
    try:
        lora.check_rank_fits(spec, lora.layer_shapes(qcfg))
    except ValueError as exc:
        raise UserError(f"model.lora.rank: {exc}; lower model.lora.rank or drop that target") from None
    if lora_cfg.init_from:
        peft_adapters(lora_cfg, qcfg, spec)


def peft_adapters(lora_cfg: LoRAConfig, qcfg: Any, spec: lora.LoRASpec) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The arrays of the PEFT directory model.lora.init_from, which must fit the model and model.lora."""
    where = lora_cfg.init_from
    try:
        theirs, arrays = peft_io.load_peft(where, qcfg)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"model.lora.init_from {where!r}: {exc}; point it at a PEFT LoRA adapter directory "
                        "trained on this run's base model") from None
    if theirs != spec:
        raise UserError(f"model.lora.init_from {where!r} holds rank {theirs.rank}, alpha {theirs.alpha:g}, "
                        f"targets {list(theirs.targets)}, rslora {theirs.rslora}, but model.lora says rank "
                        f"{spec.rank}, alpha {spec.alpha:g}, targets {list(spec.targets)}, rslora {spec.rslora}; "
                        "set model.lora to the adapter's values")
    return arrays


def storage_dtype(model_cfg: ModelConfig) -> str:
    """Where the model's weights are stored: a LoRA base is frozen in the compute dtype."""
    return model_cfg.dtype if model_cfg.lora.rank is not None else model_cfg.param_dtype


# ---- base fingerprint ------------------------------------------------------------------
_MIX = np.uint32(2654435761)  # Knuth's multiplicative hash constant


@jax.jit
def _leaf_checksum(x: jax.Array) -> jax.Array:
    """An exact, order-independent uint32 checksum of an array's bits and their positions
    (modular integer sums: the same on any mesh and device count)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint16 if x.dtype.itemsize == 2 else jnp.uint32)
    index = jnp.zeros(x.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(x.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis) * jnp.uint32(stride % (1 << 32))
        stride *= x.shape[axis]
    return jnp.sum((bits.astype(jnp.uint32) + 1) * (index * _MIX + 40503), dtype=jnp.uint32)


def base_fingerprint(model_cfg: ModelConfig, qcfg: Any, base: nnx.State) -> dict:
    """What identifies a base: its source, its HF config and a checksum of its weights."""
    digest = hashlib.sha256(json.dumps(qcfg.to_hf_dict(), sort_keys=True).encode())
    for path, variable in sorted(nnx.to_flat_state(base), key=lambda kv: tuple(map(str, kv[0]))):
        digest.update(f"{'.'.join(map(str, path))}:{int(_leaf_checksum(variable.get_value()))};".encode())
    return {"source": model_cfg.path or f"random init (seed {model_cfg.seed})", "dtype": model_cfg.dtype,
            "checksum": digest.hexdigest()[:16]}


def describe(fingerprint: dict) -> str:
    return f"{fingerprint['source']} ({fingerprint['dtype']}, checksum {fingerprint['checksum']})"


def check_same_base(saved: Optional[dict], current: dict, where: Any) -> None:
    if saved is None:
        raise UserError(f"checkpoint {where} holds no LoRA adapters (a full-parameter run); set model.lora.rank=null "
                        "to resume it, or start a new logging.dir")
    if saved != current:
        raise UserError(f"checkpoint {where} holds adapters of base {describe(saved)}, but this run's base is "
                        f"{describe(current)}; set model.path to the checkpoint's base or start a new logging.dir")


ShapesFor = Callable[[nnx.GraphDef, nnx.State], RolloutShapes]  # one rollout batch of the run for these weights


# ---- the run's policy model -----------------------------------------------------------------
@dataclass
class LoRAPolicy:
    """A LoRA run's policy model (see grpo_runner_gsm8k.assembly.policy for what a policy model answers):
    the trained params are the adapters; the base is frozen in the compute dtype."""

    spec: lora.LoRASpec
    base_graphdef: nnx.GraphDef
    train_graphdef: nnx.GraphDef
    base: nnx.State
    fingerprint: dict
    merge: Optional[Callable[[nnx.State, nnx.State], nnx.State]]  # None in the plan's abstract twin
    compute_dtype: Any
    merged_rollout: bool = True

    @property
    def adapter_spec(self) -> lora.LoRASpec:
        return self.spec

    @property
    def frozen(self) -> tuple:
        """The update's argument after the batch: the base, which takes no gradient."""
        return (self.base,)

    @property
    def policy_graphdef(self) -> nnx.GraphDef:
        """The model of `forward_params`' state: the plain base (merged) or the base with adapters."""
        return self.base_graphdef if self.merged_rollout else self.train_graphdef

    def forward_params(self, adapters: nnx.State) -> nnx.State:
        """The policy's weights for a forward pass: the merged copy, or the base with the adapters
        (cast to the compute dtype) applied per token."""
        if self.merged_rollout:
            return self.merge(self.base, adapters)
        return nnx.merge_state(self.base, cast_floating(adapters, self.compute_dtype))

    def reference(self, adapters: nnx.State) -> nnx.State:
        """The reference model's weights for `policy_graphdef`: the base, or (per-token decode)
        the base with zero adapters (B = 0 adds exactly nothing; adapter-sized, no base copy)."""
        if self.merged_rollout:
            return self.base
        return nnx.merge_state(self.base, jax.tree.map(jnp.zeros_like, cast_floating(adapters, self.compute_dtype)))

    def abstract_forward_params(self, adapters: Any) -> Any:
        """`forward_params` of abstract adapters: the merged copy has the base's shapes."""
        if self.merged_rollout:
            return self.base
        return nnx.merge_state(self.base, abstract_compute_params(adapters, self.compute_dtype))

    def masters_beside_rollout(self, adapters: Any) -> int:
        """The base and adapters beside the merged copy (counted whole: an upper bound, since only the
        targeted kernels are copied), or the float32 adapters beside the per-token decode's."""
        return (per_device_bytes(self.base) if self.merged_rollout else 0) + per_device_bytes(adapters)

    def reference_bytes(self, adapters: Any) -> int:
        """The reference is the base itself: nothing more on the devices."""
        return 0

    def check_checkpoint(self, saved_base: Optional[dict], where: Any) -> None:
        check_same_base(saved_base, self.fingerprint, where)

    def choose_rollout(self, rollout: Any, shapes_for: ShapesFor, devices: list) -> None:
        """`decide_rollout` on this process's devices, with the train state resident;
        `shapes_for(graphdef, weights)` is one rollout batch of the run for those weights."""
        spare = spare_device_bytes(devices)
        self.decide_rollout(None if spare is None else merged_decode_needs(self, rollout, shapes_for), spare)

    def merged_copy_bytes(self) -> int:
        """Per-device bytes of the merged copy: the targeted kernels (the rest is the base's own)."""
        kernels = dict(nnx.to_flat_state(self.base))
        return per_device_bytes([kernels[(*lora.kernel_path(t), "kernel")].get_value() for t in self.spec.targets])

    def decide_rollout(self, decode_needs: Optional[int], spare: Optional[int]) -> None:
        """Merged copy when it and what the merged decode needs beside its weights fit in every
        device's spare memory (`decode_needs` None: the compiler refused that decode); the one
        rule of the run and the plan, printed once."""
        copy = self.merged_copy_bytes()
        fits = spare is None or (decode_needs is not None and copy + decode_needs <= spare)
        self.merged_rollout = every_process(fits)
        print(f"lora: rollout {'merges the adapters once per rollout' if self.merged_rollout else 'applies the adapters per token'}"
              f" ({merge_figures(copy, decode_needs, spare)})", flush=True)


def merge_figures(copy: int, decode_needs: Optional[int], spare: Optional[int]) -> str:
    if spare is None:
        return f"merged copy {copy / GIB:.2f} GiB per device, no device memory limit reported"
    decode = "refused by the compiler" if decode_needs is None else f"{decode_needs / GIB:.2f} GiB"
    return (f"merged copy {copy / GIB:.2f} GiB per device + its decode beside the weights {decode}, "
            f"{spare / GIB:.2f} GiB spare with {GATHER_HEADROOM:.0%} of device memory kept free")


def decode_needs(compiled: Any, weights_bytes: int) -> int:
    """What a compiled decode needs per device besides the `weights_bytes` of weights it reads:
    its other arguments (KV cache, loop state), temporaries and outputs."""
    stats = compiled.memory_analysis()
    return stats.argument_size_in_bytes - weights_bytes + bytes_beyond_arguments(compiled)


class DecodeKeeper:
    """A grpo_core.contracts.PhaseCompiler that keeps the compiled rollout decode (no capacity
    given, so its weights stay as sharded); None where the compiler refused it for memory."""

    def __init__(self):
        self.decode = None

    def compile(self, name: str, build: Callable[[], Any], arguments: Any, *, record: bool = True,
                note: Any = "") -> Any:
        try:
            compiled = build()
        except jax.errors.JaxRuntimeError as exc:
            if "RESOURCE_EXHAUSTED" not in str(exc):
                raise
            return None
        if record and name == "rollout decode":
            self.decode = compiled
        return compiled

    def spare_bytes(self, compiled: Any) -> None:
        return None

    def decode_seconds(self, compiled: Any, steps: int) -> None:
        return None


def merged_decode_needs(policy: LoRAPolicy, rollout: Any, shapes_for: ShapesFor) -> Optional[int]:
    """What one rollout's decode on the merged copy needs beside its weights, compiled (not run)
    for this batch; 0 for a backend that cannot compile its phases ahead (the copy alone decides)."""
    if not isinstance(rollout, PlannableRollout):
        return 0
    keeper = DecodeKeeper()  # the merged copy has the base's shapes
    rollout.compile_phases(shapes_for(policy.base_graphdef, policy.base), keeper)
    return None if keeper.decode is None else decode_needs(keeper.decode, per_device_bytes(policy.base))


def setup_lora(model_cfg: ModelConfig, model: nnx.Module, mesh: Mesh, rules: Any,
               compute_dtype: Any) -> tuple[LoRAPolicy, nnx.State]:
    """Attaches the adapters to `model` (a base frozen in the compute dtype); returns the run's
    policy model and the initial adapters (float32, sharded by the kernels' logical axes)."""
    spec = lora_spec(model_cfg.lora)
    base_graphdef, base = nnx.split(model)
    lora.add_adapters(model, spec, jax.random.key(model_cfg.seed))
    train_graphdef, state = nnx.split(model)
    adapters, _ = lora.split_adapters(state)
    if model_cfg.lora.init_from:
        adapters = lora.with_adapter_arrays(adapters, peft_adapters(model_cfg.lora, model.config, spec))
    adapters = jax.device_put(adapters, param_shardings(adapters, mesh, rules))
    shardings = jax.tree.map(lambda x: x.sharding, base)
    merge = jax.jit(lambda b, a: lora.merged_state(b, a, spec), out_shardings=shardings)
    fingerprint = base_fingerprint(model_cfg, model.config, base)
    policy = LoRAPolicy(spec, base_graphdef, train_graphdef, base, fingerprint, merge, compute_dtype)
    return policy, adapters


# ---- export ------------------------------------------------------------------------------
@dataclass
class SavedAdapters:
    """A LoRA checkpoint's adapters with the base they were trained on, on one device."""

    spec: lora.LoRASpec
    base_graphdef: nnx.GraphDef
    base: nnx.State
    adapters: nnx.State

    def merged_model(self) -> nnx.Module:
        return nnx.merge(self.base_graphdef, lora.merged_state(self.base, self.adapters, self.spec))

    def arrays(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        return {t: (np.asarray(a), np.asarray(b)) for t, (a, b) in lora.adapter_arrays(self.adapters, self.spec).items()}


def base_model(model_cfg: ModelConfig, qcfg: Any) -> nnx.Module:
    """A LoRA run's base, rebuilt from its config on the default device."""
    if model_cfg.path:
        try:
            return load_pretrained(model_cfg.path, dtype=model_cfg.dtype)
        except (OSError, ValueError) as exc:
            raise UserError(f"the run's base model.path {model_cfg.path!r} cannot be loaded ({exc}); the adapters "
                            "need the base they were trained on") from None
    return init_from_config(qcfg, seed=model_cfg.seed, dtype=model_cfg.dtype)


def saved_base(model_cfg: ModelConfig, qcfg: Any, fingerprint: Optional[dict],
               where: Any) -> tuple[nnx.GraphDef, nnx.State]:
    """A LoRA run's base rebuilt from its config, refused when it is not the base of the
    checkpoint at `where` (whose saved base `fingerprint` is given)."""
    graphdef, base = nnx.split(base_model(model_cfg, qcfg))
    check_same_base(fingerprint, base_fingerprint(model_cfg, qcfg, base), where)
    return graphdef, base


def abstract_lora_model(model_cfg: ModelConfig, qcfg: Any) -> nnx.Module:
    """The run's base with its adapters, ShapeDtypeStruct leaves only (for the memory plan)."""
    def build() -> nnx.Module:
        model = init_from_config(qcfg, dtype=model_cfg.dtype, remat=model_cfg.remat, scan_layers=model_cfg.scan_layers)
        lora.add_adapters(model, lora_spec(model_cfg.lora), jax.random.key(model_cfg.seed))
        return model

    return nnx.eval_shape(build)
