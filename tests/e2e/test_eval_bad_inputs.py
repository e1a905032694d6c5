"""`grpo-run eval` on bad input: one line naming what was wrong and what to do, exit 2, and
nothing written; each is found before any model is loaded (the run directory stays absent)
except the truncated checkpoint, which is found as the weights are read."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from grpo_core.errors import UserError
from grpo_runner_gsm8k.cli import main

SMALL = ("rollout.prompts_per_step=4", "rollout.n=4")
COUNTDOWN = "eval.tasks={countdown: {count: 2, max_number: 4, max_target: 9, use_chat_template: false}}"


def _one_line(err: str, *pieces: str) -> None:
    lines = [line for line in err.splitlines() if line.startswith("grpo-run: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for piece in pieces:
        assert piece in lines[0], lines[0]


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


CASES = [
    ("every_steps", ("eval.every_steps=5",), ("eval.every_steps=5", "training's eval period", "drop it")),
    ("limit_disagrees", ("--limit", "8", "eval.num_questions=16"),
     ("--limit 8 and eval.num_questions=16 disagree", "give one of them")),
    ("config_with_run_dir", ("--run-dir", "{tmp}/other", "--config", "{config}"),
     ("with --run-dir: the run's saved config", "drop --config")),
    ("model_with_run_dir", ("--run-dir", "{tmp}/other", "--model", "{tmp}"), ("--model", "drop --model")),
    ("out_is_a_file", ("--out", "{tmp}/afile"), ("afile cannot be made: it is a file", "--out")),
    ("out_under_a_file", ("--out", "{tmp}/afile/sub"), ("afile is a file, not a directory", "--out")),
    ("task_dir_is_a_file", ("--out", "{tmp}/out"), ("out/arithmetic cannot be made: it is a file",)),
    ("reward_for_graded_tasks", (COUNTDOWN, "eval.reward=format", "task.rewards={correctness: 1.0, format: 0.0}"),
     ("eval.reward=format: every task evaluated (countdown) grades with its own grader", "drop it")),
    ("threshold_for_graded_tasks", (COUNTDOWN, "eval.pass_threshold=0.5"),
     ("eval.pass_threshold=0.5: every task evaluated (countdown)",)),
    ("missing_task_file", ("--tasks", "math500", "eval.tasks={math500: {path: '{tmp}/none.jsonl'}}"),
     ("none.jsonl does not exist", "task.options.path")),
    ("corrupt_settings", ("--out", "{tmp}/out2"), ("eval state file", "settings.json is corrupt", "--fresh")),
    ("corrupt_summary", ("--out", "{tmp}/out3"), ("eval state file", "summary.json is corrupt", "delete it")),
    ("regrade_missing_file", ("--regrade", "{tmp}/none.jsonl"), ("--regrade", "none.jsonl: no such file")),
    ("regrade_old_rows", ("--regrade", "{tmp}/old.jsonl"), ("rows without task, reference and completion",)),
    ("regrade_with_fresh", ("--regrade", "{tmp}/old.jsonl", "--fresh"), ("--fresh with --regrade", "drop --fresh")),
    ("step_without_run_dir", ("--step", "3"), ("--step only applies to --run-dir",)),
]


def _setup(tmp: Path, tiny_config_path: str) -> None:
    (tmp / "other").mkdir()
    (tmp / "afile").write_text("not a directory")
    (tmp / "out").mkdir()
    (tmp / "out" / "arithmetic").write_text("a file where the task's directory goes")
    for name, state in (("out2", "settings.json"), ("out3", "summary.json")):
        (tmp / name / "arithmetic").mkdir(parents=True)
        (tmp / name / "arithmetic" / state).write_text('{"task": "arith')  # cut off mid-write
    (tmp / "old.jsonl").write_text(json.dumps({"id": "q", "sample": 0, "answer": "1", "correct": True}) + "\n")


@pytest.mark.parametrize("name,args,pieces", CASES, ids=[case[0] for case in CASES])
def test_bad_eval_input_is_one_line_exit_2_and_writes_nothing(tiny_config_path, tmp_path, capsys, name, args, pieces):
    _setup(tmp_path, tiny_config_path)
    before = _files(tmp_path)
    args = [a.replace("{tmp}", str(tmp_path)).replace("{config}", tiny_config_path) for a in args]
    config = [] if "--run-dir" in args else ["--config", tiny_config_path, f"logging.dir={tmp_path / 'run'}"]
    assert main(["eval", *config, *SMALL, *args]) == 2
    _one_line(capsys.readouterr().err, *[p.replace("{tmp}", str(tmp_path)) for p in pieces])
    assert _files(tmp_path) == before  # no run directory, no output directory, nothing changed


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_output_directory_is_refused_before_the_model(tiny_config_path, tmp_path, capsys):
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o555)
    try:
        assert main(["eval", "--config", tiny_config_path, *SMALL, "--out", str(tmp_path / "ro" / "x")]) == 2
    finally:
        (tmp_path / "ro").chmod(0o755)
    _one_line(capsys.readouterr().err, "is not writable", "--out")


def test_a_hub_task_offline_is_one_line(grpo_cli, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    done = grpo_cli.run(grpo_cli.argv("eval", "--config", grpo_cli.config, f"logging.dir={tmp_path / 'run'}",
                                      "--tasks", "math500"), timeout=300, env=env)
    assert done.returncode == 2, done.stderr
    _one_line(done.stderr, "task math500: cannot load HF Hub dataset HuggingFaceH4/MATH-500 split test",
              "(HF_HUB_OFFLINE is set)", "set task.options.path")
    assert not (tmp_path / "run").exists()


def _saved_params(run_dir: Path, step: int, params: dict) -> None:
    import orbax.checkpoint as ocp

    from grpo_runner_gsm8k.operations.checkpoint import checkpoint_dir

    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as writer:
        writer.save(checkpoint_dir(run_dir) / str(step) / "params", args=ocp.args.StandardSave(params))


def test_a_truncated_checkpoint_names_its_directory_and_the_step_before(tmp_path, monkeypatch):
    """Two checkpoints' params as orbax writes them; the newest's array files cut short."""
    import jax

    from grpo_runner_gsm8k.commands import evaluate
    from grpo_runner_gsm8k.operations.checkpoint import PARAM_LAYOUT, Resume, checkpoint_dir

    params = {"w": np.arange(4096, dtype=np.float32).reshape(64, 64)}
    for step in (1, 2):
        _saved_params(tmp_path, step, params)
    monkeypatch.setattr(Resume, "read", classmethod(lambda cls, run_dir, steps: cls(
        Path(run_dir), steps, {}, {"param_layout": PARAM_LAYOUT})))
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    assert np.array_equal(evaluate._checkpoint_params(str(tmp_path), 1, target)["w"], params["w"])
    for data in (checkpoint_dir(tmp_path) / "2").rglob("*"):
        if data.is_file() and data.stat().st_size > 1024:
            data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(UserError) as error:
        evaluate._checkpoint_params(str(tmp_path), 2, target)
    message = str(error.value)
    assert f"checkpoint {checkpoint_dir(tmp_path) / '2'} is unreadable" in message, message
    assert "pass --step 1" in message and "\n" not in message, message


def test_an_error_orbax_wraps_is_one_line_too(tmp_path, monkeypatch):
    """A restore that fails with a type the checkpoint reader does not catch (orbax re-raises a
    TensorStore error wrapped in its own) still ends as one line with the operating-system cause."""
    import jax

    from grpo_runner_gsm8k.commands import evaluate
    from grpo_runner_gsm8k.operations import checkpoint

    _saved_params(tmp_path, 1, {"w": np.zeros(4, np.float32)})

    def wrapped(*args, **kwargs):
        try:
            raise OSError(5, "Input/output error", "params/d/0a1b")
        except OSError as exc:
            raise RuntimeError("restore failed") from exc

    monkeypatch.setattr(checkpoint, "_read_item", wrapped)
    monkeypatch.setattr(checkpoint.Resume, "read", classmethod(lambda cls, run_dir, steps: cls(
        Path(run_dir), steps, {}, {"param_layout": checkpoint.PARAM_LAYOUT})))
    with pytest.raises(UserError, match=r"checkpoints/1 is unreadable \(OSError: Input/output error\); it is the "
                                        r"run's only checkpoint"):
        evaluate._checkpoint_params(str(tmp_path), 1, {"w": jax.ShapeDtypeStruct((4,), np.float32)})
