"""Helpers for tests that register an inline plugin on a fresh plugin manager.

Example::

    from grpo_core import LossSpec, hookimpl
    from grpo_core.testing import registry_with

    class MyPlugin:
        @hookimpl
        def grpo_losses(self):
            return [LossSpec("mine", build, Options, "my loss")]

    def test_mine():
        registry = registry_with(MyPlugin())
        assert registry.loss("mine").description == "my loss"
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Optional

from grpo_core.registry import Registry, build_registry


def cpu_test_xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test process or a run it starts: `devices` fake CPU devices, XLA:CPU's
    classic loop emitters, and the backend at optimization level 0. Tests compile thousands of
    small programs and run each for moments: XLA:CPU's newer fusion emitters compile a test of
    many decode programs about twice as slowly (tests/rollout/test_kept_shared.py: 155 s against
    75 s), and level 0 halves the compile again; what the tests check holds to a tolerance or
    between programs compiled alike. Where libtpu is installed (the TPU-compiler tests) the level
    stays the default: those tests check the TPU compiler's own figures."""
    flags = f"--xla_force_host_platform_device_count={devices} --xla_cpu_use_fusion_emitters=false"
    if importlib.util.find_spec("libtpu") is None:
        flags += " --xla_backend_optimization_level=0"
    return flags


def memory_map_count() -> int:
    """How many memory mappings this process holds (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/maps") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


def kernel_map_limit(default: int = 65530) -> int:
    """The kernel's cap on one process's memory mappings (`vm.max_map_count`)."""
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return default


def release_compiled_programs(threshold: int) -> Optional[tuple[int, int]]:
    """Drop JAX's compiled-program caches when this process holds more than `threshold` memory
    mappings; returns the counts (before, after) when it did. XLA:CPU maps three regions for each
    compiled program and frees them only with the program: a test process that compiles for half
    an hour reaches `vm.max_map_count`, and the next compile's mmap fails inside LLVM as a
    segmentation fault or abort. Dropping the caches costs only recompiles."""
    before = memory_map_count()
    if before <= threshold:
        return None
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
    return before, memory_map_count()


def registry_with(*plugins: Any, entry_points: bool = True) -> Registry:
    """A fresh registry holding the installed entry points (unless disabled) plus `plugins`."""
    return build_registry(plugins, entry_points=entry_points)


try:  # a pytest fixture when pytest is importable; grpo-core does not depend on pytest
    import pytest

    @pytest.fixture
    def inline_registry():
        """Call with plugin objects to get a fresh Registry that includes them."""
        return registry_with
except ImportError:  # pragma: no cover
    pass


class Multiply:
    """A minimal tool (the `Tool` contract) for multi-turn tests: the product of two integers."""

    name, description = "multiply", "Multiply two integers."
    parameters = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                  "required": ["a", "b"]}

    def __call__(self, arguments):
        return str(arguments["a"] * arguments["b"])


def assert_same_rollout(actual: Any, expected: Any) -> None:
    """Two RolloutResults of the same prompts and key sampled the same tokens (ids, masks, stop flags
    identical) with log-probs within 1e-5 (f32: two decodes that differ only in the order of their
    softmax or partial sums)."""
    import numpy as np

    for field in ("prompt_ids", "completion_ids", "completion_mask", "finished"):
        np.testing.assert_array_equal(getattr(actual, field), getattr(expected, field), err_msg=field)
    np.testing.assert_allclose(actual.sampler_logps, expected.sampler_logps, atol=1e-5, rtol=1e-5)


def with_random_adapters(model: Any, rank: int = 4, seed: int = 1) -> Any:
    """`model` with LoRA adapters on every linear layer, their b random (b = 0 at init would leave
    the adapters out of a check): for tests that must see per-token adapters change the output."""
    import jax
    from flax import nnx

    from grpo_core.models.lora import LoRASpec, add_adapters, resolve_targets

    add_adapters(model, LoRASpec(rank=rank, alpha=2.0 * rank, targets=resolve_targets(["all-linear"])),
                 jax.random.key(seed))
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        if path[-1] == "b":
            variable.set_value(0.1 * jax.random.normal(jax.random.key(len(path)), variable.shape))
    return model
