"""Multislice meshes: slices joined by the data-center network (DCN), the strategy's axes within each.

A strategy's shape is one slice's (its ICI axes); `mesh.slices: N` multiplies one axis,
`mesh.slice_axis` (dp by default, or fsdp), by N, the slice being the outer factor: on a
(dp, fsdp, tp) mesh with dp = N x d, indices [s*d, (s+1)*d) of dp are slice s. So a batch split
over dp (every rollout style, and training) puts each slice's rows on its own devices, and with
dp across slices the parameters are whole within a slice: decoding needs no DCN traffic, and
the gradient reduction over dp is the only collective that crosses it per step.

TPU devices of a multislice job carry `slice_index`; JAX's hybrid mesh lays them out (each
slice in its interconnect order). Devices without it (CPU, GPU hosts, fake devices in tests)
are cut into N equal groups in (process, id) order, so a slice is whole processes.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
from jax.experimental import mesh_utils

from grpo_meshes.errors import MeshError
from grpo_meshes.shapes import AXES, MeshShape, divisors

SLICE_AXES = ("dp", "fsdp")


def check_slice_axis(slice_axis: str) -> None:
    if slice_axis not in SLICE_AXES:
        raise MeshError(f"mesh.slice_axis {slice_axis!r} is not one of {list(SLICE_AXES)}; use dp (data "
                        f"parallel across slices, the default) or fsdp")


def dcn_shape(slices: int, slice_axis: str) -> MeshShape:
    """(dp, fsdp, tp) of the slices themselves: N on the slice axis, 1 elsewhere."""
    return tuple(slices if axis == slice_axis else 1 for axis in AXES)  # type: ignore[return-value]


def with_slices(ici: MeshShape, slices: int, slice_axis: str) -> MeshShape:
    """The whole mesh's shape: one slice's `ici` shape with the slice axis multiplied by `slices`."""
    return tuple(size * dcn for size, dcn in zip(ici, dcn_shape(slices, slice_axis)))  # type: ignore[return-value]


def slice_index(device: Any) -> int | None:
    return getattr(device, "slice_index", None)


def devices_per_slice(devices: Sequence[Any], slices: int) -> int:
    """Devices in one slice; raises MeshError when `slices` cannot cut them into equal slices."""
    found = {slice_index(d) for d in devices} - {None}
    if found and len(found) != slices:
        raise MeshError(f"mesh.slices={slices} but the {len(devices)} devices are on {len(found)} slice(s) "
                        f"(their slice_index); set mesh.slices={len(found)}")
    processes = len({d.process_index for d in devices})
    whole = processes if processes > 1 else len(devices)  # a slice is whole processes
    if len(devices) % slices or whole % slices:
        choices = divisors(whole)[:5]
        raise MeshError(f"mesh.slices={slices} does not cut the {len(devices)} devices on {processes} process(es) "
                        f"into equal slices of whole processes; use mesh.slices in {choices}")
    return len(devices) // slices


def slice_groups(devices: Sequence[Any], slices: int) -> list[list[Any]]:
    """The devices of each slice: by slice_index when the devices carry one, else N equal groups
    in (process, id) order."""
    size = devices_per_slice(devices, slices)
    if slice_index(devices[0]) is not None:
        return [sorted((d for d in devices if slice_index(d) == s), key=lambda d: d.id)
                for s in sorted({slice_index(d) for d in devices})]
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    return [ordered[i * size:(i + 1) * size] for i in range(slices)]


def multislice_grid(ici: MeshShape, slices: int, slice_axis: str, devices: Sequence[Any],
                    slice_grid: Callable[[MeshShape, list[Any]], np.ndarray], hybrid: bool) -> np.ndarray:
    """The [dp, fsdp, tp] device array of `slices` slices of shape `ici` each, stacked on the
    slice axis. `slice_grid` lays out one slice; `hybrid` lets JAX's hybrid mesh do it for TPU
    devices that carry a slice_index."""
    groups = slice_groups(devices, slices)
    if hybrid and slice_index(devices[0]) is not None:
        try:
            return mesh_utils.create_hybrid_device_mesh(ici, dcn_shape(slices, slice_axis), devices,
                                                        allow_split_physical_axes=True)
        except (NotImplementedError, ValueError):
            pass  # a slice shape the physical layout cannot split: each slice in plain order below
    return np.concatenate([slice_grid(ici, group) for group in groups], axis=AXES.index(slice_axis))


def device_slices(grid: np.ndarray, slices: int) -> np.ndarray:
    """The slice of every device of a mesh's device array (its slice_index, else the equal groups
    multislice_grid cut), in the array's shape."""
    flat = list(grid.flat)
    if slice_index(flat[0]) is not None:
        return np.vectorize(slice_index, otypes=[int])(grid)
    where = {id(d): s for s, group in enumerate(slice_groups(flat, slices)) for d in group}
    return np.vectorize(lambda d: where[id(d)], otypes=[int])(grid)
