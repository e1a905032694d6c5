"""`grpo_core.hlo`: matmul FLOPs with loop trip counts and collective bytes, read off
compiled HLO (8 fake CPU devices, tests/conftest.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from grpo_core.hlo import HloModule, parse_instruction, shape_bytes
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

F32 = jnp.float32


def compiled_text(fn, *shapes) -> str:
    return jax.jit(fn).lower(*(jax.ShapeDtypeStruct(s, F32) for s in shapes)).compile().as_text()


def test_loop_bodies_count_once_per_iteration():
    def f(x, w):
        return jax.lax.fori_loop(0, 10, lambda i, x: jnp.tanh(x @ w), x) @ w

    module = HloModule(compiled_text(f, (64, 32), (32, 32)))
    assert module.matmul_flops() == 11 * 2 * 64 * 32 * 32  # 10 in the loop + 1 after it
    assert module.unknown_trip_counts == []


def test_loops_with_a_data_dependent_exit_are_listed():
    def f(x, w):
        return jax.lax.while_loop(lambda x: jnp.sum(x) < 1e3, lambda x: x @ w + 1.0, x)

    module = HloModule(compiled_text(f, (8, 16), (16, 16)))
    assert module.matmul_flops() == 2 * 8 * 16 * 16  # the body once
    assert len(module.unknown_trip_counts) == 1
    (loop,) = module.while_loops()
    body = [c for c in loop.callees() if module.matmul_flops(c)]
    assert len(body) == 1


def gather_loop(varying: bool):
    """5 iterations that all-gather a [64, 32] f32 weight sharded by rows (8 KiB per
    device); `varying`: the weight changes each iteration, so XLA cannot hoist it."""
    mesh = Mesh(np.asarray(jax.devices()).reshape(8), ("fsdp",))

    def loop(x, w):
        def body(i, carry):
            x, w = carry
            full = jax.lax.all_gather(w, "fsdp", tiled=True)
            return x + jnp.sum(full), w * 1.5 if varying else w
        return jax.lax.fori_loop(0, 5, body, (x, w))[0]

    fn = jax.shard_map(loop, mesh=mesh, in_specs=(P(), P("fsdp")), out_specs=P(), check_vma=False)
    return HloModule(compiled_text(fn, (4,), (64, 32)))


def test_all_gather_bytes_per_iteration():
    module = gather_loop(varying=True)
    assert module.collective_bytes().get("all-gather") == 5 * 64 * 32 * 4
    (loop,) = module.while_loops()
    assert max(module.collective_bytes(c).get("all-gather", 0) for c in loop.callees()) == 64 * 32 * 4


def test_loop_invariant_gather_is_hoisted_and_counted_once():
    assert gather_loop(varying=False).collective_bytes().get("all-gather") == 64 * 32 * 4


def test_every_element_type_counts_its_own_bytes():
    """float8 is 1 byte (it was counted as 4, so an fp8 decode's weights and caches looked 4x their size),
    s4 half a byte, bf16 2, pred 1, c64 8, across a tuple shape."""
    assert [shape_bytes(f"{dtype}[2,256]") for dtype in ("f8e4m3fn", "f8e5m2", "s4", "bf16", "pred", "c64")] == [
        512, 512, 256, 1024, 512, 4096]
    assert shape_bytes("(f8e4m3fn[4]{0}, f32[2]{0}, s4[3]{0})") == 4 + 8 + 2  # 1.5 bytes of s4 rounded up


def test_instruction_and_shape_parsing():
    inst = parse_instruction("  ROOT %t = (f32[2,3]{1,0}, bf16[4]{0}) tuple(%a, %b), metadata={x}")
    assert (inst.name, inst.op, inst.operands) == ("t", "tuple", ["a", "b"])
    assert shape_bytes(inst.shape) == 2 * 3 * 4 + 4 * 2
    assert parse_instruction("HloModule m") is None


# As the TPU compiler writes them: a scan with no known_trip_count annotation (its condition is only
# `counter < 3`, its body adds STEP to the counter), dots as convolutions (the k projection [8,16,256] x [256, 2 heads, 64]: a window over
# the heads, padded, so each output reads one tap), and one all-gather copied into two fusions, one
# of them the start of an asynchronous collective (so the transfer overlaps compute).
TPU_STYLE = """HloModule tpu_style

%cond (p: (s32[], bf16[8,16,256])) -> pred[] {
  %p = (s32[], bf16[8,16,256]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%gathered (w: bf16[64,2,64,1]) -> bf16[256,2,64,1] {
  %w = bf16[64,2,64,1]{3,2,1,0} parameter(0)
  %ag = bf16[256,2,64,1]{3,2,1,0} all-gather(%w), channel_id=7, dimensions={0}
  ROOT %s = bf16[256,2,64,1]{3,2,1,0} custom-call(%w, %ag), custom_call_target="AsyncCollectiveStart"
}

%reduced (g: f32[256]) -> f32[256] {
  %g = f32[256]{0} parameter(0)
  ROOT %ar = f32[256]{0} all-reduce(%g), channel_id=9, to_apply=%cond
}

%gathered.copy (w: bf16[64,2,64,1]) -> bf16[256,2,64,1] {
  %w = bf16[64,2,64,1]{3,2,1,0} parameter(0)
  ROOT %ag = bf16[256,2,64,1]{3,2,1,0} all-gather(%w), channel_id=7, dimensions={0}
}

%body (p: (s32[], bf16[8,16,256])) -> (s32[], bf16[8,16,256]) {
  %p = (s32[], bf16[8,16,256]{2,1,0}) parameter(0)
  %x = bf16[8,16,256,1]{3,2,1,0} parameter(1)
  %w = bf16[64,2,64,1]{3,2,1,0} parameter(2)
  %start = bf16[256,2,64,1]{3,2,1,0} fusion(%w), kind=kCustom, calls=%gathered
  %done = bf16[256,2,64,1]{3,2,1,0} fusion(%w), kind=kCustom, calls=%gathered.copy
  %k = f32[8,16,2,64]{3,2,1,0} convolution(%x, %done), window={size=1x2 pad=0_0x1_1 rhs_reversal=0x1}, dim_labels=0bf1_i1o0->0b1f
  %g = f32[256]{0} parameter(3)
  %sum = f32[256]{0} fusion(%g), kind=kLoop, calls=%reduced
  %i = s32[] get-tuple-element(%p), index=0
  %i.copy = s32[] copy(%i)
  %step = s32[] constant(STEP)
  %next = s32[] add(%i.copy, %step)
  %h = bf16[8,16,256]{2,1,0} get-tuple-element(%p), index=1
  ROOT %t = (s32[], bf16[8,16,256]{2,1,0}) tuple(%next, %h)
}

ENTRY %main (a: (s32[], bf16[8,16,256])) -> (s32[], bf16[8,16,256]) {
  %a = (s32[], bf16[8,16,256]{2,1,0}) parameter(0)
  ROOT %loop = (s32[], bf16[8,16,256]{2,1,0}) while(%a), condition=%cond, body=%body
}
"""


def test_tpu_style_scan_convolution_and_copied_collective():
    module = HloModule(TPU_STYLE.replace("STEP", "1"))
    (loop,) = module.while_loops()
    assert module.trip_count(loop) == 3
    assert module.matmul_flops() == 3 * 2 * 8 * 16 * 2 * 64 * 256
    assert module.unknown_trip_counts == []
    gathered, reduced = {"all-gather": 3 * 256 * 2 * 64 * 2}, {"all-reduce": 3 * 256 * 4}
    assert module.collective_bytes() == {**gathered, **reduced}
    assert module.collective_bytes(overlapped=True) == gathered
    assert module.collective_bytes(overlapped=False) == reduced


def test_a_loop_of_two_steps_per_iteration_runs_half_as_often():
    """The TPU compiler's collective matmul loops (windowed einsum) do two steps per iteration:
    counting `counter < 3` as 3 iterations there doubled the FSDP matmuls of a train step."""
    module = HloModule(TPU_STYLE.replace("STEP", "2"))
    (loop,) = module.while_loops()
    assert module.trip_count(loop) == 2
    assert module.matmul_flops() == 2 * 2 * 8 * 16 * 2 * 64 * 256


def test_a_counter_not_stepped_by_a_constant_has_no_trip_count():
    module = HloModule(TPU_STYLE.replace("%step = s32[] constant(STEP)", "%step = s32[] parameter(4)"))
    (loop,) = module.while_loops()
    assert module.trip_count(loop) is None
    assert module.matmul_flops() == 2 * 8 * 16 * 2 * 64 * 256
    assert module.unknown_trip_counts == [loop.name]


def test_collectives_are_counted_as_their_bytes_are():
    """One all-gather (copied into two fusions, one channel) and one all-reduce per iteration of 3;
    a loop of 5 all-gathers counts 5."""
    module = HloModule(TPU_STYLE.replace("STEP", "1"))
    assert module.collective_count() == {"all-gather": 3, "all-reduce": 3}
    assert module.collective_count(overlapped=True) == {"all-gather": 3}
    assert module.collective_count(overlapped=False) == {"all-reduce": 3}
    assert gather_loop(varying=True).collective_count() == {"all-gather": 5}
