"""`grpo-run --plan`: the abstract compile matches the real run's, the verdict follows the
capacity, and the sweep finds the largest micro-batch size that fits."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jax
import pytest
from grpo_core.config_io import load_config
from grpo_core.registry import default_registry
from grpo_runner_gsm8k import plan
from grpo_rollout.decode import prefill
from grpo_runner_gsm8k.plan.phases import rollout_inputs
from grpo_runner_gsm8k.cli import main
from grpo_runner_gsm8k.loop import Trainer

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")
# 8 devices hold 64 rows: 8 per device, so the micro-batch sizes 1, 2, 4, 8 are valid.
SMALL = ["rollout.prompts_per_step=8", "rollout.n=8", "rollout.max_new_tokens=8"]


def config(*overrides: str, tmp_path: Path):
    return load_config(TINY, [*SMALL, f"logging.dir={tmp_path / 'run'}", *overrides], registry=default_registry())


def table_rows(out: str) -> dict[str, list[float]]:
    rows = {}
    for line in out.splitlines():
        match = re.match(r"^(rollout prefill|rollout decode|log-probs|train step)\s+([\d.\s]+)$", line)
        if match:
            rows[match.group(1)] = [float(v) for v in match.group(2).split()]
    return rows


def test_plan_prints_every_phase_and_fits(tmp_path, capsys):
    flags = os.environ.get("XLA_FLAGS")
    assert plan.plan_command(config(tmp_path=tmp_path), default_registry(), capacity_gib=16.0) == 0
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


def test_plan_adds_the_log_probs_phase_and_reference_params_with_kl(tmp_path, capsys):
    cfg = config("loss.beta=0.04", tmp_path=tmp_path)
    assert plan.plan_command(cfg, default_registry(), capacity_gib=16) == 0
    assert set(table_rows(capsys.readouterr().out)) == {"rollout prefill", "rollout decode", "log-probs", "train step"}
    inputs = plan.build_plan_inputs(cfg, default_registry())
    assert plan.train_phase(inputs, cfg.train.micro_batch_size_per_device).other == inputs.params_bytes > 0  # the reference copy


def test_mixed_precision_plan_counts_masters_moments_and_the_compute_copy(tmp_path):
    """bfloat16 compute on float32 masters: the rollout takes the bfloat16 copy (half the
    masters' bytes) while masters and float32 moments wait beside it; the reference is bfloat16."""
    cfg = config("model.dtype=bfloat16", "loss.beta=0.04", tmp_path=tmp_path)
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
def test_the_plan_lowers_the_update_and_scoring_the_run_executes(tmp_path, dtype):
    """The run's update, scoring forward and rollout prefill, lowered on what a real step
    built, give the same program text as the plan's, lowered on its abstract params and
    optimizer state; the plan's widest batch has the run's structure, dtypes and shardings."""
    cfg = config(f"model.dtype={dtype}", "loss.beta=0.04", "train.ppo_epochs=2", tmp_path=tmp_path)
    trainer = Trainer(cfg, default_registry())
    params, opt_state, batch = one_real_step(trainer)
    inputs = plan.build_plan_inputs(cfg, default_registry())

    run_update = trainer.program.update.lower(params, opt_state, batch).as_text()
    assert inputs.program.update.lower(inputs.params, inputs.opt_state, batch).as_text() == run_update

    ids, width = (batch.input_ids, batch.attention_mask, batch.targets), batch.prompt_width
    run_score = trainer.program.score.lower(abstract(trainer.ref_params), *ids, prompt_width=width).as_text()
    assert inputs.program.score.lower(inputs.forward_params, *ids, prompt_width=width).as_text() == run_score

    # rollout: the plan's prefill on its abstract compute-dtype weights is the run's on its real
    # ones (the stop ids and pad id, which the plan does not know without a tokenizer, are the run's)
    static, prompts, key = rollout_inputs(inputs)
    static.update(params=trainer.program.sampling, pad_id=int(trainer.c.tokenizer.pad_token_id))
    weights = trainer.forward_params(trainer.state.params)
    run_static = trainer.program.rollout.static_args(trainer.graphdef, weights, trainer.program.sampling,
                                                     trainer.c.tokenizer.pad_token_id, trainer.c.rollout_sharding)
    run_prefill = prefill.lower(abstract(weights), prompts, prompts, key, **run_static).as_text()
    assert prefill.lower(inputs.forward_params, prompts, prompts, key, **static).as_text() == run_prefill

    widest = plan.abstract_update_batch(inputs)
    assert jax.tree.structure(widest.replace(prompt_width=width)) == jax.tree.structure(batch)
    for planned, real in zip(jax.tree.leaves(widest), jax.tree.leaves(batch), strict=True):
        assert planned.dtype == real.dtype and planned.sharding.is_equivalent_to(real.sharding, real.ndim)
        assert planned.shape[0] == real.shape[0] and all(p >= r for p, r in zip(planned.shape[1:], real.shape[1:]))


def test_plan_exits_3_with_the_fix_when_it_does_not_fit(tmp_path, capsys):
    assert plan.plan_command(config(tmp_path=tmp_path), default_registry(), capacity_gib=1e-4) == plan.EXIT_DOES_NOT_FIT
    captured = capsys.readouterr()
    assert "DOES NOT FIT" in captured.out
    [line] = captured.err.strip().splitlines()
    assert line.startswith("grpo-run: does not fit: train step needs")
    assert "lower train.micro_batch_size_per_device" in line


def test_sweep_finds_the_largest_micro_batch_size_that_fits(tmp_path, capsys):
    # Dense attention keeps the train step the largest phase, as the capacity below assumes.
    cfg = config("model.attention=xla", tmp_path=tmp_path)
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


def test_cli_plan_exit_code(tmp_path, capsys):
    assert main(["--config", TINY, *SMALL, f"logging.dir={tmp_path / 'run'}", "--plan", "--capacity-gib", "1e-4"]) == 3
    assert "does not fit" in capsys.readouterr().err
