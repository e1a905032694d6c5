"""`grpo-run` rejects bad configs and overrides with exit 2 and one line naming the key."""

import subprocess
import sys

import pytest
import yaml

from grpo_runner_gsm8k.cli import main

BAD_OVERRIDES = [
    (["loss.epsilon_hgih=0.3"], "loss.epsilon_hgih", "loss.epsilon_high"),
    (["train.stpes=3"], "train.stpes", "train.steps"),
    (["rolout.n=4"], "rolout", "rollout"),
    (["train.lr=fast"], "train.lr", "expected a finite number"),
    (["train.lr=-1"], "train.lr", "must be > 0.0"),
    (["train.steps=0"], "train.steps", "must be >= 1"),
    (["train.steps=2.5"], "train.steps", "expected an integer"),
    (["rollout.n=-4"], "rollout.n", "must be >= 1"),
    (["rollout.top_p=1.5"], "rollout.top_p", "<= 1.0"),
    (["rollout.temperature=0"], "rollout.temperature", "> 0.0"),
    (["loss.kl_estimator=k4"], "loss.kl_estimator", "one of 'k1', 'k2', 'k3'"),
    (["loss.aggregation=mean"], "loss.aggregation", "token_mean"),
    (["model.dtype=float16"], "model.dtype", "'bfloat16'"),
    (["mesh.rollout_style=legacy"], "mesh.rollout_style", "valid keys"),
    (["rollout.sharding=maxtest"], "rollout.sharding", "'maxtext'"),
    (["loss.impl=fusd"], "loss.impl", "fused"),
    (["task.name=gsm9k"], "task.name", "gsm8k"),
    (["rollout.n=1"], "rollout.n", "loss.scale_rewards"),
    (["task.rewards.correctness=high"], "task.rewards.correctness", "a finite number"),
    (["train.lr"], "train.lr", "section.key=value"),
    (["loss.beta=-0.1"], "loss.beta", ">= 0.0"),
    (["logging.wandb=yes"], "logging.wandb", "'offline'"),
    (["checkpoint.keep=0"], "checkpoint.keep", ">= 1"),
    (["train.micro_batch_size_per_device=-2"], "train.micro_batch_size_per_device", ">= 0"),
]


@pytest.mark.parametrize("overrides,key,hint", BAD_OVERRIDES, ids=[o[0][0] for o in BAD_OVERRIDES])
def test_bad_override_exits_2_naming_the_key(tiny_config_path, overrides, key, hint, capsys):
    assert main(["--config", tiny_config_path, "--print-config", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert key in err[0] and hint in err[0], err[0]


BAD_FILES = [
    ("model: [unclosed", "not valid YAML"),
    ("- a\n- b\n", "must hold a mapping"),
    ("train: 5\n", "train must be a mapping"),
    ("train:\n  lr: 1e-3\n  warmup: 10\n", "train.warmup"),
    ("eval:\n  every_step: 5\n", "eval.every_steps"),
]


@pytest.mark.parametrize("text,hint", BAD_FILES, ids=[h for _, h in BAD_FILES])
def test_bad_file_exits_2(text, hint, tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["--config", str(path), "--print-config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and hint in err[0], err


def test_missing_config_file_exits_2(capsys):
    assert main(["--config", "/nonexistent/x.yaml"]) == 2
    assert "/nonexistent/x.yaml" in capsys.readouterr().err


def test_console_script_prints_one_line_and_no_traceback(tiny_config_path):
    proc = subprocess.run([sys.executable, "-m", "grpo_runner_gsm8k.cli", "--config", tiny_config_path,
                           "loss.epsilon_hgih=0.3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("grpo-run: error: unknown config key loss.epsilon_hgih; "
                                   "did you mean loss.epsilon_high?")


def test_debug_shows_the_traceback(tiny_config_path, capsys):
    assert main(["--config", tiny_config_path, "--debug", "train.stpes=1"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_print_config_prints_resolved_yaml(tiny_config_path, capsys):
    assert main(["--config", tiny_config_path, "--print-config", "train.lr=1e-6"]) == 0
    out = capsys.readouterr().out
    assert "lr: 1.0e-06" in out and "epsilon_high: 0.2" in out
    resolved = yaml.safe_load(out)  # "null = same as X" settings shown as the run uses them
    assert resolved["train"]["moment_dtype"] == resolved["model"]["param_dtype"]
    assert resolved["loss"]["max_completion_length"] == resolved["rollout"]["max_new_tokens"]
    assert resolved["eval"]["max_new_tokens"] == resolved["rollout"]["max_new_tokens"]


def test_an_unknown_command_is_one_line_naming_the_closest(capsys):
    assert main(["exprot", "--run-dir", "r"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "unknown command 'exprot' (did you mean 'export'?)" in err and "plugins" in err


def test_plugins_lists_the_built_in_commands(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "command:" in out
    for name in ("export", "launch", "plugins", "report"):
        assert f"  {name} " in out


def test_plugins_lists_the_advantage_estimators_as_their_own_kind(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    section = out[out.index("advantage:\n"):].splitlines()[1:5]
    assert [line.split()[:2] for line in section] == [[name, "grpo-losses"] for name in
                                                      ("gdpo", "grpo", "reinforce_pp_baseline", "rloo")]
