"""One global step batch on every process of a multi-host run.

Each process reads its own shard of the data; the shards are gathered in process order
so every process holds the same prompts, answers and rewards (rewards are cheap next to
rollout, and identical inputs keep every process's advantages identical). Arrays the
host reads are gathered from all devices; what only process 0 computes (a multi-turn
rollout's tool outcomes) is broadcast from it. With one process every helper is an identity.
"""

from __future__ import annotations

import pickle
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

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
