"""Checkpoint and resume end to end through the CLI: a run stopped by a signal (it saves its
step) or killed with SIGKILL after a checkpoint, and resumed, ends bitwise equal to an
uninterrupted run; refused resumes exit 2 with one line and change nothing; an unfinished
save is ignored.

Every run is a subprocess with the environment of this one (tests/conftest.py: 8 fake CPU
devices), so the stopped, the killed, the resumed and the reference run share XLA flags. One
chain covers both interruptions: stopped by SIGINT or SIGTERM, resumed, SIGKILLed after its
next checkpoint, resumed to the end. Three uninterrupted runs are the references: the plain
one; one with partial rollouts in bfloat16 compute on float32 masters (so one chain checks
both what mixed precision saves and what partial rollouts carry); one with multi-turn rows
carried across steps.
"""

import json
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from grpo_runner_gsm8k.operations.checkpoint import Resume, checkpoint_dir, complete_steps
from grpo_runner_gsm8k.operations.resume_config import config_differences
from grpo_runner_gsm8k.operations.metrics import truncate_metrics
from grpo_runner_gsm8k.commands.export import load_policy

pytestmark = pytest.mark.slow

STEPS = 6
KILL_AFTER = 2  # the kill comes once this step's checkpoint is complete
# rows of up to 8 tokens decoded 1 per round: steps carry rows into the next; bfloat16 compute on
# float32 masters (the default param_dtype): masters and float32 moments are what is saved
PARTIAL_MIXED = ("rollout.max_new_tokens=8", "rollout.partial.enabled=true", "rollout.partial.budget=1",
                 "loss.mismatch_correction=truncate", "model.dtype=bfloat16")
# tiny multi-turn rows with the calculator offered (tests/e2e/test_multihost_run.py's shape); by
# re-prefill a turn waits for every call, so a step's rows do not depend on how long tools take
MULTI_TURN = ("model.tokenizer=char-calculator", "task.options={digits: 1, operations: '+', use_chat_template: true}",
              "rollout.max_prompt_length=32", "rollout.max_new_tokens=16", "rollout.multi_turn.enabled=true",
              "rollout.multi_turn.tools=[calculator]", "rollout.multi_turn.max_turns=2",
              "rollout.multi_turn.max_total_tokens=64", "model.architecture.max_position_embeddings=128",
              "rollout.multi_turn.kv_cache=reprefill")
# the same rows carried across steps in rounds of 4 tokens, in the middle of a turn or after a tool turn
PARTIAL_MULTI_TURN = (*MULTI_TURN, "rollout.partial.enabled=true", "rollout.partial.budget=4",
                      "loss.mismatch_correction=truncate")
SCRIPTED_CALLS = Path(__file__).with_name("scripted_calls.py")  # grpo-run with scripted calls
RUN_TIMEOUT_S = 600
ERROR_TIMEOUT_S = 120


@dataclass(frozen=True)
class Runs:
    """The small tiny run these tests interrupt and resume (STEPS steps, each one saved), as subprocesses."""

    cli: Any  # tests/conftest.py's Cli
    overrides: list[str]

    def command(self, run_dir: Path, *overrides: str, flags: tuple[str, ...] = ()) -> list[str]:
        return self.cli.train_argv(*flags, *self.overrides, f"logging.dir={run_dir}", *overrides)

    def start(self, run_dir: Path, *overrides: str, stderr: Any) -> subprocess.Popen:
        return self.cli.start(self.command(run_dir, *overrides), stdout=subprocess.DEVNULL, stderr=stderr)

    def run_to_end(self, run_dir: Path, *overrides: str, flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        done = self.cli.run(self.command(run_dir, *overrides, flags=flags), timeout=RUN_TIMEOUT_S)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    def refused(self, run_dir: Path, *overrides: str, flags: tuple[str, ...] = (), stdout: str | None = None) -> str:
        """The one-line error of a run that must exit 2 (and print `stdout`, when given)."""
        done = self.cli.run(self.command(run_dir, *overrides, flags=flags), timeout=ERROR_TIMEOUT_S)
        assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("grpo-run: error: "), done.stderr
        assert stdout is None or done.stdout == stdout, done.stdout
        return lines[0]


@dataclass(frozen=True)
class ScriptedCalls:
    """`cli` (tests/conftest.py's Cli) running tests/e2e/scripted_calls.py instead of grpo-run."""

    cli: Any

    def train_argv(self, *args: str) -> list[str]:
        return [sys.executable, str(SCRIPTED_CALLS), "--config", self.cli.config, *args]

    def run(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        return self.cli.run(argv, timeout)

    def start(self, argv: list[str], **kwargs) -> subprocess.Popen:
        return self.cli.start(argv, **kwargs)


@pytest.fixture(scope="session")
def runs(grpo_cli, small_run) -> Runs:
    return Runs(grpo_cli, [*small_run(STEPS), "checkpoint.every_steps=1", f"checkpoint.keep={STEPS + 1}"])


def logged_steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_params(run_dir: Path) -> list[np.ndarray]:
    model, _ = load_policy(run_dir, STEPS)
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]


def max_abs_param_diff(run_a: Path, run_b: Path) -> float:
    pairs = zip(final_params(run_a), final_params(run_b), strict=True)
    return max(float(np.max(np.abs(a - b))) for a, b in pairs)


def saved_meta(run_dir: Path, step: int = STEPS) -> dict:
    return Resume.read(run_dir, [step]).meta


def files_of(run_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(run_dir)): p.stat().st_mtime_ns for p in run_dir.rglob("*")}


def kill_after_checkpoint(runs: Runs, run_dir: Path, step: int, log: Path, *overrides: str) -> int:
    """Starts a run, SIGKILLs it as soon as checkpoint `step` is complete, returns the
    newest complete checkpoint left behind."""
    with open(log, "w") as stderr:
        proc = runs.start(run_dir, *overrides, stderr=stderr)
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while step not in complete_steps(run_dir):
                assert proc.poll() is None, f"run exited ({proc.returncode}) before checkpoint {step}:\n" + \
                    log.read_text()[-3000:]
                assert time.monotonic() < deadline, f"no checkpoint {step} within {RUN_TIMEOUT_S}s"
                time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()  # no-op after the SIGKILL; ends the run if an assertion failed
            proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    return max(complete_steps(run_dir))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, runs) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    runs.run_to_end(run_dir)
    return run_dir


@pytest.fixture(scope="module")
def uninterrupted_partial_mixed(tmp_path_factory, runs) -> Path:
    """The reference of the resumes with carried rows, in bfloat16 compute."""
    run_dir = tmp_path_factory.mktemp("uninterrupted-partial-mixed")
    runs.run_to_end(run_dir, *PARTIAL_MIXED)
    return run_dir


def resume_equals_uninterrupted(runs: Runs, uninterrupted: Path, run_dir: Path, from_step: int, what: str, capsys,
                                *overrides: str, flags: tuple[str, ...] = ()) -> None:
    """Resumes `run_dir` to the end; its final params equal the uninterrupted run's bitwise."""
    resumed = runs.run_to_end(run_dir, *overrides, flags=flags)
    assert f"resumed from step {from_step} of " in resumed.stderr
    diff = max_abs_param_diff(uninterrupted, run_dir)
    with capsys.disabled():
        print(f"\n{what}, resumed to step {STEPS}: max abs param diff vs uninterrupted run = {diff}")
    assert diff == 0.0


def test_sigterm_then_sigkill_then_resume_with_partial_rollouts_and_mixed_precision_ends_bitwise_equal(
        uninterrupted_partial_mixed, tmp_path, capsys, runs):
    """The carried rows are in both checkpoints (at SIGTERM, rows kept in their KV cache within a
    step, the default, are token lists again at the step's end): each resumed run continues them
    exactly. bfloat16 compute on float32 masters: masters and float32 moments are what is saved."""
    reference = uninterrupted_partial_mixed
    stopped_at, killed_at = check_stop_kill_resume(runs, reference, tmp_path, capsys, signal.SIGTERM, *PARTIAL_MIXED)
    for step, what in ((stopped_at, "stop"), (killed_at, "kill")):
        assert saved_meta(tmp_path / "run", step)["carried"]["groups"], f"nothing was carried at the {what}"
    assert saved_meta(tmp_path / "run", STEPS)["carried"] == saved_meta(reference, STEPS)["carried"]


def test_sigkill_then_resume_of_each_model_family_ends_bitwise_equal(family_run, tmp_path, capsys, runs):
    """Llama, Gemma 3 and Qwen3-MoE (tests/conftest.py's FAMILY_RUNS: one loss implementation each) in
    bfloat16 compute on float32 masters: what each family's parameters and optimizer state hold
    (the router and experts, the four norms per layer) resumes bitwise."""
    overrides = (*family_run, "model.dtype=bfloat16")
    reference = tmp_path / "uninterrupted"
    runs.run_to_end(reference, *overrides)
    assert any(step["train-other/grad_norm"] > 0 for step in logged_steps(reference))  # it trained
    check_sigkill_resume(runs, reference, tmp_path, capsys, *overrides)


def test_sigkill_then_resume_with_multi_turn_rollouts_ends_bitwise_equal(tmp_path, capsys, runs):
    """A multi-turn step rolls every row out to its end, so a checkpoint never holds a row in
    mid-conversation: the resumed run redoes the next step's rollout as the uninterrupted one did."""
    reference = tmp_path / "uninterrupted"
    runs.run_to_end(reference, *MULTI_TURN)
    check_sigkill_resume(runs, reference, tmp_path, capsys, *MULTI_TURN)
    reference_tools = [{k: v for k, v in r.items() if k.startswith("train-tools/") and k != "train-tools/seconds"}
                       for r in logged_steps(reference)]
    resumed_tools = [{k: v for k, v in r.items() if k.startswith("train-tools/") and k != "train-tools/seconds"}
                     for r in logged_steps(tmp_path / "killed")]
    assert resumed_tools == reference_tools and all(tools for tools in resumed_tools)


@pytest.fixture(scope="module")
def scripted(runs) -> Runs:
    """Runs whose policy writes scripted tool calls (a random tiny model almost never writes one)."""
    return Runs(ScriptedCalls(runs.cli), runs.overrides)


@pytest.fixture(scope="module")
def uninterrupted_conversations(tmp_path_factory, scripted) -> Path:
    """The reference of both resumes with multi-turn rows carried across steps."""
    reference = tmp_path_factory.mktemp("uninterrupted-conversations")
    scripted.run_to_end(reference, *PARTIAL_MULTI_TURN)
    return reference


def test_sigterm_then_sigkill_then_resume_with_conversations_carried_across_steps_ends_bitwise_equal(
        uninterrupted_conversations, scripted, tmp_path, capsys):
    """Multi-turn rows carried across steps (partial rollouts) are in both checkpoints: SIGTERM finishes
    the step and saves it with the conversations still running; the resumed run is SIGKILLed after a
    checkpoint that holds a row after a tool turn. Each resumed run continues them exactly."""
    reference = uninterrupted_conversations

    def running(run_dir: Path, step: int) -> list[dict]:
        groups = saved_meta(run_dir, step)["carried"]["groups"].values()
        return [row for group in groups for row in group["rows"] if row["state"] == "running"]

    # the runs are deterministic: the kill comes after the first checkpoint past the stop that holds such a row
    def after_tool_turn(stopped_at: int) -> int:
        kill_after = next((step for step in range(stopped_at + 1, STEPS) if after_a_tool_turn(reference, step)), None)
        assert kill_after is not None, f"no checkpoint after {stopped_at} holds a row carried after a tool turn"
        return kill_after

    stopped_at, killed_at = check_stop_kill_resume(scripted, reference, tmp_path, capsys, signal.SIGTERM,
                                                   *PARTIAL_MULTI_TURN, kill_after=after_tool_turn)
    run_dir = tmp_path / "run"
    carried = saved_meta(run_dir, killed_at)["carried"]["groups"].values()
    mid_turn = sum(bool(row["open_ids"]) for group in carried for row in group["rows"])
    with capsys.disabled():
        print(f"checkpoint {stopped_at} carried {len(running(run_dir, stopped_at))} running conversations; "
              f"checkpoint {killed_at} carried {len(after_a_tool_turn(run_dir, killed_at))} rows after a tool "
              f"turn, {mid_turn} in the middle of a turn")
    assert running(run_dir, stopped_at), "no conversation was running at the stop"
    assert after_a_tool_turn(run_dir, killed_at)
    assert timeless(saved_meta(run_dir, STEPS)["carried"]) == timeless(saved_meta(reference, STEPS)["carried"])
    assert [r["train-tools/calls"] for r in logged_steps(run_dir)] == \
        [r["train-tools/calls"] for r in logged_steps(reference)]


def timeless(carried: dict) -> dict:
    """Carried conversations without the seconds their tools took (which no two runs share)."""
    for group in carried["groups"].values():
        for row in group["rows"]:
            row["trajectory"]["tool_seconds"] = None
    return carried


def after_a_tool_turn(run_dir: Path, step: int) -> list[dict]:
    """The rows carried in checkpoint `step` that are running after a tool turn."""
    groups = saved_meta(run_dir, step)["carried"]["groups"].values()
    return [row for group in groups for row in group["rows"]
            if row["trajectory"]["tool_calls"] and row["state"] == "running"]


def check_sigkill_resume(runs: Runs, uninterrupted: Path, tmp_path: Path, capsys, *overrides: str) -> None:
    """SIGKILL after checkpoint KILL_AFTER, resume, compare."""
    run_dir = tmp_path / "killed"
    killed_at = kill_after_checkpoint(runs, run_dir, KILL_AFTER, tmp_path / "killed.log", *overrides)
    resume_after_kill_equals(runs, uninterrupted, run_dir, killed_at, capsys, *overrides)


def check_stop_kill_resume(runs: Runs, uninterrupted: Path, tmp_path: Path, capsys, signum: int, *overrides: str,
                           kill_after: Callable[[int], int] = lambda stopped_at: stopped_at + 1) -> tuple[int, int]:
    """A run stopped by `signum` (it saves the step it finished and says so), resumed and SIGKILLed
    after checkpoint `kill_after(stopped step)`, and resumed to the end: compared as a SIGKILL resume.
    Returns the steps the stop and the kill left."""
    run_dir = tmp_path / "run"
    stopped_at = stop_and_save(runs, run_dir, signum, tmp_path / "stopped.log", *overrides)
    killed_log = tmp_path / "killed.log"
    killed_at = kill_after_checkpoint(runs, run_dir, kill_after(stopped_at), killed_log, *overrides)
    assert f"resumed from step {stopped_at} of " in killed_log.read_text()
    resume_after_kill_equals(runs, uninterrupted, run_dir, killed_at, capsys, *overrides)
    return stopped_at, killed_at


def resume_after_kill_equals(runs: Runs, uninterrupted: Path, run_dir: Path, killed_at: int, capsys,
                             *overrides: str) -> None:
    """Resumes `run_dir` SIGKILLed after checkpoint `killed_at`: the end equals `uninterrupted` in params,
    every logged step's losses and rewards, and the saved key, data position and step."""
    assert killed_at < STEPS, "the run ended before the kill; nothing was resumed"
    what = f"SIGKILL after checkpoint {killed_at} {' '.join(overrides)}".rstrip()
    resume_equals_uninterrupted(runs, uninterrupted, run_dir, killed_at, what, capsys, *overrides, flags=("--resume",))
    reference, records = logged_steps(uninterrupted), logged_steps(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # no duplicates after the resume
    for key in ("train-other/loss", "train-other/grad_norm", "train-other/update_ratio", "train-reward/total/mean"):
        assert [r[key] for r in records] == [r[key] for r in reference], key
    for key in ("key", "data", "skipped_steps", "step"):
        assert saved_meta(run_dir)[key] == saved_meta(uninterrupted)[key], key


def test_resume_with_incompatible_config_exits_2_naming_the_keys(uninterrupted, runs):
    before = files_of(uninterrupted)
    message = runs.refused(uninterrupted, "rollout.n=8", "model.architecture.hidden_size=32", "train.optimizer=sgd",
                           stdout="")
    assert "rollout.n (saved 4, now 8)" in message
    assert "model.architecture.hidden_size (saved 64, now 32)" in message
    assert 'train.optimizer (saved "adamw", now "sgd")' in message
    assert "use the saved values, or set logging.dir to a new directory" in message
    assert files_of(uninterrupted) == before


def test_checkpoints_with_resume_never_exit_2_and_change_nothing(uninterrupted, runs):
    before = files_of(uninterrupted)
    message = runs.refused(uninterrupted, "checkpoint.resume=never", stdout="")
    assert f"already holds checkpoints (newest: step {STEPS}) and checkpoint.resume is 'never'" in message
    assert "pass --resume" in message
    assert files_of(uninterrupted) == before


def test_unfinished_save_is_ignored_and_cleaned_up(uninterrupted, tmp_path, runs):
    run_dir = tmp_path / "copy"
    shutil.copytree(uninterrupted, run_dir)
    # What a kill during the save of the next step leaves: a tmp directory, half written.
    unfinished = checkpoint_dir(run_dir) / f"{STEPS + 1}.orbax-checkpoint-tmp"
    shutil.copytree(checkpoint_dir(run_dir) / str(STEPS), unfinished)
    shutil.rmtree(unfinished / "params")
    assert complete_steps(run_dir)[-1] == STEPS

    resumed = runs.run_to_end(run_dir, f"train.steps={STEPS + 1}")  # checkpoint.resume=auto, no flag
    assert f"resumed from step {STEPS} of " in resumed.stderr
    assert complete_steps(run_dir)[-1] == STEPS + 1
    assert not unfinished.exists()
    assert [r["step"] for r in logged_steps(run_dir)] == list(range(1, STEPS + 2))


def test_only_settings_that_keep_the_math_may_change_on_resume():
    saved = {"train": {"steps": 6, "lr": 1e-3, "micro_batch_size_per_device": 0}, "logging": {"dir": "a"},
             "model": {"architecture": {"hidden_size": 64}, "remat": "none"}, "task": {"options": {}}}
    changed = {"train": {"steps": 9, "lr": 1e-3, "micro_batch_size_per_device": 2}, "logging": {"dir": "b"},
               "model": {"architecture": {"hidden_size": 64}, "remat": "full"}, "task": {"options": {}}}
    assert config_differences(saved, changed) == {}
    changed["task"]["options"] = {"digits": 2}
    changed["train"]["lr"] = 2e-3
    differences = config_differences(saved, changed)
    assert sorted(differences) == ["task.options.digits", "train.lr"]
    assert differences["train.lr"] == (1e-3, 2e-3) and differences["task.options.digits"][1] == 2


def test_truncated_metrics_keep_steps_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "x')
    truncate_metrics(path, 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


# ---- preemption: SIGTERM / SIGINT finish the step, save it and exit 128 + signal
def stop_with_signal(runs: Runs, run_dir: Path, signum: int, log: Path, *overrides: str) -> subprocess.CompletedProcess:
    """Starts a run without periodic saves, sends `signum` once step 2 is logged, waits."""
    with open(log, "w") as stderr:
        proc = runs.start(run_dir, *overrides, "checkpoint.every_steps=0", stderr=stderr)
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            metrics = run_dir / "metrics.jsonl"
            while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= KILL_AFTER):
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, f"step {KILL_AFTER} not logged within {RUN_TIMEOUT_S}s"
                time.sleep(0.05)
            proc.send_signal(signum)
            proc.wait(timeout=RUN_TIMEOUT_S)
        finally:
            proc.kill()
            proc.wait(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", log.read_text())


def stop_and_save(runs: Runs, run_dir: Path, signum: int, log: Path, *overrides: str) -> int:
    """Stops a run with `signum`: it exits 128 + signal with one line naming the checkpoint of the step
    it finished (the only one: no periodic saves). Returns that step."""
    stopped = stop_with_signal(runs, run_dir, signum, log, *overrides)
    assert stopped.returncode == 128 + signum, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr
    last = stopped.stderr.strip().splitlines()[-1]
    saved = complete_steps(run_dir)
    assert len(saved) == 1 and KILL_AFTER <= saved[0] < STEPS - 1, (saved, last)
    assert last == (f"grpo-run: stopped by {signal.Signals(signum).name} after step {saved[0]} of {STEPS}; "
                    f"saved checkpoint {checkpoint_dir(run_dir) / str(saved[0])}; run the same command again "
                    "to continue")
    return saved[0]


def test_sigint_then_sigkill_then_resume_ends_bitwise_equal(uninterrupted, tmp_path, capsys, runs):
    """Ctrl-C saves the step as SIGTERM does; the resumed run (checkpoint.resume=auto: the same command
    again continues), SIGKILLed after its next checkpoint and resumed, ends as the uninterrupted run."""
    check_stop_kill_resume(runs, uninterrupted, tmp_path, capsys, signal.SIGINT)


# ---- checkpoint faults
def _truncate_files(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file() and path.stat().st_size > 16:
            with open(path, "r+b") as f:
                f.truncate(path.stat().st_size // 2)


BREAKAGES = {"truncated": lambda step_dir: _truncate_files(step_dir / "params"),
             "partly-deleted": lambda step_dir: shutil.rmtree(step_dir / "opt_state")}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_resume_falls_back_past_a_broken_newest_checkpoint(breakage, uninterrupted, tmp_path, runs):
    run_dir = tmp_path / "copy"
    shutil.copytree(uninterrupted, run_dir)
    broken = checkpoint_dir(run_dir) / str(STEPS)
    BREAKAGES[breakage](broken)

    resumed = runs.run_to_end(run_dir, flags=("--resume",))
    warnings = [line for line in resumed.stderr.splitlines() if line.startswith("grpo-run: warning: checkpoint")]
    assert len(warnings) == 1 and f"checkpoint {broken} is unreadable (" in warnings[0], resumed.stderr[-3000:]
    assert warnings[0].endswith(f"resuming from step {STEPS - 1}")
    assert f"resumed from step {STEPS - 1} of " in resumed.stderr
    assert (checkpoint_dir(run_dir) / f"{STEPS}.unreadable").is_dir()  # kept aside, not deleted
    assert max_abs_param_diff(uninterrupted, run_dir) == 0.0  # step STEPS trained again, identically


def test_failing_save_stops_the_run_with_one_line_and_keeps_earlier_checkpoints(tmp_path, capsys, runs):
    """Once checkpoint 2 is complete, the run's file-size limit drops to 64 KiB: later saves
    (the params alone are ~0.4 MB) fail with EFBIG, deterministically and without root."""
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    # Far more steps than it takes to notice checkpoint 2 on a loaded machine, all kept: a later save fails.
    longer = ("train.steps=400", "checkpoint.keep=1000")
    with open(log, "w") as stderr:
        proc = runs.start(run_dir, *longer, stderr=stderr)
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while KILL_AFTER not in complete_steps(run_dir):
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.02)
            import resource
            resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
            proc.wait(timeout=RUN_TIMEOUT_S)
        finally:
            proc.kill()
            proc.wait(timeout=60)
    err = log.read_text()  # TensorStore's "Event loop is closed" callbacks are dropped by the run itself
    assert proc.returncode == 1, err[-3000:]  # a fault of the machine, not bad input
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("grpo-run: error: ")]
    assert len(errors) == 1 and errors == err.strip().splitlines(), err[-3000:]
    failed_step = int(errors[0].split("saving checkpoint ")[1].split(" failed")[0].rsplit("/", 1)[1])
    assert f"saving checkpoint {checkpoint_dir(run_dir) / str(failed_step)} failed (" in errors[0]
    assert "File too large" in errors[0], errors[0]
    with capsys.disabled():
        print(f"\nfailing save: exit {proc.returncode}, {len(logged_steps(run_dir))} steps logged, {errors[0]}")
    assert len(logged_steps(run_dir)) <= failed_step + 1  # stopped at once, not at the end of the run
    kept = complete_steps(run_dir)
    assert KILL_AFTER in kept and max(kept) < failed_step
    load_policy(run_dir, max(kept))  # the newest kept checkpoint still restores


# ---- one run per logging.dir
def test_second_run_on_a_live_run_dir_is_refused_naming_the_holder(tmp_path, runs):
    run_dir = tmp_path / "live"
    first = runs.start(run_dir, "train.steps=100000", stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not ((run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").read_text()):
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        message = runs.refused(run_dir, "train.steps=100000")
        assert f"logging.dir {str(run_dir)!r} is in use by pid {first.pid} on host " in message
        assert "wait for that run to end, or set logging.dir to another directory" in message
    finally:
        first.kill()
        first.wait(timeout=60)


def test_stale_lock_of_a_dead_run_is_taken_over(uninterrupted, tmp_path, runs):
    run_dir = tmp_path / "copy"
    shutil.copytree(uninterrupted, run_dir)
    (run_dir / ".lock").write_text(json.dumps({"pid": 2 ** 22 + 1, "host": "gone"}))
    resumed = runs.run_to_end(run_dir, f"train.steps={STEPS + 1}")
    assert f"grpo-run: warning: took over the stale lock of pid {2 ** 22 + 1} on host gone on {run_dir}" \
        in resumed.stderr
    assert complete_steps(run_dir)[-1] == STEPS + 1
    assert (run_dir / ".lock").read_text() == ""  # released at the end


def test_checkpoint_with_per_layer_params_is_refused_in_one_line(uninterrupted, tmp_path, runs):
    """A checkpoint from before stacked decoder layers has no `param_layout` in its meta."""
    run_dir = tmp_path / "old-layout"
    shutil.copytree(uninterrupted, run_dir)
    meta_dir = checkpoint_dir(run_dir) / str(STEPS) / "meta"
    meta = saved_meta(run_dir)
    del meta["param_layout"]
    shutil.rmtree(meta_dir)
    with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as writer:
        writer.save(meta_dir, args=ocp.args.JsonSave(meta))
    before = files_of(run_dir)
    message = runs.refused(run_dir, f"train.steps={STEPS + 1}", flags=("--resume",))
    assert f"checkpoint {checkpoint_dir(run_dir) / str(STEPS)} was written by an older version" in message
    assert "start a new logging.dir" in message
    assert files_of(run_dir) == before
