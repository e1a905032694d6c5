"""mesh.slices on 8 CPU devices: the slices multiply dp (or fsdp), each slice a contiguous group of
devices, and the rows of a rollout batch stay within one slice."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from grpo_core.config import MeshConfig
from grpo_meshes import (AXES, MeshError, build_mesh_from_config, resolve_strategy, rollout_batch_sharding,
                         train_batch_sharding)
from grpo_meshes.slices import device_slices


def sliced_mesh(strategy="auto", slices=2, slice_axis="dp", devices=None, **options):
    config = MeshConfig(strategy=strategy, options=options, slices=slices, slice_axis=slice_axis)
    return build_mesh_from_config(config, devices=devices).mesh


def shape_of(mesh):
    return tuple(mesh.shape[axis] for axis in AXES)


@pytest.mark.parametrize("strategy, options, slice_axis, shape", [
    ("auto", {}, "dp", (2, 4, 1)),
    ("auto", {}, "fsdp", (1, 8, 1)),
    ("1,-1,2", {}, "dp", (2, 2, 2)),
    ("fsdp_tp", {"tp": 2}, "fsdp", (1, 4, 2)),
    ("explicit", {"shape": "2,-1,1", "fsdp_within_host": True}, "dp", (4, 2, 1)),
])
def test_slices_multiply_the_slice_axis_of_one_slices_shape(strategy, options, slice_axis, shape):
    mesh = sliced_mesh(strategy, slice_axis=slice_axis, **options)
    assert mesh.axis_names == AXES and shape_of(mesh) == shape
    # each slice is a contiguous half of the devices, the outer half of the slice axis
    slices = device_slices(mesh.devices, 2)
    half = shape[AXES.index(slice_axis)] // 2
    assert (np.take(slices, range(half), axis=AXES.index(slice_axis)) == 0).all()
    assert (np.take(slices, range(half, 2 * half), axis=AXES.index(slice_axis)) == 1).all()
    assert {d.id for d in mesh.devices.flat if slices[np.where(mesh.devices == d)][0] == 0} == \
        {d.id for d in jax.devices()[:4]}


@pytest.mark.parametrize("style", ["legacy", "maxtext"])
def test_rows_of_a_rollout_batch_stay_within_one_slice(style):
    mesh = sliced_mesh("1,-1,2")
    slices = dict(zip(mesh.devices.flat, device_slices(mesh.devices, 2).flat))
    for sharding in (rollout_batch_sharding(mesh, style), train_batch_sharding(mesh)):
        rows_on = {}
        for device, index in sharding.devices_indices_map((16, 4)).items():
            for row in range(16)[index[0]]:
                rows_on.setdefault(row, set()).add(slices[device])
        # every row on one slice only (no row decoded twice, no row's work across the DCN), half per slice
        assert all(len(on) == 1 for on in rows_on.values())
        assert [on.pop() for _, on in sorted(rows_on.items())] == [0] * 8 + [1] * 8


def fake_devices(processes, per_process, slice_of=None):
    return [SimpleNamespace(id=100 * p + i, process_index=p, platform="cpu", device_kind="cpu",
                            **({} if slice_of is None else {"slice_index": slice_of(p)}))
            for p in range(processes) for i in range(per_process)]


def test_slices_are_whole_processes_and_follow_slice_index():
    strategy = resolve_strategy(MeshConfig(slices=2))
    grid = strategy.device_grid(fake_devices(4, 2)[::-1])
    assert grid.shape == (2, 4, 1)
    assert [sorted({d.process_index for d in grid[i].flat}) for i in range(2)] == [[0, 1], [2, 3]]
    tagged = fake_devices(4, 2, slice_of=lambda p: 1 - p // 2)  # slice 1 holds processes 0 and 1
    grid = strategy.device_grid(tagged)
    assert [sorted({d.process_index for d in grid[i].flat}) for i in range(2)] == [[2, 3], [0, 1]]


@pytest.mark.parametrize("config, devices, message", [
    (MeshConfig(slices=3), None, "mesh.slices=3 does not cut the 8 devices on 1 process(es) into equal slices"),
    (MeshConfig(slices=4), fake_devices(2, 4), "mesh.slices=4 does not cut the 8 devices on 2 process(es)"),
    (MeshConfig(slices=2), fake_devices(2, 4, slice_of=lambda p: 0), "devices are on 1 slice(s)"),
    (MeshConfig(slices=1), fake_devices(2, 4, slice_of=lambda p: p), "set mesh.slices=2"),
    (MeshConfig(strategy="host_local", slices=2), None, "'host_local' cannot take mesh.slices=2"),
    (MeshConfig(strategy="1,-1,1", options={"fsdp_within_host": True}, slices=2, slice_axis="fsdp"), None,
     "use mesh.slice_axis=dp"),
    (MeshConfig(slices=2, slice_axis="tp"), None, "mesh.slice_axis 'tp' is not one of ['dp', 'fsdp']"),
])
def test_bad_slices_are_refused_in_one_line(config, devices, message):
    with pytest.raises(MeshError) as error:
        resolve_strategy(config).device_grid(devices)
    assert message in str(error.value) and "\n" not in str(error.value)
