"""Registers the built-in mesh strategies (entry point `grpo: meshes`)."""

from __future__ import annotations

from grpo_core import MeshSpec, hookimpl

from grpo_meshes.options import AutoOptions, ExplicitOptions, FsdpTpOptions, FullFsdpOptions, HostLocalOptions
from grpo_meshes.shapes import parse_shape
from grpo_meshes.strategies import HostLocalStrategy, MeshStrategy

FULL_FSDP_SHAPE = (1, -1, 1)


def build_auto(options: AutoOptions) -> MeshStrategy:
    return MeshStrategy("auto", FULL_FSDP_SHAPE)


def build_full_fsdp(options: FullFsdpOptions) -> MeshStrategy:
    return MeshStrategy("full_fsdp", FULL_FSDP_SHAPE)


def build_host_local(options: HostLocalOptions) -> MeshStrategy:
    return HostLocalStrategy("host_local")


def build_explicit(options: ExplicitOptions) -> MeshStrategy:
    return MeshStrategy("explicit", parse_shape(options.shape), process_major=options.fsdp_within_host)


def build_fsdp_tp(options: FsdpTpOptions) -> MeshStrategy:
    return MeshStrategy("fsdp_tp", (1, -1, options.tp), process_major=options.fsdp_within_host)


MESH_SPECS = (
    MeshSpec("auto", build_auto, AutoOptions,
             "Default: full-device FSDP, params and optimizer sharded over every device (1,-1,1)"),
    MeshSpec("full_fsdp", build_full_fsdp, FullFsdpOptions,
             "FSDP over all devices of all hosts (1,-1,1), same layout as auto"),
    MeshSpec("host_local", build_host_local, HostLocalOptions,
             "dp across processes, FSDP within each process (P,local,1)"),
    MeshSpec("explicit", build_explicit, ExplicitOptions,
             "options.shape 'dp,fsdp,tp' with at most one -1; also mesh.strategy: '2,-1,4'"),
    MeshSpec("fsdp_tp", build_fsdp_tp, FsdpTpOptions,
             "Tensor parallelism over options.tp devices, FSDP over the rest (1,-1,tp)"),
)


@hookimpl
def grpo_meshes() -> list[MeshSpec]:
    return list(MESH_SPECS)
