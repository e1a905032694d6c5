"""The CLI's error boundary: an exception nothing foresaw becomes one line, exit 1 and a crash
log (traceback, config, versions) in the run directory; a run that would not fit in memory
stops before dispatch with exit 3 and the memory plan's message."""

import re
from pathlib import Path

import pytest

from grpo_core.errors import RunFault, UserError
from grpo_runner_gsm8k import cli, loop
from grpo_runner_gsm8k.operations import memory_check
from grpo_runner_gsm8k.cli import main

LOG = re.compile(r"traceback, config and versions in (\S+crash-\S+\.log);")


def _fail_step(self):
    raise RuntimeError("injected fault\nwith a second line")


def crash_log_of(line: str) -> Path:
    found = LOG.search(line)
    assert found, line
    return Path(found.group(1))


def test_unexpected_error_is_one_line_exit_1_and_a_crash_log_in_the_run_dir(tmp_path, one_step, tiny_config_path,
                                                                            monkeypatch, capsys):
    monkeypatch.setattr(loop.Trainer, "step", _fail_step)
    run_dir = tmp_path / "run"
    assert main(one_step(run_dir)) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.startswith("grpo-run:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("grpo-run: error: unexpected error in loop.py:"), lines[0]
    assert "(train_steps): RuntimeError: injected fault with a second line;" in lines[0]
    log = crash_log_of(lines[0])
    assert log.parent == run_dir
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "RuntimeError: injected fault" in text
    assert re.search(r"^jax \d", text, re.M) and re.search(r"^grpo-runner-gsm8k \d", text, re.M)
    assert "\nconfig:\nmodel:" in text and f"dir: {run_dir}" in text
    assert f"command: grpo-run --config {tiny_config_path}" in text


def test_debug_also_prints_the_traceback(tmp_path, one_step, monkeypatch, capsys):
    monkeypatch.setattr(loop.Trainer, "step", _fail_step)
    assert main(one_step(tmp_path / "run", "--debug")) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.strip().splitlines()[-1].startswith("grpo-run: error:")


def test_crash_before_the_run_dir_exists_logs_to_the_temp_dir(tmp_path, one_step, monkeypatch, capsys):
    def fail(*args, **kwargs):
        raise KeyError("no such thing")

    monkeypatch.setattr(loop, "build_run", fail)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert main(one_step(tmp_path / "never")) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert crash_log_of(line).parent == tmp_path and not (tmp_path / "never").exists()
    assert "KeyError: 'no such thing'" in line


def test_a_run_that_does_not_fit_exits_3_before_dispatch(tmp_path, one_step, monkeypatch, capsys):
    """No memory beside what the run already holds: the first phase, compiled before it runs,
    cannot fit; the line is the plan's does-not-fit message and no step is logged."""
    monkeypatch.setattr(memory_check, "host_available_bytes", lambda: 0)
    run_dir = tmp_path / "run"
    assert main(one_step(run_dir)) == 3
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(r"grpo-run: error: rollout prefill needs \d+\.\d\d GiB per device, exceeds capacity by "
                        r"\d+\.\d\d GiB \(capacity \d+\.\d\d GiB\): lower rollout\.prompts_per_step, rollout\.n or "
                        r"rollout\.max_new_tokens, set rollout\.options\.cache_dtype=bfloat16, or use more devices",
                        line), line
    assert not (run_dir / "metrics.jsonl").exists() or (run_dir / "metrics.jsonl").read_text() == ""


@pytest.mark.slow
@pytest.mark.skipif((memory_check.host_available_bytes() or 0) > 64 << 30,
                    reason="this host has the ~75 GiB the rollout needs: it would fit")
def test_rollout_n_100000_on_cpu_exits_3_instead_of_running_out_of_memory(tmp_path, tiny_config_path, capsys):
    """1.6 million rollout rows need tens of GiB per device: refused from the compiled prefill
    (without the check XLA fails allocating them, with a traceback). Each prompt repeated n times
    (shared_prompt off), the prefill is the first phase too large; shared, the rollout of 1.6
    million rows runs (slowly) and the train step is the one refused."""
    run_dir = tmp_path / "run"
    assert main(["--config", tiny_config_path, "train.steps=1", "rollout.n=100000", "rollout.options.shared_prompt=false",
                 f"logging.dir={run_dir}"]) == 3
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("grpo-run: error: rollout prefill needs ") and "lower rollout.prompts_per_step" in line


@pytest.mark.parametrize("fault,at_once", [(RunFault("disk full"), True), (UserError("bad value"), False)])
def test_a_machine_fault_exits_at_once_after_its_line(fault, at_once, monkeypatch, capsys):
    """A failed save leaves orbax threads that would hold interpreter shutdown for minutes: after
    its one line, a machine fault leaves through os._exit; bad input returns its code as usual."""
    def fail(argv):
        raise fault

    def exit_now(code):
        raise SystemExit(("os._exit", code))

    monkeypatch.setattr(cli, "run", fail)
    monkeypatch.setattr(cli.os, "_exit", exit_now)
    if at_once:
        with pytest.raises(SystemExit) as left:
            cli.main(["--config", "x.yaml"])
        assert left.value.code == ("os._exit", 1)
    else:
        assert cli.main(["--config", "x.yaml"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"grpo-run: error: {fault}"
