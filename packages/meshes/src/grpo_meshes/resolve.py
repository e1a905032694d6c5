"""From the `mesh:` config section to a strategy and a jax Mesh."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple, Sequence, Union

from grpo_core.config import MeshConfig
from grpo_core.specs import MeshSpec
from jax.sharding import Mesh

from grpo_meshes.errors import MeshError
from grpo_meshes.shapes import looks_like_shape
from grpo_meshes.slices import check_slice_axis
from grpo_meshes.strategies import MeshStrategy

SpecSource = Union[None, Callable[[str], MeshSpec], Mapping[str, MeshSpec], Iterable[MeshSpec]]


class ResolvedMesh(NamedTuple):
    strategy: MeshStrategy
    mesh: Mesh


def resolve_strategy(mesh_config: MeshConfig, specs: SpecSource = None) -> MeshStrategy:
    """The strategy selected by `mesh.strategy` / `mesh.options`.

    specs: a registry lookup `name -> MeshSpec`, a mapping or an iterable of
    MeshSpecs; None uses the built-in strategies. A strategy value such as
    "1,-1,2" selects `explicit` with that shape.
    """
    name, options = _strategy_name_and_options(mesh_config)
    spec = _lookup(specs, name)
    return with_slices(spec.factory(make_options(spec, options)), mesh_config)


def with_slices(strategy: MeshStrategy, mesh_config: MeshConfig) -> MeshStrategy:
    """`strategy` across `mesh.slices` slices on `mesh.slice_axis` (grpo_meshes.slices)."""
    slices, axis = getattr(mesh_config, "slices", 1), getattr(mesh_config, "slice_axis", "dp")
    check_slice_axis(axis)
    if slices == 1:
        return strategy
    name = getattr(strategy, "name", mesh_config.strategy)
    if not isinstance(strategy, MeshStrategy) or not strategy.takes_slices:
        raise MeshError(f"mesh.strategy {name!r} cannot take mesh.slices={slices} (it lays devices out by "
                        f"process, not by slice); use mesh.strategy auto or an explicit 'dp,fsdp,tp' shape "
                        f"of one slice, or mesh.slices=1")
    if strategy.process_major and axis == "fsdp":
        raise MeshError(f"mesh.slice_axis=fsdp puts fsdp groups across slices, but mesh.strategy {name!r} was "
                        f"asked for fsdp within a host (options.fsdp_within_host); use mesh.slice_axis=dp")
    return dataclasses.replace(strategy, slices=slices, slice_axis=axis)


def build_mesh_from_config(mesh_config: MeshConfig, specs: SpecSource = None,
                           devices: Sequence[Any] | None = None) -> ResolvedMesh:
    """Resolve the strategy and build its Mesh over `devices` (default: all)."""
    strategy = resolve_strategy(mesh_config, specs)
    return ResolvedMesh(strategy, strategy.build_mesh(devices))


def _strategy_name_and_options(mesh_config: MeshConfig) -> tuple[str, Any]:
    name, options = str(mesh_config.strategy).strip(), mesh_config.options
    if not looks_like_shape(name):
        return name, options
    given = dict(options or {})
    if given.get("shape", name) != name:
        raise MeshError(f"mesh.strategy {name!r} and mesh.options.shape {given['shape']!r} disagree; "
                        f"give the shape in one place only")
    return "explicit", {**given, "shape": name}


def _lookup(specs: SpecSource, name: str) -> MeshSpec:
    if callable(specs) and not isinstance(specs, Mapping):
        return specs(name)
    table = _spec_table(specs)
    if name not in table:
        close = difflib.get_close_matches(name, list(table), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise MeshError(f"unknown mesh.strategy {name!r}; {hint}available: {', '.join(sorted(table))}, "
                        f"or an explicit shape such as '1,-1,2'")
    return table[name]


def _spec_table(specs: SpecSource) -> dict[str, MeshSpec]:
    if specs is None:
        from grpo_meshes.plugin import MESH_SPECS
        specs = MESH_SPECS
    if isinstance(specs, Mapping):
        return dict(specs)
    return {spec.name: spec for spec in specs}


def make_options(spec: MeshSpec, options: Any) -> Any:
    """An instance of the spec's options dataclass from a mapping (or as given)."""
    if isinstance(options, spec.options):
        return options
    options = dict(options or {})
    fields = {f.name: f for f in dataclasses.fields(spec.options)}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise MeshError(f"mesh.options for strategy {spec.name!r} has unknown key(s) {unknown}; "
                        f"valid keys: {sorted(fields) or 'none'}")
    missing = [n for n, f in fields.items() if n not in options and _is_required(f)]
    if missing:
        raise MeshError(f"mesh.options for strategy {spec.name!r} is missing {missing}; "
                        f"for example mesh: {{strategy: {spec.name}, options: {{{missing[0]}: ...}}}}")
    return spec.options(**options)


def _is_required(field: dataclasses.Field) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
