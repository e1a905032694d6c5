"""Every plugin example in examples/hooks/, run as written: short training runs of the tiny
config with the examples selected (those of kinds that do not overlap in one run)."""

import ast
import json
import math
import re
import types
from typing import Callable

import pytest

from grpo_core import hookspecs
from grpo_core.testing import registry_with

EXAMPLES = {"grpo_losses": "loss", "grpo_meshes": "mesh", "grpo_rollouts": "rollout", "grpo_rewards": "reward",
            "grpo_tasks": "task", "grpo_advantages": "advantage", "grpo_commands": "command",
            "grpo_step_end": "step_end", "grpo_tools": "tool", "grpo_environments": "environment",
            "grpo_model_families": "model_family", "grpo_graders": "grader"}
SELECT = {
    "grpo_losses": ["loss.impl=naive"],
    "grpo_meshes": ["mesh.strategy=data_only"],
    "grpo_rollouts": ["rollout.backend=uniform"],
    "grpo_rewards": ["task.rewards={short: 1.0}", "eval.reward=short"],
    "grpo_tasks": ["task.name=echo", "task.options={size: 40}"],
    "grpo_advantages": ["loss.advantage_estimator=group_rank", "loss.advantage_options={scale: 2.0}"],
    "grpo_commands": [],  # a command is selected on the command line: checked after the step
    "grpo_step_end": [],  # every step-end hook runs
    # a multi-turn run offering the tool (the character tokenizer with Qwen's tool tokens)
    "grpo_tools": ["rollout.multi_turn.enabled=true", "rollout.multi_turn.tools=[letter_count]",
                   "model.tokenizer=char-tools", "task.options={digits: 1, operations: '+', use_chat_template: true}",
                   "rollout.max_prompt_length=40", "rollout.max_new_tokens=8", "rollout.multi_turn.max_turns=2",
                   "rollout.multi_turn.max_total_tokens=16"],
    # a multi-turn run whose rows each play the environment, rewarded by its reward information
    "grpo_environments": ["rollout.multi_turn.enabled=true", "rollout.multi_turn.environment=guess_number",
                          "rollout.multi_turn.environment_options={max_guesses: 2}", "model.tokenizer=char-tools",
                          "task.options={digits: 1, operations: '+', use_chat_template: true}",
                          "task.rewards={correctness: 1.0, environment: 1.0}",
                          "task.reward_options={environment: {key: solved}}", "rollout.max_prompt_length=80",
                          "rollout.max_new_tokens=8", "rollout.multi_turn.max_total_tokens=48",
                          "model.architecture.max_position_embeddings=160"],
    "grpo_model_families": ["model.architecture.model_type=biased_decoder"],
    # the dataset task over sums written to {grader_data}, graded in eval by the example grader
    "grpo_graders": ["task.name=dataset", "task.options={path: {grader_data}, prompt: '{q}', answer_field: a, "
                     "grader: near, grader_options: {tolerance: 1}, use_chat_template: false}"],
}


@pytest.fixture(scope="session")
def example_source(repo_root) -> Callable[[str], str]:
    """`example_source(hook)`: the example plugin module of `hook`, as a user would copy it."""
    return lambda hook: (repo_root / "examples" / "hooks" / f"{EXAMPLES[hook]}.py").read_text()


@pytest.fixture(scope="session")
def example_module(example_source) -> Callable[[str], types.ModuleType]:
    """`example_module(hook)`: a fresh module of the example of `hook`, executed as written."""
    def load(hook: str) -> types.ModuleType:
        module = types.ModuleType(f"example_{hook}")
        exec(compile(example_source(hook), module.__name__, "exec"), module.__dict__)
        return module

    return load


@pytest.fixture(scope="session")
def evaluated_run(small_run) -> Callable[..., list[str]]:
    """`evaluated_run(steps=1)`: a small run evaluated at its end; the entropy bonus gives it a gradient
    whatever the rewards (a step of the tiny model usually scores every sample alike, which leaves zero
    advantages)."""
    return lambda steps=1: [*small_run(steps, eval_every=steps), "eval.num_questions=8", "loss.entropy_coef=0.01"]


def imported_packages(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module.split(".")[0])
    return names


def test_every_hook_has_an_example_selected_and_trained_here():
    hooks = {name for name, fn in vars(hookspecs).items() if name.startswith("grpo_") and callable(fn)}
    trained = [hook for run in RUNS.values() for hook in run]
    assert hooks == set(SELECT) == set(EXAMPLES) == set(trained) and len(trained) == len(hooks)


@pytest.fixture(scope="session")
def grader_data(tmp_path_factory) -> str:
    """A JSONL file of one-digit sums (q, a) for the `dataset` task of the grader example."""
    path = tmp_path_factory.mktemp("grader") / "sums.jsonl"
    path.write_text("".join(json.dumps({"q": f"{i}+{j}=", "a": str(i + j)}) + "\n" for i in range(5) for j in range(5)))
    return str(path)


# The examples train in five runs: those of one run select different kinds and none changes what
# another checks; a task, a grader, a tool and an environment each need a task or rollout of their own.
RUNS = {
    "step_kinds": ("grpo_losses", "grpo_meshes", "grpo_rollouts", "grpo_rewards", "grpo_advantages", "grpo_commands",
                   "grpo_step_end", "grpo_model_families"),
    "task": ("grpo_tasks",), "grader": ("grpo_graders",), "tool": ("grpo_tools",),
    "environment": ("grpo_environments",),
}
# The environment's rows are carried across steps (partial rollouts in rounds of 3 tokens; a row budget
# that the longer hints do not fit, so rows end at different rounds): three steps.
CARRIED = ("rollout.partial.enabled=true", "rollout.partial.budget=3", "loss.mismatch_correction=truncate",
           "rollout.multi_turn.max_total_tokens=41")
RUN_SETTINGS = {"environment": (3, CARRIED)}


@pytest.mark.parametrize("run", sorted(RUNS))
def test_examples_train(run, tiny_config, example_module, evaluated_run, grader_data):
    """A short run with the examples of `run` selected (each selected as its docstring says): the step
    trains, eval scores, and each example's own check holds."""
    from grpo_runner_gsm8k.loop import Trainer, build_run

    hooks = RUNS[run]
    steps, extra = RUN_SETTINGS.get(run, (1, ()))
    registry = registry_with(*(example_module(hook) for hook in hooks))
    selected = [override.replace("{grader_data}", grader_data) for hook in hooks for override in SELECT[hook]]
    cfg = tiny_config(*evaluated_run(steps), *selected, *extra, registry=registry)
    trainer = Trainer(build_run(cfg, registry))
    metrics = trainer.run()
    assert trainer.state.step == steps
    assert math.isfinite(metrics["train-other/loss"]) and math.isfinite(metrics["train-other/grad_norm"])
    assert metrics["train-other/update_ratio"] > 0, "the step did not change the params"
    assert 0.0 <= metrics["eval/accuracy"] <= 1.0
    for hook in hooks:
        CHECK_AFTER_STEP.get(hook, lambda *_: None)(trainer, registry, metrics)


def step_end_logged(trainer, registry, metrics) -> None:
    rows = (trainer.run_dir / "rewards.tsv").read_text().splitlines()
    assert [row.split("\t") for row in rows] == [
        ["1", f"{metrics['train-reward/total/mean']:.6g}", f"{metrics['train-other/loss']:.6g}"]]


def command_runs(trainer, registry, metrics, capsys=None) -> None:
    import io
    import json
    from contextlib import redirect_stdout

    from grpo_core.errors import UserError

    out = io.StringIO()
    with redirect_stdout(out):
        assert registry.command("last-step").factory([str(trainer.run_dir)]) == 0
    assert json.loads(out.getvalue())["step"] == 1
    with pytest.raises(UserError, match="does not exist; give the logging.dir of a run"):
        registry.command("last-step").factory([str(trainer.run_dir / "missing")])


def environment_rewarded_and_carried(trainer, registry, metrics) -> None:
    """Every row's reward read its environment's information (a row without one would raise), and rows
    are carried across steps with their environments: the carried pool is JSON and, restored (each
    episode rebuilt through `SavedEnvironment.restore`), saves the same JSON again. (Rows carried
    mid-episode, scripted: tests/runner/test_multi_turn_partial.py.)"""
    assert metrics["train-reward/func/environment/errors"] == 0 and metrics["train-rollout/groups"] == 4
    assert metrics["train-tools/turns_mean"] >= 1
    saved = json.loads(json.dumps(trainer.sampler.state()))
    carried = [row for group in saved["groups"].values() for row in group["rows"] if row["open_ids"]]
    assert carried and all("secret" in row["environment"]["episode"] for row in carried), saved
    trainer.sampler.restore(saved)
    assert trainer.sampler.state() == saved


def family_trained(trainer, registry, metrics) -> None:
    """The policy trained is the example family's: its config.json and its q/k/v biases."""
    import jax

    assert trainer.built.qcfg.to_hf_dict()["architectures"] == ["BiasedDecoderForCausalLM"]
    paths = {jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(trainer.state.params)}
    assert any("q_proj" in p and "bias" in p for p in paths), sorted(paths)[:5]


def graded_by_the_example(trainer, registry, metrics) -> None:
    """The dataset task grades with the example grader and its options (tolerance 1)."""
    task = trainer.built.inputs.task
    assert [task.grade(c, "8").correct for c in ("7", "9", "6", "no number")] == [True, True, False, False]
    assert task.grade("x=6.0", "8").answer == "6.0"


CHECK_AFTER_STEP = {"grpo_step_end": step_end_logged, "grpo_commands": command_runs,
                    "grpo_graders": graded_by_the_example,
                    "grpo_environments": environment_rewarded_and_carried, "grpo_model_families": family_trained}


@pytest.mark.parametrize("hook", sorted(EXAMPLES))
def test_example_needs_grpo_core_alone(hook, example_source):
    """A plugin package of any kind depends on grpo-core only: no example imports another project package."""
    source = example_source(hook)
    assert {name for name in imported_packages(source) if name.startswith("grpo")} == {"grpo_core"}


def test_hookspecs_keep_one_line_docs():
    for hook in EXAMPLES:
        assert len(getattr(hookspecs, hook).__doc__.strip().splitlines()) == 1, hook


def test_a_backend_missing_a_protocol_method_is_refused_at_build(uniform_backend_run, example_module):
    from grpo_core.errors import UserError
    from grpo_runner_gsm8k.loop import Trainer, build_run

    module = example_module("grpo_rollouts")
    del module.UniformSampler.release_weights
    with pytest.raises(UserError, match="without release_weights, which grpo_core.contracts.RolloutBackend"):
        Trainer(build_run(*uniform_backend_run(module)))


@pytest.fixture
def uniform_backend_run(tiny_config, evaluated_run):
    """`uniform_backend_run(module)`: (config, registry) of one step of the tiny run with the
    rollout example of `module`."""
    def build(module):
        registry = registry_with(module)
        return tiny_config(*evaluated_run(), *SELECT["grpo_rollouts"], registry=registry), registry

    return build


def test_the_rollout_example_is_planned_through_its_contract(uniform_backend_run, example_module, capsys):
    """`grpo-run --plan` compiles a third-party backend's own phases (PlannableRollout)."""
    from grpo_runner_gsm8k.plan import plan_command

    assert plan_command(*uniform_backend_run(example_module("grpo_rollouts")), capacity_gib=16.0) == 0
    out = capsys.readouterr().out
    assert re.search(r"^rollout sample +[\d.]+ ", out, re.M) and re.search(r"^train step +[\d.]+ ", out, re.M)


def test_a_backend_without_the_planning_members_is_refused_by_the_plan(uniform_backend_run, example_module):
    from grpo_core.errors import UserError
    from grpo_runner_gsm8k.plan import plan_command

    module = example_module("grpo_rollouts")
    del module.UniformSampler.compile_phases
    with pytest.raises(UserError, match="cannot be planned: .*grpo_core.contracts.PlannableRollout"):
        plan_command(*uniform_backend_run(module), capacity_gib=16.0)


def test_the_tool_example_answers_a_qwen_format_call(example_module):
    from grpo_core.contracts import Tool
    from grpo_core.tool_calls import ToolRunner, parse_tool_calls

    spec = registry_with(example_module("grpo_tools"), entry_points=False).tool("letter_count")
    tool = spec.factory(spec.options())
    assert isinstance(tool, Tool)
    runner = ToolRunner([tool])
    text = ('<tool_call>\n{"name": "letter_count", "arguments": {"word": "Strawberry", "letter": "r"}}\n</tool_call>'
            '<tool_call>\n{"name": "letter_count", "arguments": {"word": "x", "letter": "ab"}}\n</tool_call>')
    first, second = runner.run(parse_tool_calls(text))
    runner.close()
    assert (first.status, first.response) == ("ok", "3")
    assert second.status == "error" and "letter must be one character, got 'ab'" in second.response


def test_the_environment_example_plays_an_episode(example_module):
    from grpo_core.contracts import Environment, Example

    spec = registry_with(example_module("grpo_environments"), entry_points=False).environment("guess_number")
    environment = spec.factory(spec.options(max_guesses=3))
    assert isinstance(environment, Environment)
    opening = environment.reset(Example("Think of 7.", "7", id="guess/0"))
    assert opening[0]["role"] == "user" and not environment.done
    assert environment.step("I guess 3").messages == ({"role": "user", "content": "Higher."},)
    final = environment.step("<think>higher than 3</think> then 7")
    assert final.done and environment.done and environment.reward_info() == {"solved": 1.0, "guesses": 2.0}
    other = spec.factory(spec.options(max_guesses=1))  # one per row: no shared state
    other.reset(Example("Think of 5.", "5"))
    assert other.step("4").done and other.reward_info()["solved"] == 0.0 and environment.reward_info()["solved"] == 1.0


def test_the_advantage_example_ranks_each_group(example_module):
    import numpy as np
    from grpo_core.advantage_records import AdvantageSetup, StepRewards

    module = example_module("grpo_advantages")
    estimator = module.GroupRank(module.Options(), setup=AdvantageSetup(4, {"correctness": 1.0}))
    total = np.array([3, 1, 2, 2, 5, 5, 5, 5], np.float32)  # ranks 3, 0, 1.5, 1.5; a group that agrees
    out = estimator(StepRewards(total, {"correctness": total}, np.ones(8, np.float32)))
    np.testing.assert_array_equal(out.advantages, [1, -1, 0, 0, 0, 0, 0, 0])
    assert out.metrics == {"train-other/adv_rank_abs_mean": 0.25}
