"""Collective latency in the projection: each collective the compiled HLO issues costs the chip's
`collective_latency_us` besides its bytes over the ICI bandwidth, and `gather_weights: auto`
compares the decode layouts with it. Hand-made HLO in the shape the TPU compiler writes a decode
(a while loop that stops on its data), so every count is known exactly."""

from __future__ import annotations

import dataclasses

import pytest
from grpo_rollout.gather import fastest_layout
from grpo_core.hlo import HloModule
from grpo_runner_gsm8k.costs.roofline import (call_seconds, decode_seconds, phase_cost, roofline, setup_seconds,
                                                split_collectives)
from grpo_runner_gsm8k.costs.tpu_target import GENERATIONS, parse_target, with_chip

V6E = GENERATIONS["v6e"]


def decode_hlo(state: str, per_token: int, per_token_op: str, setup_gather: str = "") -> str:
    """A decode loop carrying `state` (what each token reads from HBM), issuing `per_token`
    `per_token_op` collectives of f32[16,256] (or all-gathers of bf16[512,1024] shards) per token,
    after an optional all-gather of `setup_gather` once before the loop."""
    shapes = {"all-reduce": ("f32[16,256]{1,0}", "to_apply=%sum"),
              "all-gather": ("bf16[4096,1024]{1,0}", "dimensions={0}")}
    shape, attrs = shapes[per_token_op]
    ops = "\n".join(f"  %c{i} = {shape} {per_token_op}(%h), channel_id={i + 1}, {attrs}" for i in range(per_token))
    setup = f"  %g = {setup_gather} all-gather(%w), channel_id=99, dimensions={{0}}\n" if setup_gather else ""
    return f"""HloModule decode_style

%cond (p: (pred[], {state})) -> pred[] {{
  %p = (pred[], {state}) parameter(0)
  ROOT %go = pred[] get-tuple-element(%p), index=0
}}

%sum (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

%body (p: (pred[], {state})) -> (pred[], {state}) {{
  %p = (pred[], {state}) parameter(0)
  %h = bf16[512,1024]{{1,0}} parameter(1)
{ops}
  ROOT %t = (pred[], {state}) copy(%p)
}}

ENTRY %main (a: (pred[], {state}), w: bf16[512,1024]) -> (pred[], {state}) {{
  %a = (pred[], {state}) parameter(0)
  %w = bf16[512,1024]{{1,0}} parameter(1)
{setup}  ROOT %loop = (pred[], {state}) while(%a), condition=%cond, body=%body
}}
"""


@dataclasses.dataclass
class HandMade:
    """Stands in for a compiled program: its HLO text is all the cost model reads of a decode."""

    text: str

    def as_text(self) -> str:
        return self.text


def latency(us: float):
    return dataclasses.replace(V6E, collective_latency_us=us)


def test_latency_term_is_collectives_times_latency():
    cost = phase_cost(HandMade(decode_hlo("bf16[1048576]", 4, "all-reduce", setup_gather="bf16[4096,1024]")))
    assert (cost.collectives, cost.overlapped_collectives, cost.setup_collectives) == (4, 0, 1)
    assert cost.collective_bytes == 4 * 16 * 256 * 4 and cost.setup_collective_bytes == 4096 * 1024 * 2
    for us in (1.0, V6E.collective_latency_us, 40.0):
        assert call_seconds(latency(us), cost) - call_seconds(latency(0), cost) == pytest.approx(4 * us * 1e-6)
        assert setup_seconds(latency(us), cost) - setup_seconds(latency(0), cost) == pytest.approx(us * 1e-6)
        assert decode_seconds(latency(us), HandMade(decode_hlo("bf16[1048576]", 4, "all-reduce")), 100) - \
            decode_seconds(latency(0), HandMade(decode_hlo("bf16[1048576]", 4, "all-reduce")), 100) == \
            pytest.approx(100 * 4 * us * 1e-6)


def test_overlapped_collectives_hide_behind_compute_with_their_latency():
    compute = 1e12 / (V6E.peak_tflops * 1e12)  # 1 TFLOP
    assert roofline(V6E, 1e12, 0, 0, overlapped_bytes=1e6, overlapped_count=10) == pytest.approx(compute)
    alone = 1e6 / (V6E.ici_gbps * 1e9) + 10 * V6E.collective_latency_us * 1e-6
    assert roofline(V6E, 0, 0, 0, overlapped_bytes=1e6, overlapped_count=10) == pytest.approx(alone)


# Per token: gathered reads 8 MiB of weights, no collective (they were gathered once, 8 MiB over ICI);
# model-parallel reads 1 MiB and runs 4 small all-reduces; sharded reads 1 MiB and all-gathers 8 MiB.
LAYOUTS = {"gathered": decode_hlo("bf16[4194304]", 0, "all-reduce", setup_gather="bf16[4096,1024]"),
           "sharded": decode_hlo("bf16[524288]", 1, "all-gather"),
           "model_parallel": decode_hlo("bf16[524288]", 4, "all-reduce", setup_gather="bf16[512,1024]")}


def chosen_layout(chip) -> str:
    layout, _, note = fastest_layout(lambda name: HandMade(LAYOUTS[name]), lambda program: True,
                                     lambda program: decode_seconds(chip, program, 100), tuple(LAYOUTS), 100)
    assert note.startswith(f"gather_weights=auto: {layout} weights, the fastest projected decode of 100 steps")
    return layout


def test_decode_layout_choice_flips_when_latency_is_large_enough():
    # Without latency the 4 small all-reduces per token are nearly free: model-parallel reads 1/8
    # of the weights. At the table's 5 us, 4 x 5 us per token outweighs the 8x weight reads.
    assert chosen_layout(latency(0)) == "model_parallel"
    assert chosen_layout(latency(0.5)) == "model_parallel"
    assert chosen_layout(latency(V6E.collective_latency_us)) == "gathered"


def test_chip_table_latency_is_labelled_and_overridable():
    assert all(g.collective_latency_us > 0 and g.latency_source.startswith("derived") for g in GENERATIONS.values())
    target = with_chip(parse_target("v6e-8"), "collective_latency_us=10")
    assert (target.generation.collective_latency_us, target.generation.latency_source) == (10.0, "--chip")
    assert with_chip(parse_target("v6e-8"), "collective_latency_us=0").generation.collective_latency_us == 0


# Across slices (mesh.slices): what the TPU compiler sends between slices (a megascale host transfer)
# and a collective whose replica groups pair devices of two slices cost the DCN latency plus their
# bytes over the chip's share of its host's DCN bandwidth.
DCN_SEND = ('  %tok = token[] after-all()\n'
            '  %sent = (f32[256,1024]{1,0}, u32[], token[]) send(%x, %tok), channel_id=7, is_host_transfer=true, '
            'frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}\n'
            '  %sent-done = token[] send-done(%sent), channel_id=7, is_host_transfer=true, '
            'frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}\n')


def dcn_decode_hlo() -> str:
    """A decode loop whose every token sends 1 MiB (f32[256,1024]) to the other slice."""
    text = decode_hlo("f32[256,1024]", 0, "all-reduce")
    body = "  %h = bf16[512,1024]{1,0} parameter(1)\n"
    return text.replace(body, body + "  %x = f32[256,1024]{1,0} parameter(2)\n" + DCN_SEND)


def test_a_transfer_between_slices_is_priced_from_the_dcn_figures_count_by_hand():
    cost = phase_cost(HandMade(dcn_decode_hlo()))
    assert (cost.dcn.exposed_bytes, cost.dcn.exposed, cost.collectives) == (1048576, 1, 0)
    chip = dataclasses.replace(parse_target("2xv6e-8").generation, dcn_latency_us=20.0)
    assert (chip.dcn_host_gbps, chip.host_chips) == (25.0, 8)  # 2 x 100 Gbit/s per host, shared by 8 chips
    # per token: the carried state once from HBM (pred + f32[256,1024]), then 1 MiB at 25/8 GB/s + 20 us
    hand = (1 + 1048576) / 1638e9 + 1048576 / 3.125e9 + 20e-6
    assert call_seconds(chip, cost) == pytest.approx(hand, rel=1e-12)
    faster = with_chip(parse_target("2xv6e-8"), "dcn_host_gbps=50,dcn_latency_us=0").generation
    assert call_seconds(faster, cost) == pytest.approx((1 + 1048576) / 1638e9 + 1048576 / 6.25e9, rel=1e-12)
    assert (faster.dcn_source, faster.dcn_latency_source) == ("--chip", "--chip")


def test_a_collective_whose_groups_span_slices_is_counted_across_them():
    text = ("HloModule groups\n\n%sum (a: f32[], b: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n"
            "  %b = f32[] parameter(1)\n  ROOT %s = f32[] add(%a, %b)\n}\n\n"
            "ENTRY %main (w: f32[1024]) -> f32[1024] {\n  %w = f32[1024]{0} parameter(0)\n"
            "  %within = f32[1024]{0} all-reduce(%w), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, "
            "use_global_device_ids=true, to_apply=%sum\n"
            "  ROOT %across = f32[1024]{0} all-reduce(%within), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), "
            "use_global_device_ids=true, to_apply=%sum\n}\n")
    within, across = split_collectives(HloModule(text), None, [0, 0, 0, 0, 1, 1, 1, 1])
    assert (within.exposed_bytes, within.exposed) == (4096, 1)
    assert (across.exposed_bytes, across.exposed) == (4096, 1)
    # the same program on one slice: both within
    assert split_collectives(HloModule(text), None, None)[0].exposed == 2
