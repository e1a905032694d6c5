"""configs/tiny_tools.yaml (the run that learns to call the calculator, measured in
docs/tools.md) runs: two small steps, and metrics.jsonl holds the tool metrics and both
rewards of each step. Whether it learns is a measurement, not a test."""

import json
import math

TOOL_METRICS = ("turns_mean", "turns_max", "calls", "call_rate", "errors", "timeouts", "seconds", "masked_tokens",
                "masked_tokens_per_row")


def test_two_steps_of_the_tiny_tools_config_log_the_tool_metrics(repo_root, tmp_path):
    from grpo_core.config_io import load_config
    from grpo_core.registry import default_registry
    from grpo_runner_gsm8k.loop import Trainer, build_run

    registry = default_registry()
    cfg = load_config(str(repo_root / "configs" / "tiny_tools.yaml"),
                      [f"logging.dir={tmp_path / 'run'}", "train.steps=2", "rollout.prompts_per_step=4",
                       "rollout.n=4", "checkpoint.every_steps=0"], registry=registry)
    assert cfg.rollout.multi_turn.enabled and cfg.model.tokenizer == "char-calculator"
    trainer = Trainer(build_run(cfg, registry))
    assert trainer.sampler.turns.kv_cache  # the jax backend keeps caches: rows continue on them
    trainer.run()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "train-tools/calls" in record]
    assert [record["step"] for record in steps] == [1, 2]
    for record in steps:
        for name in TOOL_METRICS:
            assert math.isfinite(record[f"train-tools/{name}"])
        assert 0.0 <= record["train-reward/func/calculator_call/mean"] <= 1.0
        assert record["train-reward/func/calculator_call/errors"] == 0
        assert record["train-tools/turns_mean"] >= 1
