"""`grpo-run launch`: per-host commands that the real config loader accepts, bad input, running."""

import shlex
import sys
import textwrap

import pytest

from grpo_core.config_io import load_config
from grpo_core.registry import default_registry
from grpo_runner_gsm8k.cli import main


def _remote_args(ssh_line: str) -> tuple[str, list[str]]:
    """(host, training arguments) of one printed `ssh ... HOST 'grpo-run ...'` line."""
    *_, host, command = shlex.split(ssh_line)
    program, *train_args = shlex.split(command)
    assert program == "grpo-run"
    return host, train_args


def _config_of(train_args: list[str]):
    assert train_args[0] == "--config"
    return load_config(train_args[1], train_args[2:], registry=default_registry())


def test_dry_run_gives_each_host_its_process_id_and_a_valid_config(capsys, tiny_config_path):
    assert main(["launch", "--hosts", "node0,node1", "--coordinator-port", "9000", "--dry-run", "--",
                 "--config", tiny_config_path, "train.steps=5"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    for process_id, (line, expected_host) in enumerate(zip(lines, ["node0", "node1"])):
        host, train_args = _remote_args(line)
        assert host == expected_host
        cfg = _config_of(train_args)
        assert cfg.train.steps == 5
        assert (cfg.mesh.distributed, cfg.mesh.coordinator_address) == ("on", "node0:9000")
        assert (cfg.mesh.num_processes, cfg.mesh.process_id, cfg.mesh.require_process_count) == (2, process_id, 2)


def test_dry_run_quotes_arguments_and_changes_directory(capsys, tiny_config_path):
    assert main(["launch", "--hosts", "a,b,c", "--workdir", "/srv/my runs", "--program", "uv run grpo-run",
                 "--dry-run", "--", "--config", tiny_config_path, "task.system_prompt=Be brief."]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    command = shlex.split(lines[2])[-1]
    assert command.startswith("cd '/srv/my runs' && uv run grpo-run --config ")
    assert "'task.system_prompt=Be brief.'" in command
    assert "mesh.coordinator_address=a:8476" in command and "mesh.process_id=2" in command


def test_workdir_under_home_is_expanded_by_the_host(capsys, tiny_config_path):
    assert main(["launch", "--hosts", "a", "--workdir", "~/my runs", "--dry-run", "--",
                 "--config", tiny_config_path]) == 0
    command = shlex.split(capsys.readouterr().out.strip())[-1]
    assert command.startswith("cd ~/'my runs' && grpo-run ")


def test_tpu_dry_run_prints_one_gcloud_command_requiring_every_worker(capsys, tiny_config_path):
    assert main(["launch", "--tpu", "my-pod", "--zone", "us-east5-b", "--num-workers", "4", "--dry-run", "--",
                 "--config", tiny_config_path]) == 0
    argv = shlex.split(capsys.readouterr().out.strip())
    assert argv[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-pod"]
    assert argv[6:10] == ["--zone", "us-east5-b", "--worker=all", "--command"]
    program, *train_args = shlex.split(argv[10])
    assert program == "grpo-run"
    cfg = _config_of(train_args)
    assert cfg.mesh.require_process_count == 4
    assert (cfg.mesh.distributed, cfg.mesh.coordinator_address) == ("auto", None)


BAD_LAUNCHES = [
    (["--hosts", "a,,b"], "entry 2 ('') is not a host name"),
    (["--hosts", ""], "entry 1 ('') is not a host name"),
    (["--hosts", "a,b c"], "entry 2 ('b c') is not a host name"),
    (["--hosts", "user@a,b"], "entry 1 ('user@a') is not a host name"),
    (["--hosts", "a,b,a"], "names a more than once"),
    (["--hosts", "a,b", "--coordinator-port", "70000"], "--coordinator-port 70000 is not a TCP port"),
    (["--hosts", "a,b", "--coordinator-port", "x"], "invalid int value: 'x'"),
    (["--tpu", "pod", "--num-workers", "4"], "--tpu pod also needs --zone"),
    (["--tpu", "pod", "--zone", "z", "--num-workers", "0"], "--num-workers 0: a pod slice has at least 1 worker"),
    (["--tpu", "pod", "--zone", "z", "--num-workers", "4", "--coordinator-port", "1"],
     "--coordinator-port goes with --hosts"),
    (["--hosts", "a,b", "--zone", "z"], "go with --tpu"),
    (["--hosts", "a,b", "--tpu", "pod"], "not allowed with argument --hosts"),
    ([], "one of the arguments --hosts --tpu --jobset --xpk is required"),
]


@pytest.mark.parametrize("launch_args,hint", BAD_LAUNCHES, ids=[h for _, h in BAD_LAUNCHES])
def test_bad_launch_arguments_exit_2_with_one_line(launch_args, hint, capsys, tiny_config_path):
    assert main(["launch", *launch_args, "--dry-run", "--", "--config", tiny_config_path]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("grpo-run: error: ") and hint in err[0], err
    assert captured.out == ""


def test_tpu_launch_owns_only_the_process_count(capsys, tiny_config_path):
    assert main(["launch", "--tpu", "pod", "--zone", "z", "--num-workers", "2", "--dry-run", "--",
                 "--config", tiny_config_path, "mesh.distributed=on"]) == 0
    assert "mesh.distributed=on" in capsys.readouterr().out
    assert main(["launch", "--tpu", "pod", "--zone", "z", "--num-workers", "2", "--dry-run", "--",
                 "--config", tiny_config_path, "mesh.require_process_count=4"]) == 2
    assert "grpo-run launch sets mesh.require_process_count itself" in capsys.readouterr().err


@pytest.mark.parametrize("train_args,hint", [
    (None, "needs the training arguments after '--'"),
    (["--config", "{tiny}", "mesh.process_id=3"], "grpo-run launch sets mesh.distributed"),
    (["--config", "{tiny}", "train.stpes=3"], "did you mean train.steps?"),
    (["--config", "/nonexistent.yaml"], "'/nonexistent.yaml' not found"),
    (["--confg", "{tiny}"], "unrecognized arguments: --confg"),
])
def test_bad_training_arguments_fail_before_any_host_is_contacted(train_args, hint, tmp_path, capsys,
                                                                  tiny_config_path):
    marker = tmp_path / "contacted"
    fake_ssh = f"{sys.executable} -c 'open({str(marker)!r}, \"w\")'"
    tail = [] if train_args is None else ["--", *(arg.replace("{tiny}", tiny_config_path) for arg in train_args)]
    assert main(["launch", "--hosts", "a,b", "--ssh", fake_ssh, *tail]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and hint in err[0], err
    assert not marker.exists()


FAKE_SSH = textwrap.dedent("""
    import sys, time
    host, command = sys.argv[1], sys.argv[2]
    print("started", host, "process_id=" + command.split("mesh.process_id=")[1].split()[0], flush=True)
    if host == "bad":
        sys.exit(3)
    if host == "slow":
        time.sleep(600)
""")


def _launch_with_fake_ssh(tmp_path, hosts: str, config: str) -> int:
    script = tmp_path / "fake_ssh.py"
    script.write_text(FAKE_SSH)
    return main(["launch", "--hosts", hosts, "--ssh", f"{sys.executable} {script}", "--", "--config", config])


def test_run_prefixes_each_hosts_output_and_succeeds_when_all_do(tmp_path, capsys, tiny_config_path):
    assert _launch_with_fake_ssh(tmp_path, "h0,h1", tiny_config_path) == 0
    lines = set(capsys.readouterr().out.splitlines())
    assert lines == {"[h0] started h0 process_id=0", "[h1] started h1 process_id=1"}


def test_run_stops_the_other_hosts_when_one_fails(tmp_path, capsys, tiny_config_path):
    assert _launch_with_fake_ssh(tmp_path, "slow,bad", tiny_config_path) == 3
    out = capsys.readouterr().out.splitlines()
    assert "[bad] started bad process_id=1" in out
    assert "grpo-run launch: bad exited with code 3; stopping slow" in out
