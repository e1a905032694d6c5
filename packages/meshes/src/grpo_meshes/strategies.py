"""Mesh strategies: how the devices are laid out on the ("dp", "fsdp", "tp") axes.

A strategy is what a `MeshSpec` factory returns. The runner uses
  strategy.mesh_shape(devices=None) -> (dp, fsdp, tp)
  strategy.build_mesh(devices=None) -> jax.sharding.Mesh
  strategy.param_rules, strategy.activation_rules   (see grpo_meshes.rules)
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from grpo_meshes.errors import MeshError, MeshWarning
from grpo_meshes.rules import PARAM_RULES, TRAIN_ACTIVATION_RULES, Rules
from grpo_meshes.shapes import AXES, MeshShape, format_shape, resolve_shape
from grpo_meshes.slices import check_slice_axis, devices_per_slice, multislice_grid, with_slices


@dataclass(frozen=True)
class MeshStrategy:
    """A fixed "dp,fsdp,tp" shape (one entry may be -1) and a device order.

    process_major: lay devices out process by process (dp across hosts,
    fsdp/tp inside a host) instead of in the interconnect topology order, and
    warn when the shape still puts an fsdp group on several processes.
    slices, slice_axis: `shape` is one slice's; the slices multiply
    `slice_axis` (grpo_meshes.slices).
    """

    name: str
    shape: tuple[int, int, int]
    process_major: bool = False
    param_rules: Rules = field(default=PARAM_RULES, repr=False)
    activation_rules: Rules = field(default=TRAIN_ACTIVATION_RULES, repr=False)
    slices: int = 1
    slice_axis: str = "dp"
    takes_slices: ClassVar[bool] = True  # whether mesh.slices > 1 may be applied to it

    def __post_init__(self) -> None:
        check_slice_axis(self.slice_axis)

    def mesh_shape(self, devices: Sequence[Any] | None = None) -> MeshShape:
        devices = _devices(devices)
        if self.slices == 1:
            return self.slice_shape(devices)
        return with_slices(self.slice_shape(devices[:devices_per_slice(devices, self.slices)]), self.slices,
                           self.slice_axis)

    def slice_shape(self, devices: Sequence[Any]) -> MeshShape:
        """(dp, fsdp, tp) of one slice of `devices`."""
        return resolve_shape(self.shape, len(devices))

    def device_grid(self, devices: Sequence[Any] | None = None) -> np.ndarray:
        """Devices arranged as a [dp, fsdp, tp] array."""
        devices = _devices(devices)
        per_slice = devices_per_slice(devices, self.slices) if self.takes_slices else len(devices)
        if self.slices > 1:
            ici = self.slice_shape(devices[:per_slice])
            return multislice_grid(ici, self.slices, self.slice_axis, devices, self._slice_grid,
                                   hybrid=not self.process_major)
        return self._slice_grid(self.mesh_shape(devices), devices)

    def _slice_grid(self, shape: MeshShape, devices: list[Any]) -> np.ndarray:
        if self.process_major:
            return np.asarray(sorted(devices, key=lambda d: (d.process_index, d.id))).reshape(shape)
        return _topology_grid(shape, devices)

    def build_mesh(self, devices: Sequence[Any] | None = None) -> Mesh:
        grid = self.device_grid(devices)
        if self.process_major:
            warn_if_fsdp_crosses_processes(grid, self.name)
        # Auto axes: the models rely on sharding propagation inside jit.
        return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


@dataclass(frozen=True)
class HostLocalStrategy(MeshStrategy):
    """dp = number of processes, fsdp = devices per process, tp = 1."""

    shape: tuple[int, int, int] = (-1, -1, 1)  # sizes come from the devices, see slice_shape
    process_major: bool = True
    takes_slices: ClassVar[bool] = False  # dp is the processes already, across every slice

    def slice_shape(self, devices: Sequence[Any]) -> MeshShape:
        per_process = devices_per_process(devices)
        counts = {len(group) for group in per_process.values()}
        if len(counts) != 1:
            sizes = {p: len(group) for p, group in sorted(per_process.items())}
            raise MeshError(
                f"host_local needs the same number of devices on every process, got {sizes} "
                f"(process -> devices); give every process the same devices or use an explicit "
                f"mesh.strategy such as '1,-1,1'")
        return (len(per_process), counts.pop(), 1)


def _devices(devices: Sequence[Any] | None) -> list[Any]:
    return list(jax.devices() if devices is None else devices)


def devices_per_process(devices: Sequence[Any]) -> dict[int, list[Any]]:
    groups: dict[int, list[Any]] = defaultdict(list)
    for device in devices:
        groups[device.process_index].append(device)
    return dict(groups)


def _topology_grid(shape: MeshShape, devices: list[Any]) -> np.ndarray:
    """Interconnect-aware order on TPU (rings along each axis); list order elsewhere."""
    try:
        return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (NotImplementedError, ValueError):
        # Some TPU slice shapes cannot be split this way; plain order still works.
        return np.asarray(devices).reshape(shape)


def fsdp_groups_spanning_processes(grid: np.ndarray) -> list[tuple[tuple[int, int], list[int]]]:
    """[((dp, tp), processes)] for every fsdp group of a [dp, fsdp, tp] device
    grid (e.g. `mesh.devices`) whose devices sit on several processes."""
    spanning = []
    for dp in range(grid.shape[0]):
        for tp in range(grid.shape[2]):
            processes = sorted({d.process_index for d in grid[dp, :, tp]})
            if len(processes) > 1:
                spanning.append(((dp, tp), processes))
    return spanning


def warn_if_fsdp_crosses_processes(grid: np.ndarray, strategy: str) -> None:
    """Warn when host-local behaviour was asked for but fsdp groups span hosts."""
    spanning = fsdp_groups_spanning_processes(grid)
    if not spanning:
        return
    (dp, tp), processes = spanning[0]
    shape = format_shape(grid.shape)
    process_count = len({d.process_index for d in grid.flat})
    warnings.warn(
        f"mesh.strategy {strategy!r} asked for fsdp within a host, but mesh {shape} puts "
        f"{len(spanning)} fsdp group(s) across processes (the one at dp={dp}, tp={tp} spans "
        f"processes {processes}), so parameter all-gathers cross the slower host network; "
        f"make dp a multiple of the {process_count} processes, e.g. mesh.strategy "
        f"'{process_count},-1,1' or host_local", MeshWarning, stacklevel=3)
