"""`grpo-run eval` end to end on the tiny config: bad inputs are one line and exit 2; an eval
writes every sample and a summary; an interrupted eval continues to the same result; a run's
checkpoint is evaluated; training logs the tasks of eval.tasks."""

import json
from pathlib import Path

import pytest

from grpo_runner_gsm8k.cli import main

SMALL = ("rollout.prompts_per_step=4", "rollout.n=4")


def _eval(tiny_config_path: str, run_dir: Path, *args: str) -> list[str]:
    return ["eval", "--config", tiny_config_path, *SMALL, f"logging.dir={run_dir}", *args]


def _one_line(err: str, *pieces: str) -> None:
    lines = [line for line in err.splitlines() if line.startswith("grpo-run: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for piece in pieces:
        assert piece in lines[0], lines[0]


@pytest.mark.parametrize("args,pieces", [
    (("--tasks", "mathh500"), ("unknown task 'mathh500'", "math500")),
    (("eval.greedy=false", "eval.n=2", "eval.k=[4]"),
     ("eval.k holds 4: each k must be an integer in 1..eval.n = 2", "raise eval.n")),
    (("eval.n=4",), ("eval.greedy is true with eval.n = 4", "eval.greedy=false")),
    (("--tasks", "boxed_math", "eval.tasks={boxed_math: {path: '{tmp}/d.jsonl'}}"),
     ("d.jsonl line 2 has no field 'answer'", "task.options.answer_field")),
])
def test_bad_eval_inputs_exit_2_with_one_line(tiny_config_path, tmp_path, capsys, args, pieces):
    rows = [{"problem": "1+1", "answer": "2", "unique_id": "a"}, {"problem": "2+2", "unique_id": "b"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = tuple(a.replace("{tmp}", str(tmp_path)) for a in args)
    assert main(_eval(tiny_config_path, tmp_path / "run", *args)) == 2
    _one_line(capsys.readouterr().err, *pieces)


def test_eval_of_a_run_without_checkpoints_exits_2(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    assert main(["eval", "--run-dir", str(tmp_path / "run")]) == 2
    _one_line(capsys.readouterr().err, "holds no complete checkpoint")


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_eval_writes_samples_and_summary_and_resumes(tiny_config_path, tmp_path, capsys):
    argv = _eval(tiny_config_path, tmp_path / "run", "eval.greedy=false", "eval.n=2", "--limit", "8")
    assert main(argv) == 0
    out = tmp_path / "run" / "eval" / "model" / "arithmetic"
    samples, summary = _lines(out / "samples.jsonl"), json.loads((out / "summary.json").read_text())
    assert len(samples) == 16 and {s["sample"] for s in samples} == {0, 1}
    assert set(samples[0]) >= {"id", "completion", "answer", "correct"}
    assert summary["questions"] == 8 and {"mean@2", "pass@1", "pass@2", "maj@1", "maj@2"} <= set(summary)
    assert "questions/s, ETA" in capsys.readouterr().err
    # An eval stopped after its first chunk (and mid-line) continues to the same samples.
    text = (out / "samples.jsonl").read_text().splitlines(keepends=True)
    (out / "samples.jsonl").write_text("".join(text[:8]) + text[8][:20])
    assert main(argv) == 0
    assert _lines_tolerant(out / "samples.jsonl") == samples
    assert json.loads((out / "summary.json").read_text())["pass@2"] == summary["pass@2"]
    assert "eval arithmetic: 8/8 questions" in capsys.readouterr().err
    # Every row is regraded from the file alone (a flipped verdict is graded again) to the same summary.
    rows = _lines_tolerant(out / "samples.jsonl")
    assert {"task", "prompt", "reference"} <= set(rows[0]) and rows[0]["task"] == "arithmetic"
    rows[0]["correct"] = not rows[0]["correct"]
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    regrade = _eval(tiny_config_path, tmp_path / "run", "eval.greedy=false", "eval.n=2",
                    "--regrade", str(out / "samples.jsonl"))
    assert main(regrade) == 0
    printed = capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    assert json.loads(printed.out) == {k: v for k, v in summary.items() if k != "seconds"}
    assert "regraded 16 samples" in printed.err and "1 verdicts differ from the file" in printed.err


def _lines_tolerant(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def test_eval_of_a_checkpoint_and_training_logs_eval_tasks(tiny_config_path, tmp_path, small_run):
    run_dir = tmp_path / "run"
    countdown = "eval.tasks={countdown: {count: 2, max_number: 4, max_target: 9, template: '{numbers}>{target}', " \
                "use_chat_template: false}}"
    train = ["--config", tiny_config_path, *small_run(1, eval_every=1), f"logging.dir={run_dir}",
             "eval.num_questions=4", "rollout.max_prompt_length=16", countdown]
    assert main(train) == 0
    logged = _lines(run_dir / "metrics.jsonl")[-1]
    assert {"eval/accuracy", "eval/countdown/greedy_accuracy", "eval/countdown/questions"} <= set(logged)
    assert main(["eval", "--run-dir", str(run_dir), "--tasks", "countdown", "--limit", "4"]) == 0
    summary = json.loads((run_dir / "eval" / "step-1" / "countdown" / "summary.json").read_text())
    assert summary["model"] == "step-1" and summary["questions"] == 4 and "greedy_accuracy" in summary


def test_streamed_eval_grades_every_question_once(tiny_config_path, tmp_path):
    """Rows of 4 tokens in rounds of 1: questions leave their slots as they finish."""
    argv = _eval(tiny_config_path, tmp_path / "run", "eval.greedy=false", "eval.n=2", "eval.max_new_tokens=4",
                 "rollout.max_new_tokens=4", "--limit", "10", "--stream")
    assert main(argv) == 0
    out = tmp_path / "run" / "eval" / "model" / "arithmetic"
    samples = _lines(out / "samples.jsonl")
    by_question = {}
    for sample in samples:
        by_question.setdefault(sample["id"], []).append(sample["sample"])
    assert len(by_question) == 10 and all(sorted(s) == [0, 1] for s in by_question.values())
    assert all(1 <= s["tokens"] <= 4 for s in samples)
    assert json.loads((out / "summary.json").read_text())["questions"] == 10


def test_an_exported_model_evaluates_as_its_checkpoint(tiny_config_path, tmp_path, small_run):
    run_dir, exported = tmp_path / "run", tmp_path / "hf"
    assert main(["--config", tiny_config_path, *small_run(1), f"logging.dir={run_dir}"]) == 0
    assert main(["export", "--run-dir", str(run_dir), "--out", str(exported)]) == 0
    common = ("--limit", "8", "eval.greedy=false", "eval.n=2")
    assert main(["eval", "--run-dir", str(run_dir), *common]) == 0
    same_run = [a for a in small_run(1) if not a.startswith("eval.every_steps=")]  # training's alone: refused
    assert main(["eval", "--config", tiny_config_path, *same_run, "--model", str(exported), "model.tokenizer=null",
                 f"logging.dir={tmp_path / 'base'}", *common]) == 0
    from_checkpoint = _lines(run_dir / "eval" / "step-1" / "arithmetic" / "samples.jsonl")
    from_export = _lines(tmp_path / "base" / "eval" / "model" / "arithmetic" / "samples.jsonl")
    assert from_export == from_checkpoint
