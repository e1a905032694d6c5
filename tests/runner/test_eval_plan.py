"""Every `eval.*` override and every flag of `grpo-run eval` either changes what the eval does
(its `EvalPlan`, the one place the eval reads its settings from) or is refused in one line.
The walk covers every key of EvalConfig and every flag of the parser: a new one fails here
until it is given a case. No model is loaded: the plan is resolved from the config alone."""

import dataclasses
from types import SimpleNamespace

import pytest
import yaml

from grpo_core.config import EvalConfig
from grpo_core.config_io import load_config
from grpo_core.errors import UserError
from grpo_runner_gsm8k.cli import main
from grpo_runner_gsm8k.commands import eval_plan

BASE = ("eval.greedy=false", "eval.n=4")

# eval key -> (overrides both sides share, the override under test); None: refused
KEY_CASES = {
    "every_steps": None,
    "num_questions": ((), "eval.num_questions=16"),
    "greedy": (("eval.n=1",), "eval.greedy=true"),
    "n": ((), "eval.n=2"),
    "max_new_tokens": ((), "eval.max_new_tokens=8"),
    "reward": (("task.rewards={correctness: 1.0, format: 0.0}",), "eval.reward=format"),
    "pass_threshold": ((), "eval.pass_threshold=0.5"),
    "tasks": ((), "eval.tasks={countdown: {}}"),
    "k": ((), "eval.k=[1, 3]"),
}


def _plan(tiny_config_path, tmp_path, *args: str, config: str | None = None):
    argv = ["--config", config or tiny_config_path, f"logging.dir={tmp_path / 'run'}", *BASE, *args]
    if "--run-dir" in args:
        argv = [a for a in argv[2:] if not a.startswith("logging.dir=")]
    return eval_plan.plan_eval(eval_plan.eval_parser().parse_intermixed_args(argv))


def test_the_walk_covers_every_eval_key():
    assert set(KEY_CASES) == {f.name for f in dataclasses.fields(EvalConfig)}


@pytest.mark.parametrize("key", sorted(KEY_CASES))
def test_every_eval_override_changes_the_plan_or_is_refused(tiny_config_path, tmp_path, key):
    case = KEY_CASES[key]
    if case is None:
        with pytest.raises(UserError, match=rf"eval\.{key}=5: .*drop it"):
            _plan(tiny_config_path, tmp_path, f"eval.{key}=5")
        return
    shared, override = case
    base = _plan(tiny_config_path, tmp_path, *shared).decisions()
    changed = _plan(tiny_config_path, tmp_path, *shared, override).decisions()
    assert {k for k in base if base[k] != changed[k]}, f"{override} changed nothing the eval does"


def test_a_refused_key_is_refused_in_a_section_mapping_too(tiny_config_path, tmp_path):
    with pytest.raises(UserError, match=r"eval\.every_steps=5: "):
        _plan(tiny_config_path, tmp_path, "eval={every_steps: 5, n: 2}")


def test_limit_and_num_questions_are_one_setting(tiny_config_path, tmp_path):
    by_limit = _plan(tiny_config_path, tmp_path, "--limit", "16")
    by_key = _plan(tiny_config_path, tmp_path, "eval.num_questions=16")
    assert by_limit.questions == by_key.questions == 16 and by_limit.decisions() == by_key.decisions()
    assert _plan(tiny_config_path, tmp_path).questions is None  # the config's 64 is training's, not the eval's
    assert _plan(tiny_config_path, tmp_path, "--limit", "16", "eval.num_questions=16").questions == 16
    with pytest.raises(UserError, match=r"--limit 8 and eval.num_questions=16 disagree"):
        _plan(tiny_config_path, tmp_path, "--limit", "8", "eval.num_questions=16")


@pytest.fixture
def fake_run_dir(monkeypatch, tiny_config_path, tmp_path):
    """A run directory whose checkpoints are steps 2 and 3, saved with the tiny config (no orbax)."""
    saved = load_config(tiny_config_path)
    monkeypatch.setattr("grpo_runner_gsm8k.commands.export.pick_step", lambda run_dir, step=None: step or 3)
    monkeypatch.setattr("grpo_runner_gsm8k.operations.checkpoint.Resume.read",
                        lambda run_dir, steps: SimpleNamespace(run_config=saved))
    (tmp_path / "saved").mkdir()
    return str(tmp_path / "saved")


def _other_config(tiny_config_path, tmp_path) -> str:
    tree = yaml.safe_load(open(tiny_config_path))
    tree["rollout"]["temperature"] = 0.5
    path = tmp_path / "other.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


# flag -> (arguments both sides share, the arguments under test); a str: the refusal's text
FLAG_CASES = {
    "--config": None,  # a config file of its own below
    "--run-dir": ((), ("--run-dir", "{run}")),
    "--step": (("--run-dir", "{run}"), ("--step", "2")),
    "--model": ((), ("--model", "{tmp}")),
    "--tasks": ((), ("--tasks", "countdown")),
    "--limit": ((), ("--limit", "8")),
    "--out": ((), ("--out", "{tmp}/elsewhere")),
    "--fresh": ((), ("--fresh",)),
    "--stream": ((), ("--stream",)),
    "--regrade": None,  # regrades without a model: tests/e2e/test_eval_command.py; refusals below
    "--debug": None,  # prints the traceback of an error: below
}
REFUSED = [
    (("--run-dir", "{run}", "--config", "{config}"), "--config {config} with --run-dir: the run's saved config"),
    (("--run-dir", "{run}", "--model", "{tmp}"), "with --run-dir: the checkpoint's weights are what is evaluated"),
    (("--step", "2"), "--step only applies to --run-dir"),
    (("--limit", "0"), "--limit 0: need at least 1 question"),
    *[(("--regrade", "s.jsonl", *flag), f"{flag[0]} with --regrade") for flag in
      (("--limit", "2"), ("--out", "o"), ("--fresh",), ("--stream",), ("--tasks", "countdown"))],
]


def test_the_walk_covers_every_flag():
    flags = {o for a in eval_plan.eval_parser()._actions for o in a.option_strings if o not in ("-h", "--help")}
    assert set(FLAG_CASES) == flags


def _filled(args, **values) -> list[str]:
    return [a.format(**values) for a in args]


@pytest.mark.parametrize("flag", sorted(f for f, case in FLAG_CASES.items() if case is not None))
def test_every_flag_changes_the_plan(tiny_config_path, tmp_path, fake_run_dir, flag):
    shared, tested = (_filled(args, run=fake_run_dir, tmp=tmp_path) for args in FLAG_CASES[flag])
    base = _plan(tiny_config_path, tmp_path, *shared).decisions()
    changed = _plan(tiny_config_path, tmp_path, *shared, *tested).decisions()
    assert {k for k in base if base[k] != changed[k]}, f"{flag} changed nothing the eval does"


def test_another_config_changes_the_plan(tiny_config_path, tmp_path):
    other = _plan(tiny_config_path, tmp_path, config=_other_config(tiny_config_path, tmp_path)).decisions()
    assert other["run"] != _plan(tiny_config_path, tmp_path).decisions()["run"]


@pytest.mark.parametrize("args,text", REFUSED)
def test_flags_that_cannot_apply_are_refused(tiny_config_path, tmp_path, fake_run_dir, args, text):
    values = dict(run=fake_run_dir, tmp=tmp_path, config=_other_config(tiny_config_path, tmp_path))
    with pytest.raises(UserError, match=None) as refused:
        _plan(tiny_config_path, tmp_path, *_filled(args, **values))
    assert text.format(**values) in str(refused.value)


def test_debug_prints_the_traceback_of_an_error(tiny_config_path, capsys):
    assert main(["eval", "--config", tiny_config_path, "--tasks", "nope"]) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert main(["eval", "--debug", "--config", tiny_config_path, "--tasks", "nope"]) == 2
    assert "Traceback" in capsys.readouterr().err
