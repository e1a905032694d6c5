"""The eval sample store: which questions are done, cut-off lines, other settings refused, rows
that carry what a regrade needs, state files replaced atomically and read with a one-line error."""

import json

import pytest

from grpo_core.contracts import CompletionText, Example
from grpo_core.errors import UserError
from grpo_runner_gsm8k.evaluation import store as store_module
from grpo_runner_gsm8k.evaluation.store import SampleStore, read_state
from grpo_runner_gsm8k.evaluation.evaluate import Sample
from grpo_runner_gsm8k.operations import atomic
from grpo_runner_gsm8k.operations.atomic import write_text_atomic

SETTINGS = {"task": "t", "n": 2, "greedy": False}


def _q(name: str) -> Example:
    return Example(f"question {name}", f"ref {name}", name)


def _samples(*verdicts: bool) -> list[Sample]:
    return [Sample(CompletionText(f"c{i}", 3, 8, True), str(i), v) for i, v in enumerate(verdicts)]


def test_done_holds_only_questions_with_all_samples(tmp_path):
    store = SampleStore(tmp_path / "t", SETTINGS)
    store.append([_q("q1"), _q("q2")], [_samples(True, False), _samples(False, True)])
    with store.samples_path.open("a") as out:  # q3 cut off after its first sample, mid-line
        out.write(json.dumps({"id": "q3", "sample": 0, "answer": "1", "correct": True}) + "\n" + '{"id": "q3", "sam')
    done = store.done(2)
    assert sorted(done) == ["q1", "q2"] and [r["correct"] for r in done["q1"]] == [True, False]
    store.append([_q("q3")], [_samples(False, False)])  # starts on a fresh line after the cut-off one
    assert sorted(store.done(2)) == ["q1", "q2", "q3"]
    assert store.done(2)["q3"][0]["correct"] is True  # the first record of a sample wins


def test_other_settings_are_refused_and_fresh_starts_over(tmp_path):
    SampleStore(tmp_path / "t", SETTINGS).append([_q("q1")], [_samples(True, True)])
    with pytest.raises(UserError, match=r"other settings \(n was 2, now 4\); pass --fresh"):
        SampleStore(tmp_path / "t", {**SETTINGS, "n": 4})
    fresh = SampleStore(tmp_path / "t", {**SETTINGS, "n": 4}, fresh=True)
    assert fresh.done(4) == {} and not fresh.samples_path.exists()


def test_a_process_that_does_not_write_leaves_no_files(tmp_path):
    store = SampleStore(tmp_path / "t", SETTINGS, writes=False)
    records = store.append([_q("q1")], [_samples(True, False)])
    store.write_summary({"pass@1": 0.5})
    assert records[0][1]["answer"] == "1" and not (tmp_path / "t").exists()


def test_a_row_carries_task_question_reference_and_grade(tmp_path):
    store = SampleStore(tmp_path / "t", SETTINGS)
    store.append([_q("q1")], [_samples(True, False)], [{"level": 3}])
    row = json.loads(store.samples_path.read_text().splitlines()[1])
    assert row == {"task": "t", "id": "q1", "sample": 1, "prompt": "question q1", "reference": "ref q1",
                   "completion": "c1", "answer": "1", "correct": False, "tokens": 3, "max_tokens": 8,
                   "finished": True, "fields": {"level": 3}}


def test_a_failed_state_write_leaves_the_old_file_whole(tmp_path, monkeypatch):
    path = tmp_path / "settings.json"
    write_text_atomic(path, '{"n": 2}\n')

    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", fail)  # the new text is written, then the sync fails
    with pytest.raises(OSError, match="No space left"):
        write_text_atomic(path, '{"n": 4, "padding": "' + "x" * 10000 + '"}\n')
    assert read_state(path) == {"n": 2} and [p.name for p in tmp_path.iterdir()] == ["settings.json"]


def test_settings_are_written_once_not_after_every_chunk(tmp_path, monkeypatch):
    store = SampleStore(tmp_path / "t", SETTINGS)
    writes = []
    monkeypatch.setattr(store_module, "write_text_atomic", lambda path, text: writes.append(path.name) or
                        path.write_text(text))
    store.append([_q("q1")], [_samples(True, False)])
    store.append([_q("q2")], [_samples(True, False)])
    assert writes == ["settings.json"]


def test_a_corrupt_settings_file_is_one_line_naming_it(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "settings.json").write_text('{"task": "t", "n"')  # cut off by a kill mid-write
    with pytest.raises(UserError, match=r"eval state file .*settings.json is corrupt .*delete it .*--fresh"):
        SampleStore(tmp_path / "t", SETTINGS)
    assert SampleStore(tmp_path / "t", SETTINGS, fresh=True).done(2) == {}
