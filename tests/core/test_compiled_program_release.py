"""The test processes drop their compiled programs before XLA:CPU's code mappings reach the
kernel's cap (tests/conftest.py): a compile past `vm.max_map_count` segfaults inside LLVM."""

import jax
import jax.numpy as jnp

from grpo_core.testing import memory_map_count, release_compiled_programs

PROGRAMS = 40


def compile_programs(count: int) -> list:
    """`count` distinct compiled programs, kept alive by their jitted functions."""
    functions = [jax.jit(lambda x, k=k: jnp.tanh(x * (k + 1)).sum()) for k in range(count)]
    for function in functions:
        function(jnp.ones((4, 4))).block_until_ready()
    return functions


def test_compiled_programs_hold_mappings_until_released():
    start = memory_map_count()
    functions = compile_programs(PROGRAMS)
    held = memory_map_count()
    assert held - start >= 2 * PROGRAMS  # XLA:CPU maps about three regions per program
    assert release_compiled_programs(threshold=held + 1_000) is None
    assert memory_map_count() >= held - 10
    before, after = release_compiled_programs(threshold=held - 1)
    assert before >= held and after <= before - 2 * PROGRAMS
    assert functions[0](jnp.ones((4, 4))) == jnp.tanh(jnp.ones((4, 4))).sum()  # recompiles on demand
