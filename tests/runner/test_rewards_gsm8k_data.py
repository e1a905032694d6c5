"""The correctness reward on the real GSM8K files (skipped when ../shared/data/gsm8k is absent).

On example_model_solutions.jsonl (1,319 test questions, each solved by four
GPT-3 variants, each solution labelled `is_correct`) the reward agrees with
every label: 5,276 / 5,276. Cases that needed care and are handled:
  * solutions mark the answer with a line "A: <n>" (not "####"), and some also
    contain "A:" mid-line ("Job A: ..."): only a line starting with "A:" counts;
  * 11 solutions labelled correct have thousands commas in their answer or the
    reference ("A: 3,000" vs "3000", "A: 6,250" vs "6,250"): they compare equal;
  * 11 solutions were cut off before any "A:" line; all are labelled incorrect
    and score 0 (their last line is a calculation or a runaway digit string)."""

import json
import re
from pathlib import Path

import pytest

from grpo_runner_gsm8k.tasks.rewards import CorrectnessOptions, correctness_reward
from grpo_runner_gsm8k.tasks import final_answer

DATA = Path(__file__).resolve().parents[3] / "shared/data/gsm8k"
MODELS = ["6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification"]

pytestmark = pytest.mark.skipif(not DATA.is_dir(), reason=f"GSM8K data not found at {DATA}")


def _rows(name: str) -> list[dict]:
    with (DATA / name).open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


@pytest.fixture(scope="module")
def correctness():
    return correctness_reward(CorrectnessOptions())


@pytest.mark.parametrize("split", ["train", "test"])
def test_every_gold_solution_scores_one(split, correctness):
    rows = _rows(f"{split}.jsonl")
    rewards = correctness([r["answer"] for r in rows], [final_answer(r["answer"]) for r in rows])
    wrong = [r["answer"][-60:] for r, reward in zip(rows, rewards) if reward != 1.0]
    assert len(rows) > 1000 and wrong == []


def _reference(ground_truth: str) -> str:
    return re.search(r"^A: (.*)$", ground_truth, re.MULTILINE).group(1).strip()


def test_reproduces_the_human_labels_of_model_solutions(correctness):
    rows = _rows("example_model_solutions.jsonl")
    references = [_reference(r["ground_truth"]) for r in rows]
    disagreements = {}
    for model in MODELS:
        rewards = correctness([r[model]["solution"] for r in rows], references)
        labels = [float(r[model]["is_correct"]) for r in rows]
        disagreements[model] = [i for i, (got, want) in enumerate(zip(rewards, labels)) if got != want]
    assert disagreements == {model: [] for model in MODELS}
    assert len(rows) == 1319
