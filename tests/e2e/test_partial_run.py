"""Partial rollouts in the real loop: metrics, exact data position, full groups per step, eval
without partial rollouts."""

import json

import pytest

from grpo_core.registry import default_registry

PARTIAL = ["train.steps=4", "rollout.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=8",
           "rollout.partial.enabled=true", "rollout.partial.budget=2", "loss.mismatch_correction=truncate",
           "eval.every_steps=0", "checkpoint.every_steps=0"]


# (kv_cache, slots): every mode on a step's 16 rows, and twice as many slots on kept caches.
@pytest.fixture(params=[("reprefill", "null"), ("within_step", "null"), ("across_steps", "null"), ("within_step", 32)],
                ids=["reprefill", "within_step", "across_steps", "within_step-32-slots"])
def trainer(tiny_config, request):
    from grpo_runner_gsm8k.loop import Trainer, build_run

    registry = default_registry()
    mode, slots = request.param
    cfg = tiny_config(*PARTIAL, f"rollout.partial.kv_cache={mode}", f"rollout.partial.slots={slots}", registry=registry)
    return Trainer(build_run(cfg, registry))


def test_partial_steps_train_complete_groups_and_count_every_prompt_once(trainer, tmp_path):
    trainer.run()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = sum(r["train-rollout/groups"] for r in records)
    waiting = len(trainer.sampler.pool.groups)
    assert trainer.built.inputs.task.state()["position"] == trained + waiting
    slots = len(trainer.sampler.pool.slots)
    assert slots == (trainer.built.cfg.rollout.partial.slots or 16)
    for r in records:  # with more slots than rows a step may find its groups complete and decode nothing
        assert r["train-rollout/groups"] == 4 and r["train-rollout/rounds"] >= (slots == 16)
        assert r["train-rollout/decode_steps"] <= 2 * r["train-rollout/rounds"]
        assert 0 < r["train-rollout/slot_utilisation"] <= 1 or r["train-rollout/rounds"] == 0
        assert r["train-rollout/length_max"] <= 8
        assert r["train-other/mismatch_ratio_mean"] is not None
    assert max(r["train-rollout/staleness_max"] for r in records) >= 1  # some tokens were carried
    saved = json.loads((tmp_path / "run" / "checkpoints" / "4" / "meta" / "metadata").read_text())
    assert saved["carried"] == trainer.sampler.state()


def test_eval_leaves_the_carried_rows_and_the_data_position_alone(trainer):
    trainer.step()
    before, position = trainer.sampler.state(), trainer.built.inputs.task.state()
    assert "eval/accuracy" in trainer.evaluate()
    assert trainer.sampler.state() == before and trainer.built.inputs.task.state() == position
