"""The eval sample store: which questions are done, cut-off lines, other settings refused."""

import json

import pytest

from grpo_core.contracts import CompletionText
from grpo_core.errors import UserError
from grpo_runner_gsm8k.evaluation.store import SampleStore
from grpo_runner_gsm8k.evaluation.evaluate import Sample

SETTINGS = {"task": "t", "n": 2, "greedy": False}


def _samples(*verdicts: bool) -> list[Sample]:
    return [Sample(CompletionText(f"c{i}", 3, 8, True), str(i), v) for i, v in enumerate(verdicts)]


def test_done_holds_only_questions_with_all_samples(tmp_path):
    store = SampleStore(tmp_path / "t", SETTINGS)
    store.append(["q1", "q2"], [_samples(True, False), _samples(False, True)])
    with store.samples_path.open("a") as out:  # q3 cut off after its first sample, mid-line
        out.write(json.dumps({"id": "q3", "sample": 0, "answer": "1", "correct": True}) + "\n" + '{"id": "q3", "sam')
    done = store.done(2)
    assert sorted(done) == ["q1", "q2"] and [r["correct"] for r in done["q1"]] == [True, False]
    store.append(["q3"], [_samples(False, False)])  # starts on a fresh line after the cut-off one
    assert sorted(store.done(2)) == ["q1", "q2", "q3"]
    assert store.done(2)["q3"][0]["correct"] is True  # the first record of a sample wins


def test_other_settings_are_refused_and_fresh_starts_over(tmp_path):
    SampleStore(tmp_path / "t", SETTINGS).append(["q1"], [_samples(True, True)])
    with pytest.raises(UserError, match=r"other settings \(n was 2, now 4\); pass --fresh"):
        SampleStore(tmp_path / "t", {**SETTINGS, "n": 4})
    fresh = SampleStore(tmp_path / "t", {**SETTINGS, "n": 4}, fresh=True)
    assert fresh.done(4) == {} and not fresh.samples_path.exists()


def test_a_process_that_does_not_write_leaves_no_files(tmp_path):
    store = SampleStore(tmp_path / "t", SETTINGS, writes=False)
    records = store.append(["q1"], [_samples(True, False)])
    store.write_summary({"pass@1": 0.5})
    assert records[0][1]["answer"] == "1" and not (tmp_path / "t").exists()
