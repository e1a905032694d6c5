"""One global step batch on every process of a multi-host run.

Each process reads its own shard of the data; the shards are gathered in process order
so every process holds the same prompts, answers and rewards (rewards are cheap next to
rollout, and identical inputs keep every process's advantages identical). Arrays the
host reads are gathered from all devices; what only process 0 computes (a multi-turn
rollout's tool outcomes) is broadcast from it. With one process every helper is an identity.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import pickle
import pkgutil
import socket
from importlib import metadata
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from grpo_core.config_io import config_to_dict
from grpo_core.errors import UserError


def gather_objects(items: list) -> list:
    """All processes' `items`, concatenated in process order."""
    if jax.process_count() == 1:
        return list(items)
    payload = np.frombuffer(pickle.dumps(list(items)), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([payload.size], np.int64))).ravel()
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: payload.size] = payload
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [item for row, size in zip(rows, sizes) for item in pickle.loads(row[: int(size)].tobytes())]


def broadcast_object(value: Any) -> Any:
    """Process 0's `value` (any picklable object) on every process; the others' `value` is
    ignored. The payload is padded to a power of two bytes, so few sizes are ever compiled."""
    if jax.process_count() == 1:
        return value
    payload = np.frombuffer(pickle.dumps(value), np.uint8) if jax.process_index() == 0 else np.zeros(0, np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.array(payload.size, np.int32)))
    padded = np.zeros(1 << max(10, (size - 1).bit_length()), np.uint8)
    padded[: payload.size] = payload
    data = np.asarray(multihost_utils.broadcast_one_to_all(padded))
    return pickle.loads(data[:size].tobytes())


def host_array(x: Any) -> np.ndarray:
    """The whole array on this host, also when its shards live on other processes."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def local_prompt_count(prompts_per_step: int, process_count: int) -> int:
    """Prompts each process draws from its shard for a global step of `prompts_per_step`."""
    if prompts_per_step % process_count:
        raise UserError(f"rollout.prompts_per_step={prompts_per_step} is the global prompt count and must split "
                         f"evenly over the {process_count} processes; use a multiple of {process_count}")
    return prompts_per_step // process_count


# ---- the same run on every process -----------------------------------------------------------
def check_same_run(cfg: Any) -> None:
    """Stops every process, before any model is loaded, when they were started with different
    resolved configs or different grpo code: each sends its host name and two hashes, and all
    compare them with process 0's."""
    if jax.process_count() == 1:
        return
    mine = (socket.gethostname(), config_fingerprint(cfg), code_fingerprint())
    everyone = gather_objects([mine])
    for index, what, fix in ((1, "resolved config", "start every host with the same --config and overrides"),
                             (2, "grpo code (package versions and sources)", "install the same grpo-jax on every host")):
        differing = [p for p, seen in enumerate(everyone) if seen[index] != everyone[0][index]]
        if differing:
            named = ", ".join(f"process {p} ({everyone[p][0]})" for p in differing)
            raise UserError(f"the {what} of {named} differs from that of process 0 ({everyone[0][0]}); "
                            f"{fix}; no step was run")


def config_fingerprint(cfg: Any) -> str:
    """Hash of the resolved config; mesh.process_id alone differs between the processes of a run."""
    settings = config_to_dict(cfg)
    settings["mesh"] = {**settings["mesh"], "process_id": None}
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def code_fingerprint() -> str:
    """Hash of the installed grpo packages' versions and of their Python sources (an editable
    install keeps its version when its files change)."""
    digest = hashlib.sha256()
    for dist in sorted(metadata.distributions(), key=lambda d: d.metadata["Name"] or ""):
        if (dist.metadata["Name"] or "").startswith("grpo-"):
            digest.update(f"{dist.metadata['Name']}=={dist.version};".encode())
    for module in sorted(m.name for m in pkgutil.iter_modules() if m.name.startswith("grpo_")):
        spec = importlib.util.find_spec(module)
        for root in (spec.submodule_search_locations or []) if spec else []:
            for path in sorted(Path(root).rglob("*.py")):
                digest.update(f"{module}/{path.relative_to(root)}".encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()
