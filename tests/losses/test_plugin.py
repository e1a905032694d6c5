"""The `grpo` entry point registers the built-in loss implementations."""

from __future__ import annotations

import dataclasses
from importlib.metadata import entry_points

import jax.numpy as jnp
import pluggy
from grpo_core import LossSpec, hookspecs
from grpo_losses import FusedOptions, PallasOptions, TokenLogps


def registered_specs() -> dict[str, LossSpec]:
    (entry,) = entry_points(group="grpo", name="losses")
    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    manager.register(entry.load(), name=entry.name)
    return {spec.name: spec for specs in manager.hook.grpo_losses() for spec in specs}


def test_entry_point_exposes_jax_fused_pallas():
    specs = registered_specs()
    assert set(specs) == {"jax", "fused", "pallas"}
    assert specs["fused"].options is FusedOptions and specs["pallas"].options is PallasOptions
    assert all(isinstance(spec, LossSpec) and spec.description for spec in specs.values())


def test_factories_build_working_impls(helpers):
    p = helpers.make_problem(1, 3, 8, 40, seed=40)
    results = {}
    for name, spec in registered_specs().items():
        impl = spec.factory(spec.options())
        out = impl(p.hidden, p.lm_head, p.targets, 1.0, entropy=True)
        assert isinstance(out, TokenLogps) and out.logp.shape == (1, 3) and out.entropy.shape == (1, 3)
        results[name] = out.logp
    assert jnp.allclose(results["fused"], results["jax"], atol=1e-5)
    assert jnp.allclose(results["pallas"], results["jax"], atol=1e-5)


def test_options_are_frozen_dataclasses_with_defaults():
    for options in (FusedOptions, PallasOptions):
        assert dataclasses.is_dataclass(options) and options.__dataclass_params__.frozen
        options()  # every field has a default, so an empty `options:` block is valid
