"""`grpo-run --plan --target`'s projected time: the FLOPs and HBM bytes it reads off the TPU
compiler's programs equal a count by hand for prefill, one decode step and the train step."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from grpo_core.registry import default_registry
from grpo_runner_gsm8k import plan
from grpo_runner_gsm8k.costs import tpu_target
from grpo_runner_gsm8k.costs import flops
from grpo_runner_gsm8k.costs.roofline import phase_cost
from grpo_runner_gsm8k.plan.projection import PartialRounds, project, projection_json, projection_lines

pytest.importorskip("libtpu")

# Wide enough that the matmul weights, the KV cache and the LM head dominate what a count by hand
# leaves out (the sampler's and the batch's small arrays, TPU tile padding): within 5% bounds that
# remainder (it is under 1% at these shapes). Dense XLA attention: every FLOP is in the HLO.
SMALL = ["model.architecture.vocab_size=4096", "model.architecture.hidden_size=512",
         "model.architecture.intermediate_size=1024", "model.architecture.num_attention_heads=4",
         "model.architecture.num_key_value_heads=2", "model.architecture.max_position_embeddings=128",
         "model.dtype=bfloat16", "model.param_dtype=float32", "model.remat=none", "loss.impl=jax",
         "rollout.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=17", "model.attention=xla",
         "train.micro_batch_size_per_device=4", "rollout.options.cache_dtype=bfloat16",
         "rollout.options.gather_weights=true"]
DEVICES = 4  # v5e-4, full-device FSDP


def planned(tmp_path_factory, *overrides: str, chip: str = ""):
    """(inputs, phases, projection) of SMALL with `overrides` on a v5e-4 (its figures replaced by `chip`)."""
    from grpo_core.config_io import load_config

    cfg = load_config(str(Path(__file__).parents[2] / "configs" / "tiny.yaml"),
                      [f"logging.dir={tmp_path_factory.mktemp('run')}", *SMALL, *overrides], registry=default_registry())
    target = plan.parse_target("v5e-4")
    target = tpu_target.with_chip(target, chip) if chip else target
    inputs = plan.build_plan_inputs(cfg, default_registry(), target)
    capacity = plan.device_capacity(None, target)
    phases = plan.fixed_phases(inputs, capacity) + [plan.train_phase(inputs, 4)]
    return inputs, phases, project(inputs, target.generation, phases)


@pytest.fixture(scope="module")
def projected(tmp_path_factory):
    inputs, _, projection = planned(tmp_path_factory)
    return inputs, projection

ROWS, PROMPT, NEW = 32, 16, 17
SLOTS = PROMPT + NEW - 1  # a row attends over its prompt and every sampled token but the last
PROMPTS = ROWS // 4  # rollout.n=4: rollout.options.shared_prompt caches each prompt once per group
CACHED_SLOTS = PROMPTS * PROMPT + ROWS * (NEW - 1)  # (row, slot) pairs held: prompts once, completions per row


def weight_count(q) -> int:
    """Parameters by hand: tied embedding, per layer the matmul kernels + q/k/v biases + 2 norms, final norm."""
    biases = (q.num_attention_heads + 2 * q.num_key_value_heads) * q.head_dim
    return q.vocab_size * q.hidden_size + q.num_hidden_layers * (flops.layer_params(q) + biases + 2 * q.hidden_size) \
        + q.hidden_size


def cache_bytes(q) -> int:
    """bfloat16 K and V of every layer and cached (row, slot), all devices."""
    return 2 * q.num_hidden_layers * CACHED_SLOTS * q.num_key_value_heads * q.head_dim * 2


def dense_forward_flops(q, rows: int, width: int, slots: int, head_columns: int) -> float:
    """Matmuls of a forward whose attention scores every query against every one of `slots` keys."""
    heads = q.num_attention_heads * q.head_dim
    return rows * (2.0 * q.num_hidden_layers * flops.layer_params(q) * width
                   + 4.0 * q.num_hidden_layers * heads * width * slots + 2.0 * q.hidden_size * q.vocab_size * head_columns)


def test_prefill_is_the_count_by_hand(projected):
    inputs, projection = projected
    q, prefill = inputs.run.qcfg, projection.phases["rollout prefill"]
    # each prompt once, attending over its own slots; its logits serve its n rows
    assert prefill.flops == pytest.approx(dense_forward_flops(q, PROMPTS, PROMPT, PROMPT, 1) / DEVICES, rel=0.05)
    # reads its weight shards, writes the prompts' cache and the rows' empty completion cache
    assert prefill.hbm_bytes == pytest.approx((weight_count(q) * 2 + cache_bytes(q)) / DEVICES, rel=0.05)


def test_one_decode_step_is_the_count_by_hand(projected):
    inputs, projection = projected
    q, decode = inputs.run.qcfg, projection.phases["rollout decode"]
    assert decode.flops == pytest.approx(flops.decode_step_flops(q, ROWS, SLOTS) / DEVICES, rel=0.05)
    # every token reads the whole gathered bfloat16 weights and its rows' cache
    assert decode.hbm_bytes == pytest.approx(weight_count(q) * 2 + cache_bytes(q) / DEVICES, rel=0.05)
    assert decode.setup_seconds > 0  # the weights gathered once per rollout


def test_model_parallel_decode_step_reads_a_quarter_of_the_split_weights(tmp_path_factory):
    """Heads, MLP columns and the vocabulary split over the 4 chips; the 2 KV heads, biases of
    k/v and the norms replicated; each chip holds its rows' cache. Each chip projects k and v for
    every row (kept replicated until the cache write; grpo_rollout.attention.decode_layers)."""
    inputs, _, projection = planned(tmp_path_factory, "rollout.options.gather_weights=model_parallel")
    q, decode = inputs.run.qcfg, projection.phases["rollout decode"]
    kv = 2 * q.hidden_size * q.num_key_value_heads * q.head_dim
    split = q.vocab_size * q.hidden_size + q.num_hidden_layers * (
        flops.layer_params(q) - kv + q.num_attention_heads * q.head_dim)
    replicated = q.num_hidden_layers * (kv + 2 * q.num_key_value_heads * q.head_dim + 2 * q.hidden_size) + q.hidden_size
    assert decode.hbm_bytes == pytest.approx(2 * (split / DEVICES + replicated) + cache_bytes(q) / DEVICES, rel=0.05)
    kv_projections = q.num_hidden_layers * 2 * ROWS * kv  # FLOPs of the k and v projections, all rows
    assert decode.flops == pytest.approx(flops.decode_step_flops(q, ROWS, SLOTS) / DEVICES
                                         + kv_projections * (1 - 1 / DEVICES), rel=0.05)


def auto_layout(tmp_path_factory, latency_us: float) -> tuple[str, dict[str, float]]:
    """(layout `gather_weights: auto` chose, projected decode seconds of each) at `latency_us`;
    the chosen one is the fastest, and its decode phase is what the projection prices."""
    _, phases, projection = planned(tmp_path_factory, "rollout.options.gather_weights=auto",
                                    chip=f"collective_latency_us={latency_us}")
    note = next(p.note for p in phases if p.name == "rollout decode")
    times = {name: float(seconds) for name, seconds in re.findall(r"(gathered|sharded|model_parallel|head_parallel) ([\d.]+) s", note)}
    assert set(times) == {"gathered", "sharded", "model_parallel", "head_parallel"}, note
    chosen = re.match(r"gather_weights=auto: (\w+) weights, the fastest projected decode of 16 steps", note).group(1)
    assert times[chosen] == min(times.values())
    decode = projection.phases["rollout decode"]
    assert decode.setup_seconds + 16 * decode.seconds == pytest.approx(times[chosen], abs=0.006)
    return chosen, times


def test_auto_decode_is_the_fastest_layout_and_flips_when_collective_latency_is_large_enough(tmp_path_factory):
    """Model-parallel reads a quarter of the weights per token but runs collectives every token;
    gathered runs none after its one gather. Without latency the first is the faster at SMALL; at
    1 ms per collective the second (the same programs, only the latency changed)."""
    free, free_times = auto_layout(tmp_path_factory, 0)
    costly, costly_times = auto_layout(tmp_path_factory, 1000)
    assert (free, costly) == ("model_parallel", "gathered"), (free_times, costly_times)
    assert costly_times["model_parallel"] - free_times["model_parallel"] > 16 * 1e-3  # >= 1 collective per token


PARTIAL = ["rollout.partial.enabled=true", "loss.mismatch_correction=truncate", "rollout.partial.budget=4",
           "rollout.partial.kv_cache=within_step"]


def test_a_partial_step_is_its_rounds(tmp_path_factory):
    """A row of 17 tokens holds its slot ceil(17 / 4) = 5 rounds: on 64 slots a step that trains 32
    rows runs 32 x 5 / 64 = 2.5 rounds (grpo_rollout.partial's steady state, checked there), each
    the prompt table, the compaction, the weights' gather and 4 decode steps; the carried rows are
    admitted once per step under the new weights (within_step), and the update runs once. Rows of
    3 tokens: 0.5 rounds of 3 steps."""
    _, _, projection = planned(tmp_path_factory, *PARTIAL, "rollout.partial.slots=64")
    p, decode = projection.phases, projection.phases["rollout decode"]
    assert projection.partial == PartialRounds(slots=64, rows=ROWS, budget=4, carried_admission="step")
    assert set(p) == {"rollout prompt table", "rollout compaction", "rollout admission of carried rows",
                      "rollout decode", "train step"}
    round_start = p["rollout prompt table"].seconds + p["rollout compaction"].seconds + decode.setup_seconds
    once = p["rollout admission of carried rows"].seconds + p["train step"].seconds
    assert projection.step_seconds(NEW) == pytest.approx(2.5 * (round_start + 4 * decode.seconds) + once)
    assert projection.step_seconds(3) == pytest.approx(0.5 * (round_start + 3 * decode.seconds) + once)
    assert "2.5 rounds of 4 decode steps" in projection_lines(projection, [NEW])[-2]


def test_auto_slots_take_the_fastest_projected_rounds_that_fit(tmp_path_factory, capsys):
    """Each decode step reads the gathered weights once for all its slots, so at SMALL more slots
    make fewer rounds for little more per step: `auto` takes 4x a step's rows. With a capacity
    below what 4x needs, the fastest that fits (the rollout's phases checked against it)."""
    from grpo_runner_gsm8k.costs.capacity import Capacity
    from grpo_runner_gsm8k.plan.slots import fastest_slots, slot_seconds

    inputs, _, _ = planned(tmp_path_factory, *PARTIAL, "rollout.partial.slots=auto")
    target = plan.parse_target("v5e-4")
    capacity, chip = plan.device_capacity(None, target), target.generation
    seconds = slot_seconds(inputs, capacity, chip, NEW)
    assert list(seconds) == [32, 64, 128] and seconds[128] < seconds[64] < seconds[32], seconds
    assert fastest_slots(inputs, capacity, chip, NEW) == 128
    assert "rollout.partial.slots=auto: 128 slots, the fastest projected rollout" in capsys.readouterr().out
    peaks = {slots: peak_of(inputs, slots, capacity) for slots in (64, 128)}
    assert peaks[64] < peaks[128]
    small = Capacity((peaks[64] + peaks[128]) // 2, "between", chip)
    assert fastest_slots(inputs, small, chip, NEW) == 64
    out = capsys.readouterr().out
    assert "64 slots, the fastest" in out and "128 slots over the memory" in out


def peak_of(inputs, slots: int, capacity) -> int:
    from grpo_runner_gsm8k.costs.memory import peak
    from grpo_runner_gsm8k.plan.phases import rollout_phases
    from grpo_runner_gsm8k.plan.slots import inputs_with_slots

    return peak(rollout_phases(inputs_with_slots(inputs, slots), capacity)).total


def test_train_step_is_the_count_by_hand(projected):
    inputs, projection = projected
    q, train = inputs.run.qcfg, projection.phases["train step"]
    width = PROMPT + NEW
    assert train.flops == pytest.approx(3 * dense_forward_flops(q, ROWS, width, width, NEW) / DEVICES, rel=0.05)
    # float32 params and two Adam moments, read and written once
    assert train.hbm_bytes == pytest.approx(2 * 3 * 4 * weight_count(q) / DEVICES, rel=0.05)


# Wide and long enough that the TPU compiler fuses the FSDP all-gathers and reduce-scatters into
# the matmuls: collective matmul loops that do two steps per iteration. Read as `counter < N`
# iterations, they counted every FSDP matmul twice (1.93x this hand count). One layer: the loops
# are the same in each, and the compile takes half as long.
WIDE = ["model.architecture.num_hidden_layers=1", "model.architecture.hidden_size=2048",
        "model.architecture.intermediate_size=8192",
        "model.architecture.num_attention_heads=16", "model.architecture.num_key_value_heads=2",
        "model.architecture.max_position_embeddings=512", "rollout.max_new_tokens=495", "rollout.prompts_per_step=16",
        "train.micro_batch_size_per_device=8"]


def test_train_step_with_collective_matmul_loops_is_the_count_by_hand(tmp_path_factory):
    from grpo_core.config_io import load_config

    cfg = load_config(str(Path(__file__).parents[2] / "configs" / "tiny.yaml"),
                      [f"logging.dir={tmp_path_factory.mktemp('run')}", *SMALL, *WIDE], registry=default_registry())
    inputs = plan.build_plan_inputs(cfg, default_registry(), plan.parse_target("v6e-8"))
    lower, args = plan.update_lowering(inputs, cfg.train.micro_batch_size_per_device)
    compiled = lower(*args).compile()
    assert "windowed_dot_general" in compiled.as_text()  # the loops this test is about
    new, rows = cfg.rollout.max_new_tokens, cfg.rollout.prompts_per_step * cfg.rollout.n
    hand = 3 * dense_forward_flops(inputs.run.qcfg, rows, PROMPT + new, PROMPT + new, new) / 8
    assert phase_cost(compiled).flops == pytest.approx(hand, rel=0.05)


def test_step_is_prefill_decode_steps_and_update_and_mfu_is_model_flops_over_peak(projected):
    _, projection = projected
    p, chip = projection.phases, projection.chip
    decode = p["rollout decode"]
    expected = p["rollout prefill"].seconds + decode.setup_seconds + (NEW - 1) * decode.seconds + p["train step"].seconds
    assert projection.step_seconds(NEW) == pytest.approx(expected)
    assert projection.tokens_per_second(5) == pytest.approx(ROWS * 5 / projection.step_seconds(5))
    assert p["train step"].seconds >= p["train step"].flops / (chip.peak_tflops * 1e12)  # a roofline, never faster
    assert 0 < projection.mfu <= 1
    steps = json.loads(projection_json(projection, [NEW, 5]))["projection"]["steps"]
    assert [s["completion_tokens"] for s in steps] == [NEW, 5]



def test_an_update_whose_compiled_flops_miss_kernel_flops_is_taken_at_its_model_flops(projected):
    """A Pallas kernel's FLOPs are not in the compiler's cost analysis (the MoE's grouped matmul): the
    update is never projected faster than its model FLOPs at the slice's peak, so MFU stays <= 1."""
    _, projection = projected
    compiled = projection.phases["train step"].seconds
    assert projection.update_seconds == compiled  # dense: the compiler's count is above the model FLOPs
    kernels = dataclasses.replace(projection, model_update_flops=2 * compiled * projection.peak_flops)
    assert kernels.update_seconds == pytest.approx(2 * compiled) and kernels.mfu == pytest.approx(1.0)
    assert kernels.step_seconds(NEW) - projection.step_seconds(NEW) == pytest.approx(kernels.epochs * compiled)
    assert "the update taken at its model FLOPs at peak" in "\n".join(projection_lines(kernels, [NEW]))


def test_latency_sensitivity_rescales_the_same_programs(projected):
    """The step at 0.5x, 1x and 2x the collective latency (and without it): doubling the latency adds
    at least the synchronous collectives' extra latency and at most every collective's."""
    _, projection = projected
    steps = json.loads(projection_json(projection, [NEW]))["projection"]
    by_scale = {s["scale"]: s["steps"][0]["step_seconds"] for s in steps["latency_sensitivity"]}
    assert by_scale[1.0] == pytest.approx(steps["steps"][0]["step_seconds"])
    p, latency = projection.phases, projection.chip.collective_latency_us * 1e-6
    assert by_scale[0.0] <= by_scale[0.5] <= by_scale[1.0] <= by_scale[2.0]
    decode = p["rollout decode"].cost
    others = [t.cost for name, t in p.items() if name != "rollout decode"]
    issued = sum(c.collectives + c.overlapped_collectives for c in others) + decode.setup_collectives \
        + (NEW - 1) * (decode.collectives + decode.overlapped_collectives)
    exposed = sum(c.collectives for c in others) + decode.setup_collectives + (NEW - 1) * decode.collectives
    # overlapped collectives may hide behind compute
    assert exposed * latency - 1e-12 <= by_scale[2.0] - by_scale[1.0] <= issued * latency + 1e-12
    assert issued > 0 and steps["chip"]["latency_source"].startswith("derived")


def test_remat_sweep_picks_the_fastest_projected_update_that_fits(tmp_path, capsys):
    from grpo_core.config_io import load_config

    cfg = load_config(str(Path(__file__).parents[2] / "configs" / "tiny.yaml"),
                      [f"logging.dir={tmp_path / 'run'}", *SMALL, "model.attention=auto"], registry=default_registry())
    assert plan.plan_command(cfg, default_registry(), sweep="model.remat", target="v5e-4") == 0
    found = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    tried = found["tried"]
    assert set(tried) == {"none", "dots", "full"} and all(t["fits"] for t in tried.values())
    # full remat recomputes the forward: never faster, never more memory than none
    assert tried["full"]["update_seconds"] >= tried["none"]["update_seconds"]
    assert tried["full"]["train_step_gib"] <= tried["none"]["train_step_gib"]
    assert found["fastest_fitting"] == min(tried, key=lambda policy: tried[policy]["update_seconds"])
