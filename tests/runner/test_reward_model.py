"""The `reward_model` reward: conversations in, transformers' scores out, on the run's mesh (8 CPU
devices here); bad checkpoints refused in one line at config load; `--plan` counts its weights and
compiles its forward; the step's scoring gives every completion its prompt.

The reward models are the committed goldens of tests/core/models/make_reward_golden.py (tiny random
Qwen2 / Llama *ForSequenceClassification saved by transformers with the character tokenizer, and
transformers' float32 scores of chat conversations rendered with its template).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from flax import nnx

from grpo_core.contracts import CompletionText, Example
from grpo_core.models.hf_io import abstract_model
from grpo_core.models.sequence_scores import ScoreHead
from grpo_core.registry import default_registry
from grpo_meshes import build_mesh_from_config
from grpo_runner_gsm8k.assembly.build import check_inputs
from grpo_runner_gsm8k.assembly.reward_model import REWARD_MODEL_PHASE, place_reward_model
from grpo_runner_gsm8k.cli import main
from grpo_runner_gsm8k.samplers.plain import score_groups
from grpo_runner_gsm8k.tasks.reward_model import RewardModelOptions, RewardModelReward, bucket, padded_batch

GOLDEN = Path(__file__).resolve().parents[1] / "core" / "models" / "golden"
PARITY_ATOL = 1e-4  # the float32 bound


def golden_of(name: str) -> dict:
    return json.loads((GOLDEN / name / "golden.json").read_text())


def completion_of(conversation: dict) -> CompletionText:
    text = CompletionText(conversation["completion"], 5, 8, True)
    system = [{"role": "system", "content": conversation["system"]}] if conversation["system"] else []
    text.prompt = (*system, {"role": "user", "content": conversation["question"]})
    return text


def placed_reward(tiny_config, name: str, batch_size: int) -> RewardModelReward:
    """The run's `reward_model` reward as check_inputs builds it, placed on the 8-device mesh as build_run places it."""
    cfg = tiny_config(*reward_model_args(GOLDEN / name, dtype="float32", batch_size=batch_size))
    _, inputs = check_inputs(cfg, default_registry())
    resolved = build_mesh_from_config(cfg.mesh, default_registry().mesh)
    assert place_reward_model(cfg.model, inputs.rewards, resolved.mesh, resolved.strategy).rows == 8
    return inputs.rewards["reward_model"][0]


def test_scores_conversations_as_transformers_does(tiny_config):
    """Three conversations in batches of 8 rows (batch_size 2 rounded up to the 8 data shards: one
    batch, 5 filler rows dropped), rendered by the reward model's chat template. (Both families'
    parity on token ids: tests/core/models/test_sequence_scores.py.)"""
    golden = golden_of("reward_qwen2")
    reward = placed_reward(tiny_config, "reward_qwen2", batch_size=2)
    completions = [completion_of(c) for c in golden["conversations"]]
    scores = reward(completions, ["unused"] * len(completions))
    diffs = [abs(ours - theirs) for ours, theirs in zip(scores, golden["conversation_scores"])]
    assert max(diffs) <= PARITY_ATOL, diffs
    metrics = reward.take_metrics()
    assert metrics["truncated"] == 0 and metrics["seconds"] > 0


def test_a_completion_without_its_prompt_is_an_error_not_a_score():
    reward = RewardModelReward(RewardModelOptions(path=str(GOLDEN / "reward_qwen2")))
    reward.place(lambda ids, mask, index: np.zeros(len(ids)), rows=1)
    with pytest.raises(ValueError, match="with its prompt"):
        reward([CompletionText("7", 1, 8, True)], ["7"])


def test_the_step_gives_each_completion_its_examples_prompt():
    """score_groups (the plain, refill and partial samplers' scoring): row i is example i // n's."""
    seen = []
    record = lambda completions, answers: seen.extend(c.prompt for c in completions) or [0.0] * len(completions)
    run = SimpleNamespace(cfg=SimpleNamespace(rollout=SimpleNamespace(n=2), task=SimpleNamespace(system_prompt="Be brief.")),
                          inputs=SimpleNamespace(rewards={"record": (record, 1.0)}))
    examples = [Example("1+1?", "2"), Example("2+2?", "4")]
    score_groups(run, examples, [CompletionText(t, 1, 4, True) for t in "2342"])
    system = {"role": "system", "content": "Be brief."}
    assert seen == [(system, {"role": "user", "content": q}) for q in ("1+1?", "1+1?", "2+2?", "2+2?")]


def test_batches_are_right_padded_with_one_token_filler_rows():
    ids, mask = padded_batch([[5, 6, 7], [8]], size=3, width=bucket(3, 512), pad_id=0)
    assert ids.shape == (3, 16) and ids[0, :4].tolist() == [5, 6, 7, 0] and ids[1, :2].tolist() == [8, 0]
    assert mask.sum(axis=1).tolist() == [3, 1, 1]
    assert [bucket(n, 512) for n in (1, 16, 17, 300, 600)] == [16, 16, 32, 512, 512]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("grpo-run: error: "), err
    return err[0]


def reward_model_args(path, **options) -> list[str]:
    extra = "".join(f", {key}: {value}" for key, value in options.items())
    return ["task.rewards={correctness: 1.0, reward_model: 0.5}",
            f"task.reward_options={{reward_model: {{path: '{path}'{extra}}}}}"]


def copy_with_config(tmp_path, **changes) -> Path:
    path = tmp_path / "rm"
    shutil.copytree(GOLDEN / "reward_qwen2", path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))
    return path


@pytest.mark.parametrize("case,hint", [
    ("causal_lm", "has no score.weight tensor"),
    ("two_labels", "num_labels is 2"),
    ("unknown_family", "'bert'"),
    ("missing", "is not a model directory"),
])
def test_a_checkpoint_that_is_no_reward_model_exits_2_in_one_line(tiny_config_path, tmp_path, capsys, case, hint):
    path = {"causal_lm": lambda: GOLDEN / "qwen2_untied",
            "two_labels": lambda: copy_with_config(tmp_path, id2label={"0": "a", "1": "b"}),
            "unknown_family": lambda: copy_with_config(tmp_path, model_type="bert"),
            "missing": lambda: tmp_path / "nowhere"}[case]()
    assert main(["--config", tiny_config_path, "--print-config", *reward_model_args(path)]) == 2
    line = one_error_line(capsys)
    assert "task.reward_options.reward_model.path" in line and hint in line, line


def test_an_empty_path_exits_2_in_one_line(tiny_config_path, capsys):
    assert main(["--config", tiny_config_path, "--print-config", *reward_model_args("")]) == 2
    assert "task.reward_options.reward_model: path is empty" in one_error_line(capsys)


def param_count(qcfg) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract_model(qcfg, "float32"))))


def test_plan_counts_the_reward_model_and_compiles_its_forward(plan_config):
    from grpo_runner_gsm8k import plan
    from grpo_runner_gsm8k.plan.phases import reward_model_phase

    cfg = plan_config(*reward_model_args(GOLDEN / "reward_qwen2", dtype="float32", batch_size=4, max_length=64))
    inputs = plan.build_plan_inputs(cfg, default_registry())
    model = inputs.run.reward_model
    assert (model.rows, model.width) == (8, 64)  # 4 rounded up to the 8 data shards
    whole = 4 * (param_count(ScoreHead.read(str(GOLDEN / "reward_qwen2")).decoder) + 32)  # float32, + head [32]
    assert whole / 8 <= inputs.reward_model_bytes < whole / 2  # sharded over the 8 devices but for what stays whole
    phase = reward_model_phase(inputs)
    assert phase.name == REWARD_MODEL_PHASE and phase.arguments >= inputs.reward_model_bytes
    without = plan.build_plan_inputs(plan_config(), default_registry())
    assert inputs.held_beside_rollout - without.held_beside_rollout == inputs.reward_model_bytes > 0




def test_grpo_run_plugins_lists_the_reward_model(capsys):
    assert main(["plugins"]) == 0
    section = capsys.readouterr().out.split("reward:\n")[1].split("task:\n")[0]
    assert ["reward_model", "grpo-runner-gsm8k"] in [line.split()[:2] for line in section.splitlines()]
