"""`grpo-run --plan`: the abstract compile matches the real run's, the verdict follows the
capacity, and the sweep finds the largest micro-batch size that fits."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import pytest
from grpo_core.registry import default_registry
from grpo_rollout.decode import group_sharding, prefill_shared
from grpo_runner_gsm8k import plan
from grpo_runner_gsm8k.plan.phases import PhaseRecorder, kept_cache_bytes, rollout_shapes, train_phase
from grpo_runner_gsm8k.cli import main
from grpo_runner_gsm8k.loop import Trainer, build_run



def table_rows(out: str) -> dict[str, list[float]]:
    rows = {}
    for line in out.splitlines():
        match = re.match(r"^(rollout [a-z ]+?|log-probs|train step)\s+([\d.\s]+)$", line)
        if match:
            rows[match.group(1)] = [float(v) for v in match.group(2).split()]
    return rows


def test_plan_prints_every_phase_and_fits(plan_config, tmp_path, capsys):
    flags = os.environ.get("XLA_FLAGS")
    assert plan.plan_command(plan_config(), default_registry(), capacity_gib=16.0) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert set(rows) == {"rollout prefill", "rollout decode", "train step"}
    for arguments, outputs, aliased, temp, other, total in rows.values():
        assert total == pytest.approx(arguments + outputs - aliased + temp + other, abs=2e-3)
    assert re.search(r"^peak: [\d.]+ GiB per device \(train step\) of 16\.00 GiB \(--capacity-gib\): fits", out, re.M)
    assert "figures: XLA:CPU's, for this host's CPU devices" in out  # not a TPU's: --target gives those
    assert "XLA_FLAGS has --xla_cpu_enable_concurrency_optimized_scheduler=false" in out  # the plan's own flag, shown
    assert rows["train step"][4] == 0  # no reference params without KL
    assert not (tmp_path / "run").exists()  # the plan loads nothing and writes nothing
    assert os.environ.get("XLA_FLAGS") == flags  # its scheduler flag is scoped to the plan


def test_plan_adds_the_log_probs_phase_and_reference_params_with_kl(plan_config, capsys):
    cfg = plan_config("loss.beta=0.04")
    assert plan.plan_command(cfg, default_registry(), capacity_gib=16) == 0
    assert set(table_rows(capsys.readouterr().out)) == {"rollout prefill", "rollout decode", "log-probs", "train step"}
    inputs = plan.build_plan_inputs(cfg, default_registry())
    assert plan.train_phase(inputs, cfg.train.micro_batch_size_per_device).other == inputs.params_bytes > 0  # the reference copy


def test_mixed_precision_plan_counts_masters_moments_and_the_compute_copy(plan_config):
    """bfloat16 compute on float32 masters: the rollout takes the bfloat16 copy (half the
    masters' bytes) while masters and float32 moments wait beside it; the reference is bfloat16."""
    cfg = plan_config("model.dtype=bfloat16", "loss.beta=0.04")
    inputs = plan.build_plan_inputs(cfg, default_registry())
    masters, copy = inputs.params_bytes, plan.per_device_bytes(inputs.forward_params)
    assert copy * 2 == masters > 0
    assert plan.per_device_bytes(inputs.opt_state) >= 2 * masters  # adamw: two float32 moments
    assert inputs.held_beside_rollout == plan.per_device_bytes(inputs.opt_state) + masters + copy
    assert plan.train_phase(inputs, cfg.train.micro_batch_size_per_device).other == copy  # the bfloat16 reference


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def one_real_step(trainer: Trainer):
    """Runs one training step; returns the abstract (params, opt_state, batch) of its first update."""
    seen = []
    run_updates = trainer.run_updates

    def capture(batch):
        seen.append(abstract((trainer.state.params, trainer.state.opt_state, batch)))
        return run_updates(batch)

    trainer.run_updates = capture
    trainer.step()
    return seen[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_plan_lowers_the_update_and_scoring_the_run_executes(plan_config, dtype):
    """The run's update, scoring forward and rollout prefill, lowered on what a real step
    built, give the same program text as the plan's, lowered on its abstract params and
    optimizer state; the plan's widest batch has the run's structure, dtypes and shardings."""
    cfg = plan_config(f"model.dtype={dtype}", "loss.beta=0.04", "train.ppo_epochs=2")
    trainer = Trainer(build_run(cfg, default_registry()))
    params, opt_state, batch = one_real_step(trainer)
    inputs = plan.build_plan_inputs(cfg, default_registry())

    run_update = trainer.built.update.lower(params, opt_state, batch).as_text()
    assert inputs.run.update.lower(inputs.params, inputs.opt_state, batch).as_text() == run_update

    ids, width = (batch.input_ids, batch.attention_mask, batch.targets), batch.prompt_width
    run_score = trainer.built.score.lower(abstract(trainer.ref_params), *ids, prompt_width=width).as_text()
    assert inputs.run.score.lower(inputs.forward_params, *ids, prompt_width=width).as_text() == run_score

    # rollout: the prefill the backend compiles for the plan (through the RolloutBackend contract,
    # on abstract compute-dtype weights) is the one it runs on the real weights (the stop ids and
    # pad id, which the plan does not know without a tokenizer, are the run's here)
    run = trainer.built
    weights = trainer.forward_params(trainer.state.params)
    pad = int(run.inputs.tokenizer.pad_token_id)
    shapes = dataclasses.replace(rollout_shapes(inputs), sampling=run.sampling, pad_token_id=pad)
    recorder = PhaseRecorder(None, 0)
    inputs.run.rollout.compile_phases(shapes, recorder)
    static = run.rollout.static_args(run.policy.policy_graphdef, weights, run.sampling, pad, run.rollout_sharding)
    phase = run.rollout.prefill_phase(run.sampling)  # shared prompts: one prefill row per prompt
    rows = batch.advantages.shape[0] // (run.sampling.n if phase is prefill_shared else 1)
    sharding = group_sharding(run.rollout_sharding, rows) if phase is prefill_shared else run.rollout_sharding
    prompts = jax.ShapeDtypeStruct((rows, plan.prompt_bucket(inputs)), jnp.int32, sharding=sharding)
    run_prefill = phase.lower(abstract(weights), prompts, prompts, shapes.key, **static).compile().as_text()
    assert recorder.compiled["rollout prefill"].as_text() == run_prefill
    assert "rollout decode" in recorder.compiled

    widest = plan.abstract_update_batch(inputs)
    assert jax.tree.structure(widest.replace(prompt_width=width)) == jax.tree.structure(batch)
    for planned, real in zip(jax.tree.leaves(widest), jax.tree.leaves(batch), strict=True):
        assert planned.dtype == real.dtype and planned.sharding.is_equivalent_to(real.sharding, real.ndim)
        assert planned.shape[0] == real.shape[0] and all(p >= r for p, r in zip(planned.shape[1:], real.shape[1:]))


def test_plan_exits_3_with_the_fix_when_it_does_not_fit(plan_config, capsys):
    assert plan.plan_command(plan_config(), default_registry(), capacity_gib=1e-4) == plan.EXIT_DOES_NOT_FIT
    captured = capsys.readouterr()
    assert "DOES NOT FIT" in captured.out
    [line] = captured.err.strip().splitlines()
    assert line.startswith("grpo-run: does not fit: train step needs")
    assert "lower train.micro_batch_size_per_device" in line


def test_sweep_finds_the_largest_micro_batch_size_that_fits(plan_config, capsys):
    # Dense attention keeps the train step the largest phase, as the capacity below assumes.
    cfg = plan_config("model.attention=xla")
    inputs = plan.build_plan_inputs(cfg, default_registry())
    assert plan.micro_batch_candidates(inputs) == [1, 2, 4, 8]
    totals = {size: plan.train_phase(inputs, size).total for size in (2, 4)}
    assert totals[2] < totals[4]
    capacity_gib = (totals[2] + totals[4]) / 2 / plan.GIB  # 2 fits, 4 does not
    assert plan.plan_command(cfg, default_registry(), sweep="micro_batch_size_per_device",
                             capacity_gib=capacity_gib) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["largest_fitting"] == 2
    assert result["tried"]["2"] == pytest.approx(totals[2] / plan.GIB, abs=1e-4)


@pytest.mark.parametrize("threshold", range(0, 14))
def test_largest_fitting_is_a_binary_search(threshold):
    candidates = [1, 2, 3, 4, 6, 12]
    calls = []

    def fits(size):
        calls.append(size)
        return size <= threshold

    expected = max((c for c in candidates if c <= threshold), default=None)
    assert plan.largest_fitting(candidates, fits) == expected
    assert len(calls) <= 3  # ceil(log2(6 + 1))


def test_cli_plan_exit_code(tiny_config_path, plan_overrides, tmp_path, capsys):
    argv = ["--config", tiny_config_path, *plan_overrides, f"logging.dir={tmp_path / 'run'}"]
    assert main([*argv, "--plan", "--capacity-gib", "1e-4"]) == 3
    assert "does not fit" in capsys.readouterr().err


PARTIAL_PLAN = ("rollout.partial.enabled=true", "loss.mismatch_correction=truncate", "rollout.partial.budget=3")


def test_partial_rollouts_plan_the_widest_re_prefill_round(plan_config, capsys):
    """Without a prompt table: every row re-prefilling a prompt plus max_new_tokens - 1 carried tokens,
    then `budget` steps."""
    cfg = plan_config(*PARTIAL_PLAN, "rollout.partial.kv_cache=reprefill", "rollout.options.shared_prompt=false")
    shapes = rollout_shapes(plan.build_plan_inputs(cfg, default_registry()))
    rollout = cfg.rollout
    assert shapes.prompts == rollout.prompts_per_step * rollout.n and shapes.sampling.n == 1
    assert shapes.max_prompt_length == rollout.max_prompt_length + rollout.max_new_tokens - 1
    assert shapes.sampling.max_new_tokens == 3
    assert plan.plan_command(cfg, default_registry(), capacity_gib=16.0) == 0
    assert {"rollout prefill", "rollout decode", "train step"} <= set(table_rows(capsys.readouterr().out))


def kv_cache_bytes(q, rows: int, width: int) -> int:
    """Bytes of a tiny model's f32 KV cache of `rows` rows `width` slots wide (k, v, mask, index)."""
    return q.num_hidden_layers * rows * width * q.num_key_value_heads * q.head_dim * 2 * 4 + rows * width + 4


@pytest.mark.parametrize("kv_cache,shared", [("within_step", True), ("across_steps", True), ("across_steps", False),
                                             ("reprefill", True)])
def test_partial_rollouts_on_a_kept_cache_plan_its_widest_rounds(plan_config, capsys, kv_cache, shared):
    """Every slot admitting the longest carried prefix, then slots kept at it with new prompts
    admitted beside (with shared prompts: the groups' prompts run once each into the prompt
    table, the slots' own caches beside it; re-prefilled rounds on the table are the same rounds
    with every slot admitted); a cache kept across steps is held through the update as well."""
    cfg = plan_config(*PARTIAL_PLAN, f"rollout.partial.kv_cache={kv_cache}", f"rollout.options.shared_prompt={shared}")
    inputs = plan.build_plan_inputs(cfg, default_registry())
    shapes, rollout = rollout_shapes(inputs), cfg.rollout
    assert shapes.kept_prefix == rollout.max_prompt_length + rollout.max_new_tokens - 1
    assert shapes.max_prompt_length == rollout.max_prompt_length and shapes.sampling.max_new_tokens == 3
    assert shapes.prompt_table == ((2 * 64 // 8, 8) if shared else ())  # G: twice the 64 slots' 8 groups
    assert plan.plan_command(cfg, default_registry(), capacity_gib=16.0) == 0
    phases = {"rollout admission of carried rows", "rollout compaction", "rollout decode"}
    phases |= {"rollout prompt table"} if shared else {"rollout admission"}
    assert phases | {"train step"} <= set(table_rows(capsys.readouterr().out))
    q, rows = inputs.run.qcfg, shapes.batch_sharding.shard_shape((rollout.prompts_per_step * rollout.n, 1))[0]
    if shared:  # own caches: the bucket of the 7 carried tokens and the budget; the table (replicated): 16 x 16
        cache = kv_cache_bytes(q, rows, 16 + 3) + kv_cache_bytes(q, 16, 16)
    else:  # buckets of the longest carried prefix (23) but one and of the prompt (16) but one, the budget
        cache = kv_cache_bytes(q, rows, 32 + 16 + 3)
    held = kept_cache_bytes(inputs)
    assert held == (cache if kv_cache == "across_steps" else 0)
    assert train_phase(inputs, cfg.train.micro_batch_size_per_device).other == inputs.reference_bytes + held


MULTI_TURN_PLAN = ("model.tokenizer=char-calculator", "task.options={digits: 1, operations: '+', use_chat_template: true}",
                   "rollout.multi_turn.enabled=true", "rollout.multi_turn.tools=[calculator]",
                   "rollout.multi_turn.max_total_tokens=40", "model.architecture.max_position_embeddings=128")


@pytest.mark.parametrize("kv_cache", ["kept", "reprefill"])
def test_multi_turn_rollouts_plan_their_widest_turn_and_an_update_over_every_turn(plan_config, capsys, kv_cache):
    """A row's last turn starts from its prompt plus the row's budget but one token: prefilled
    whole by re-prefill, kept (tool turns or prompts admitted beside) on kept caches. The update
    is as wide as the whole trajectory (max_total_tokens), not one turn (max_new_tokens)."""
    cfg = plan_config(*MULTI_TURN_PLAN, f"rollout.multi_turn.kv_cache={kv_cache}")
    inputs = plan.build_plan_inputs(cfg, default_registry())
    shapes, rollout = rollout_shapes(inputs), cfg.rollout
    assert shapes.prompts == rollout.prompts_per_step * rollout.n and shapes.sampling.n == 1
    assert shapes.sampling.max_new_tokens == rollout.max_new_tokens == 8  # one turn's tokens per round
    longest = rollout.max_prompt_length + 40 - 1
    planned = (longest, 40 - 1) if kv_cache == "kept" else (0, longest)
    assert (shapes.kept_prefix, shapes.max_prompt_length) == planned
    assert plan.train_widths(inputs)[1] == 40
    assert plan.abstract_update_batch(inputs).targets.shape[1] == 40
    assert plan.plan_command(cfg, default_registry(), capacity_gib=16.0) == 0
    rollout_phases = ({"rollout admission of carried rows", "rollout compaction", "rollout admission", "rollout decode"}
                      if kv_cache == "kept" else {"rollout prefill", "rollout decode"})
    assert set(table_rows(capsys.readouterr().out)) == rollout_phases | {"train step"}


def test_multi_turn_rows_carried_across_steps_plan_a_reprefilled_round_of_the_whole_row(plan_config):
    """With partial rollouts a multi-turn round decodes `budget` tokens of every slot, each
    re-prefilling its prompt plus up to the row's budget but one token (tool turns included).
    The phases are the re-prefill ones, which the multi-turn test above compiles at other widths;
    this checks the widths only (a compile of the plan costs a minute on 2 cores)."""
    cfg = plan_config(*MULTI_TURN_PLAN, "rollout.partial.enabled=true", "rollout.partial.budget=2",
                      "loss.mismatch_correction=truncate")
    inputs = plan.build_plan_inputs(cfg, default_registry())
    shapes, rollout = rollout_shapes(inputs), cfg.rollout
    assert shapes.prompts == rollout.prompts_per_step * rollout.n and shapes.sampling.max_new_tokens == 2
    assert (shapes.kept_prefix, shapes.max_prompt_length) == (0, rollout.max_prompt_length + 40 - 1)
    assert plan.abstract_update_batch(inputs).targets.shape[1] == 40


def test_auto_slots_without_a_chip_to_project_on_are_a_steps_rows(plan_config, capsys):
    """`rollout.partial.slots: auto` decided where no TPU chip projects the rounds (this CPU host, a plan
    without --target): a step's rows, said in one line; the remat sweep asks for the slots first."""
    from grpo_core.errors import UserError
    from grpo_runner_gsm8k.plan.slots import decided_slots

    cfg = plan_config(*PARTIAL_PLAN, "rollout.partial.slots=auto")
    rows = cfg.rollout.prompts_per_step * cfg.rollout.n
    assert decided_slots(cfg, default_registry()).rollout.partial.slots == rows
    assert f"rollout.partial.slots=auto: {rows} slots (a step's rows): no TPU chip" in capsys.readouterr().out
    with pytest.raises(UserError, match="--sweep model.remat with rollout.partial.slots=auto"):
        plan.plan_command(cfg, default_registry(), sweep="model.remat")


def test_an_8bit_cache_kept_across_steps_is_planned_at_its_8bit_size(plan_config):
    """int8 keys and values with an f32 scale per (row, slot, KV head) beside them, the kept cache's
    shapes as above (no shared prompt): the cache held through the update is planned at that size."""
    cfg = plan_config(*PARTIAL_PLAN, "rollout.partial.kv_cache=across_steps", "rollout.options.shared_prompt=false",
                      "rollout.kv_cache_dtype=int8")
    inputs = plan.build_plan_inputs(cfg, default_registry())
    q, width = inputs.run.qcfg, 32 + 16 + 3
    rows = rollout_shapes(inputs).batch_sharding.shard_shape((cfg.rollout.prompts_per_step * cfg.rollout.n, 1))[0]
    stores = q.num_hidden_layers * rows * width * q.num_key_value_heads * 2  # k and v
    assert kept_cache_bytes(inputs) == stores * q.head_dim + stores * 4 + rows * width + 4


def test_a_run_on_chips_of_a_known_generation_decides_auto_slots_by_the_plans_rule(plan_config, capsys, monkeypatch):
    """What `grpo-run` does before building a run on TPU chips (here these CPU devices priced as v5e
    chips): the plan's candidates (64 rows, 128: a row of 8 tokens spans 3 rounds of 3, so 4x would
    finish more rows a round than a step trains) compiled on the run's devices, the fastest taken."""
    from grpo_runner_gsm8k.costs.tpu_target import GENERATIONS
    from grpo_runner_gsm8k.plan import slots

    monkeypatch.setattr(slots, "generation_of", lambda device: GENERATIONS["v5e"])
    cfg = plan_config(*PARTIAL_PLAN, "rollout.partial.slots=auto", "rollout.partial.kv_cache=within_step",
                      "rollout.options.shared_prompt=false")
    assert slots.slot_candidates(cfg.rollout) == [64, 128]
    decided = slots.decided_slots(cfg, default_registry()).rollout.partial.slots
    line = capsys.readouterr().out.strip().splitlines()[-1]
    listed = {int(n): float(t) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[unit]
              for n, t, unit in re.findall(r"(\d+) slots ([\d.]+) (us|ms|s)\b", line)}
    assert set(listed) == {64, 128} and decided == min(listed, key=listed.get), line
    assert line.startswith(f"rollout.partial.slots=auto: {decided} slots, the fastest projected rollout")
