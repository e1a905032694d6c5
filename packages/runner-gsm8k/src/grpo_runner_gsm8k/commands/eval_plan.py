"""What `grpo-run eval`'s flags and `eval.*` overrides decide (`EvalPlan`), checked before any
model is loaded: every flag and override takes effect or is refused in one line (see
`grpo_runner_gsm8k.commands.evaluate` for the rules), the tasks' test questions are read and
the output directory is checked."""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any, Optional


from grpo_core.config_io import apply_override, config_to_dict, config_to_yaml, load_config, plugin_options
from grpo_core.errors import UserError
from grpo_core.registry import default_registry

from grpo_runner_gsm8k.cli import ArgumentParser
from grpo_runner_gsm8k.assembly.eval_tasks import eval_tasks
from grpo_runner_gsm8k.evaluation.evaluate import (GradedTask, eval_ks)

# eval.* keys that mean nothing to a one-off eval: refused when given as overrides, with why
TRAINING_ONLY = {"every_steps": "it is training's eval period, and grpo-run eval evaluates once"}


def eval_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="grpo-run eval", description="Evaluate a model on one or more tasks' test sets, as papers report it.")
    parser.add_argument("--config", help="YAML run config (default: the embedded tiny CPU config); not with --run-dir")
    parser.add_argument("--run-dir", help="evaluate a checkpoint of this run (its saved config is the base)")
    parser.add_argument("--step", type=int, help="with --run-dir: the checkpoint step (default: the newest)")
    parser.add_argument("--model", help="an HF model directory (e.g. from grpo-run export): sets model.path")
    parser.add_argument("--tasks", help="comma-separated task names (default: eval.tasks, else task.name)")
    parser.add_argument("--limit", type=int,
                        help="evaluate only the first N questions of each task (the same as eval.num_questions=N)")
    parser.add_argument("--out", help="output directory (default: <logging.dir>/eval/<step-S | model>)")
    parser.add_argument("--fresh", action="store_true", help="discard earlier samples in the output directory")
    parser.add_argument("--stream", action="store_true",
                        help="stream questions through the decode slots (a finished row takes the next question) "
                             "instead of sampling chunk by chunk")
    parser.add_argument("--regrade", metavar="SAMPLES",
                        help="regrade a samples.jsonl with the task's grader and print its summary (no model)")
    parser.add_argument("--debug", action="store_true", help="also print the traceback of an error")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    return parser


@dataclasses.dataclass(frozen=True)
class EvalPlan:
    """What one `grpo-run eval` will do, resolved from its flags and overrides before any model
    is loaded; everything the eval does is read from here."""

    cfg: Any  # the RunConfig the model, the rollout and the grading are built from
    step: Optional[int]  # the checkpoint evaluated (None: the config's model)
    run_dir: Optional[str]
    tasks: dict  # task name -> options
    questions: Optional[int]  # the first N questions of each task; None: all
    out: Path
    label: str
    fresh: bool
    stream: bool
    ks: tuple

    def decisions(self) -> dict[str, Any]:
        """Everything that decides the eval's samples, grades and where they go."""
        run = {k: v for k, v in config_to_dict(self.cfg).items() if k != "eval"}
        eval_cfg = self.cfg.eval
        return {"run": run, "step": self.step, "run_dir": self.run_dir, "tasks": self.tasks,
                "questions": self.questions, "n": eval_cfg.n, "greedy": eval_cfg.greedy,
                "max_new_tokens": eval_cfg.max_new_tokens, "reward": eval_cfg.reward,
                "pass_threshold": eval_cfg.pass_threshold, "ks": self.ks, "out": str(self.out),
                "fresh": self.fresh, "stream": self.stream}


def eval_overrides(overrides: list[str]) -> dict[str, Any]:
    """The eval.* keys the command line sets (`eval.n=4` and `eval={n: 4}` alike), with their values."""
    tree: dict = {}
    for override in overrides:
        apply_override(tree, override)
    section = tree.get("eval", {})
    return section if isinstance(section, dict) else {}


def _refuse_training_only(given: dict[str, Any]) -> None:
    for key, why in TRAINING_ONLY.items():
        if key in given:
            raise UserError(f"eval.{key}={given[key]}: {why}; drop it (the eval runs once, now)")


def question_count(limit: Optional[int], given: dict[str, Any], cfg) -> Optional[int]:
    """The first N questions of each task: --limit or eval.num_questions on the command line (one
    setting); None (all of them) when neither is given: the config's eval.num_questions is
    training's per-eval sample, not the size of an evaluation."""
    if limit is not None and limit < 1:
        raise UserError(f"--limit {limit}: need at least 1 question per task")
    if "num_questions" not in given:
        return limit
    if limit is not None and limit != cfg.eval.num_questions:
        raise UserError(f"--limit {limit} and eval.num_questions={cfg.eval.num_questions} disagree; they are one "
                        "setting (the first N questions of each task): give one of them")
    return cfg.eval.num_questions


def _load_config(args: argparse.Namespace):
    """The run config (a checkpoint's, or --config) with the overrides; and the checkpoint step."""
    overrides = list(args.overrides) + ([f"model.path={args.model}"] if args.model else [])
    if args.run_dir is None:
        if args.step is not None:
            raise UserError("--step only applies to --run-dir; add --run-dir R")
        return load_config(args.config, overrides, registry=default_registry()), None
    _refuse_with_run_dir(args)
    from grpo_runner_gsm8k.operations.checkpoint import Resume
    from grpo_runner_gsm8k.commands.export import pick_step

    step = pick_step(Path(args.run_dir).expanduser(), args.step)
    saved = Resume.read(Path(args.run_dir).expanduser(), [step]).run_config
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as file:
        file.write(config_to_yaml(saved))
    try:
        cfg = load_config(file.name, [f"logging.dir={args.run_dir}", *overrides], registry=default_registry())
    finally:
        Path(file.name).unlink()
    return cfg, step


def _refuse_with_run_dir(args: argparse.Namespace) -> None:
    """--config and --model say which model and config to use, which --run-dir says already."""
    if args.config is not None:
        raise UserError(f"--config {args.config} with --run-dir: the run's saved config is the base of its eval; "
                        "drop --config and give what should differ as section.key=value overrides")
    if args.model is not None:
        raise UserError(f"--model {args.model} with --run-dir: the checkpoint's weights are what is evaluated; "
                        "drop --model, or drop --run-dir to evaluate that model directory")


def _check_sampling(cfg, stream: bool) -> None:
    if stream and cfg.rollout.multi_turn.enabled:
        raise UserError("--stream with rollout.multi_turn.enabled: a multi-turn run's eval rolls its rows out turn "
                        "by turn with its tools, which the streaming slots do not; drop --stream")
    if cfg.eval.greedy and cfg.eval.n > 1:
        raise UserError(f"eval.greedy is true with eval.n = {cfg.eval.n}: greedy samples are all the same; set "
                        "eval.greedy=false to sample n answers per question (or eval.n=1)")


def task_options(cfg, names: Optional[str]) -> dict[str, dict]:
    """Task name -> options of the tasks to evaluate: --tasks (options from eval.tasks or, for the
    training task, task.options), else eval.tasks, else the training task. Checked against the
    registry here, before any device work."""
    if names is None:
        options = dict(cfg.eval.tasks) or {cfg.task.name: cfg.task.options}
    else:
        wanted = [name.strip() for name in names.split(",") if name.strip()]
        if not wanted:
            raise UserError(f"--tasks {names!r} names no task; give comma-separated names (see grpo-run plugins)")
        options = {name: cfg.eval.tasks.get(name, cfg.task.options if name == cfg.task.name else {})
                   for name in wanted}
    registry = default_registry()
    for name, values in options.items():
        plugin_options(registry.get("task", name).options, values or {}, f"eval.tasks.{name}")
    return options


def _refuse_regrade_flags(args: argparse.Namespace) -> None:
    """Flags that choose what to sample or where to write mean nothing to a regrade of a file."""
    for flag, value in (("--limit", args.limit), ("--out", args.out), ("--fresh", args.fresh),
                        ("--stream", args.stream), ("--tasks", args.tasks)):
        if value not in (None, False):
            raise UserError(f"{flag} with --regrade: a regrade reads the whole samples file it is given and "
                            f"writes nothing; drop {flag}")


def plan_eval(args: argparse.Namespace) -> EvalPlan:
    """The eval the flags and overrides ask for, every one of them applied or refused (no model loaded)."""
    given = eval_overrides(args.overrides)
    _refuse_training_only(given)
    if args.regrade is not None:
        _refuse_regrade_flags(args)
    questions = question_count(args.limit, {}, None)  # --limit < 1 fails before the config is read
    cfg, step = _load_config(args)
    questions = question_count(args.limit, given, cfg)
    _check_sampling(cfg, args.stream)
    ks = tuple(eval_ks(cfg.eval))  # k outside 1..eval.n fails before any device work
    label = f"step-{step}" if step is not None else "model"
    out = Path(args.out).expanduser() if args.out else Path(cfg.logging.dir) / "eval" / label
    return EvalPlan(cfg, step, args.run_dir, task_options(cfg, args.tasks), questions, out.absolute(), label,
                    args.fresh, args.stream, ks)


def judged_by_reward(task) -> bool:
    """Whether a task is graded by eval.reward (it has no grader of its own)."""
    return not isinstance(task, GradedTask)


def check_grading(plan: EvalPlan, tasks: dict[str, Any], given: dict[str, Any]) -> None:
    """eval.reward and eval.pass_threshold judge the tasks without a grader of their own: set when
    there are none, they are refused; with some, eval.reward must be one of task.rewards."""
    judged = [name for name, task in tasks.items() if judged_by_reward(task)]
    cfg = plan.cfg
    for key in ("reward", "pass_threshold"):
        if key in given and not judged:
            raise UserError(f"eval.{key}={given[key]}: every task evaluated ({', '.join(tasks)}) grades with its "
                            f"own grader, which eval.{key} does not change; drop it")
    if judged and cfg.eval.reward not in cfg.task.rewards:
        raise UserError(f"eval.reward = {cfg.eval.reward!r} is not one of task.rewards "
                        f"({', '.join(cfg.task.rewards)}), and it judges {', '.join(judged)}; set eval.reward to one "
                        "of them, or add it to task.rewards")


def check_out_dir(path: Path) -> None:
    """Fails when `path` cannot be created and written as a directory (before any model is loaded)."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        where = "it" if existing == path else str(existing)
        raise UserError(f"eval output directory {path} cannot be made: {where} is a file, not a directory; give "
                        "another directory with --out")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"eval output directory {path} is not writable (no write permission on {existing}); give "
                        "a writable directory with --out")


def task_questions(plan: EvalPlan) -> dict[str, tuple[Any, list]]:
    """Each task, built whole on every process (all processes pass the same questions to the
    rollout), with its test questions read: a task whose data cannot be read fails here."""
    tasks = eval_tasks(plan.tasks, default_registry(), plan.cfg.task.seed)
    out = {}
    for name, task in tasks.items():
        examples = task.test_examples(plan.questions)
        if not examples:
            raise UserError(f"task {name} has no test questions; check its data (task options)")
        out[name] = (task, examples)
    return out
