"""Strategies resolve to the expected (dp, fsdp, tp) shape and device order on 8 CPU devices."""

import random
import warnings
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from grpo_core.config import MeshConfig
from grpo_core.registry import build_registry
from grpo_meshes import (
    AXES,
    HostLocalStrategy,
    MeshError,
    MeshStrategy,
    MeshWarning,
    build_mesh_from_config,
    fsdp_groups_spanning_processes,
    parse_shape,
    resolve_shape,
    resolve_strategy,
)
from grpo_meshes.plugin import MESH_SPECS


def mesh_for(strategy, **options):
    return build_mesh_from_config(MeshConfig(strategy=strategy, options=options)).mesh


def fake_devices(per_process):
    """Device stand-ins: `per_process` devices on each of len(per_process) processes, shuffled."""
    devices = [SimpleNamespace(id=1000 * p + i, process_index=p)
               for p, count in enumerate(per_process) for i in range(count)]
    random.Random(0).shuffle(devices)
    return devices


def test_eight_fake_devices_are_visible():
    assert jax.device_count() == 8


@pytest.mark.parametrize("strategy, options, shape", [
    ("auto", {}, (1, 8, 1)),
    ("full_fsdp", {}, (1, 8, 1)),
    ("host_local", {}, (1, 8, 1)),
    ("explicit", {"shape": "2,-1,2"}, (2, 2, 2)),
    ("1,-1,2", {}, (1, 4, 2)),
    ("-1,2,1", {}, (4, 2, 1)),
    (" 2, 4, 1 ", {}, (2, 4, 1)),
    ("fsdp_tp", {"tp": 4}, (1, 2, 4)),
])
def test_strategy_shape_and_device_order(strategy, options, shape):
    mesh = mesh_for(strategy, **options)
    assert mesh.axis_names == AXES
    assert tuple(mesh.shape[a] for a in AXES) == shape
    # On CPU the topology order is the jax.devices() order, row-major over (dp, fsdp, tp).
    assert mesh.devices.tolist() == np.asarray(jax.devices()).reshape(shape).tolist()
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_every_builtin_strategy_has_an_options_dataclass_and_description():
    assert {spec.name for spec in MESH_SPECS} == {"auto", "full_fsdp", "host_local", "explicit", "fsdp_tp"}
    assert all(spec.description for spec in MESH_SPECS)


def test_host_local_puts_processes_on_dp_and_orders_devices_by_process():
    devices = fake_devices([4, 4])
    strategy = HostLocalStrategy("host_local")
    grid = strategy.device_grid(devices)
    assert strategy.mesh_shape(devices) == (2, 4, 1)
    assert [[d.process_index for d in grid[dp, :, 0]] for dp in range(2)] == [[0] * 4, [1] * 4]
    assert [d.id for d in grid.flat] == [0, 1, 2, 3, 1000, 1001, 1002, 1003]
    assert fsdp_groups_spanning_processes(grid) == []


def test_host_local_rejects_uneven_processes():
    with pytest.raises(MeshError, match=r"same number of devices on every process, got \{0: 4, 1: 2\}"):
        HostLocalStrategy("host_local").mesh_shape(fake_devices([4, 2]))


def test_fsdp_across_processes_warns_only_when_host_local_was_asked_for():
    devices = fake_devices([4, 4, 4, 4])  # a v6e-16: 4 hosts x 4 chips
    strategy = MeshStrategy("explicit", (2, -1, 1), process_major=True)
    grid = strategy.device_grid(devices)  # dp=2 over 4 hosts: each fsdp group spans 2 hosts
    assert fsdp_groups_spanning_processes(grid) == [((0, 0), [0, 1]), ((1, 0), [2, 3])]
    from grpo_meshes.strategies import warn_if_fsdp_crosses_processes
    with pytest.warns(MeshWarning, match=r"mesh 2,8,1 puts 2 fsdp group\(s\) across processes .*'4,-1,1'"):
        warn_if_fsdp_crosses_processes(grid, "explicit")
    host_local_grid = MeshStrategy("explicit", (4, -1, 1), process_major=True).device_grid(devices)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_fsdp_crosses_processes(host_local_grid, "explicit")


def test_single_process_host_local_request_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mesh = mesh_for("explicit", shape="1,-1,1", fsdp_within_host=True)
    assert mesh.shape["fsdp"] == 8


@pytest.mark.parametrize("text, message", [
    ("1,-1", "has 2 entries, expected 3"),
    ("1,a,1", "not made of integers"),
    ("1,0,8", "invalid sizes fsdp=0"),
    ("-2,4,1", "invalid sizes dp=-2"),
    ("-1,-1,2", "has 2 entries of -1"),
])
def test_parse_shape_errors(text, message):
    with pytest.raises(MeshError, match=message):
        parse_shape(text)


def test_shape_product_must_match_device_count():
    with pytest.raises(MeshError, match=r"2,2,1 \(dp\*fsdp\*tp = 4\) does not match the 8 devices.*'2,-1,1'"):
        resolve_shape((2, 2, 1), 8)
    with pytest.raises(MeshError, match=r"3,-1,1 cannot fill 8 devices: the fixed axes multiply to 3"):
        resolve_shape((3, -1, 1), 8)
    with pytest.raises(MeshError, match="does not match the 8 devices"):
        mesh_for("4,4,1")


def test_resolve_errors_name_the_problem():
    with pytest.raises(MeshError, match="unknown mesh.strategy 'host_locl'; did you mean 'host_local'"):
        resolve_strategy(MeshConfig(strategy="host_locl"))
    with pytest.raises(MeshError, match=r"unknown key\(s\) \['tpp'\]; valid keys: \['fsdp_within_host', 'tp'\]"):
        resolve_strategy(MeshConfig(strategy="fsdp_tp", options={"tpp": 2}))
    with pytest.raises(MeshError, match=r"fsdp_tp' is missing \['tp'\]"):
        resolve_strategy(MeshConfig(strategy="fsdp_tp"))
    with pytest.raises(MeshError, match="mesh.options.tp must be an integer >= 1, got 0"):
        resolve_strategy(MeshConfig(strategy="fsdp_tp", options={"tp": 0}))
    with pytest.raises(MeshError, match="'1,-1,2' and mesh.options.shape '1,-1,4' disagree"):
        resolve_strategy(MeshConfig(strategy="1,-1,2", options={"shape": "1,-1,4"}))


@pytest.mark.filterwarnings("ignore::grpo_core.registry.PluginLoadWarning")
def test_strategies_come_through_the_plugin_registry():
    # Tolerant loading: this checks the grpo-meshes entry point whatever the other members' state.
    registry = build_registry(strict=False)
    assert {"auto", "explicit", "fsdp_tp", "full_fsdp", "host_local"} <= set(registry.names("mesh"))
    assert registry.provided("mesh", "auto").distribution == "grpo-meshes"
    strategy = resolve_strategy(MeshConfig(strategy="2,-1,4"), registry.mesh)
    assert strategy.mesh_shape() == (2, 1, 4)
