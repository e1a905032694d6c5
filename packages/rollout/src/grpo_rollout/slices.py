"""The decode across TPU slices (grpo_meshes.slices): each slice decodes its own rows.

The split decode layouts (grpo_rollout.model_parallel, grpo_rollout.head_parallel) put their
collectives within each slice, and the decode loop's one reduction over all rows, its test that
every row is done, runs every END_TEST_EVERY tokens there instead of every token.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from grpo_core.sharding import as_tuple

SLICE = "slice"  # the outer axis of a decode layout's mesh: its slices


def decode_slices(devices: np.ndarray) -> int:
    """The TPU slices (devices' slice_index) a decode keeps to, `devices` in the rollout batch's
    order: each slice must hold one block of rows (the slices the outer factor: mesh.slice_axis dp);
    else, and without slices, 1 (the layout spans every device)."""
    index = [getattr(d, "slice_index", None) for d in np.asarray(devices).flat]
    slices = len(set(index) - {None})
    if slices < 2:
        return 1
    size = len(index) // slices
    return slices if all(len(set(index[s * size:(s + 1) * size])) == 1 for s in range(slices)) else 1


def batch_slices(mesh: Mesh, axes: Any) -> int:
    """`decode_slices` of a rollout batch split over `axes` of `mesh`."""
    return decode_slices(batch_ordered(mesh, axes))


def batch_ordered(mesh: Mesh, axes: Any) -> np.ndarray:
    """`mesh`'s devices with the batch axes `axes` first, in their order (a device array)."""
    names = as_tuple(axes)
    order = names + tuple(a for a in mesh.axis_names if a not in names)
    return np.transpose(mesh.devices, [mesh.axis_names.index(a) for a in order])


END_TEST_EVERY = 16  # tokens between a decode's tests for its end across slices


def end_test_every(slices: int) -> int:
    """Steps between the decode loop's tests that every row is done: each is a reduction over the
    rows' devices, across slices over the data-center network, so there only every END_TEST_EVERY
    tokens (finished rows idle at most that many steps more); within one slice every token."""
    return 1 if slices == 1 else END_TEST_EVERY


def all_done(s: Any, every: int) -> jax.Array:
    """Every row of the decode loop's state `s` finished, tested at steps that are multiples of `every` (else False)."""
    if every == 1:
        return jnp.all(s.done)
    return jax.lax.cond(s.step % every == 0, jnp.all, lambda done: jnp.bool_(False), s.done)
