"""`grpo-run eval`: evaluate a model on one or more tasks' test sets, as papers report it.

    grpo-run eval --config X.yaml [overrides]          the base model of the config (model.path)
    grpo-run eval --model DIR --config X.yaml          an exported (or any HF) model directory
    grpo-run eval --run-dir R [--step S] [overrides]   a run's checkpoint, with the run's config
    grpo-run eval ... --regrade OUT/TASK/samples.jsonl  regrade a samples file (no model loaded)

Tasks are `--tasks a,b`, else `eval.tasks`, else the config's training task. Each question
gets `eval.n` samples from the run's rollout backend on its mesh (`eval.greedy: true` is
one greedy sample); every sample goes to `<out>/<task>/samples.jsonl` and the metrics to
`summary.json`, where `<out>` defaults to `<run dir>/eval/<step-S | model>`. A re-run with
the same settings continues where an interrupted one stopped.

Every flag and `eval.*` override takes effect or is refused in one line (`EvalPlan` is what
they decide): `--limit N` and `eval.num_questions=N` are one setting (the first N questions
of each task; neither: all of them); `eval.every_steps` (training's eval period) is refused;
`--config` and `--model` with `--run-dir` are refused (the run's saved config and its
checkpoint's weights are what is evaluated; change them with overrides). Tasks, their test
questions and the output directory are checked before any model is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import jax

from grpo_core.config_io import apply_override, config_to_dict, config_to_yaml, load_config, plugin_options
from grpo_core.errors import UserError
from grpo_core.registry import default_registry

from grpo_runner_gsm8k.cli import ArgumentParser
from grpo_runner_gsm8k.cli import _remember_run as remember_run
from grpo_runner_gsm8k.evaluation.store import SampleStore, read_state
from grpo_runner_gsm8k.assembly.eval_tasks import eval_tasks
from grpo_runner_gsm8k.evaluation.evaluate import (GradedTask, Sample, eval_ks, question_fields, question_multiple,
                                                   sample_questions, samples_metrics)
from grpo_runner_gsm8k.evaluation.multi_turn import MultiTurnEval
from grpo_runner_gsm8k.commands.regrade import regrade_file

EVAL_STREAM = 0x45564C  # the eval key's stream, as training's (loop.EVAL_STREAM)
# eval.* keys that mean nothing to a one-off eval: refused when given as overrides, with why
TRAINING_ONLY = {"every_steps": "it is training's eval period, and grpo-run eval evaluates once"}


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="grpo-run eval", description=__doc__.split("\n\n")[0])
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


def _checkpoint_params(run_dir: str, step: int, target: Any) -> Any:
    """Checkpoint `step`'s params as training restores them; an unreadable one (a truncated or
    partly deleted file) is one line naming it, its cause and what to do."""
    from grpo_runner_gsm8k.operations.checkpoint import Resume, cause_of, check_param_layout, complete_steps

    resume = Resume.read(Path(run_dir).expanduser(), [step])
    check_param_layout(resume.meta, resume.where)  # an old layout has its own message
    try:
        return resume.params(target)
    except Exception as exc:  # noqa: BLE001 - orbax and TensorStore wrap a bad file in many types
        earlier = [s for s in complete_steps(resume.run_dir) if s < step]
        advice = (f"pass --step {earlier[-1]} to evaluate the checkpoint before it (or delete {resume.where} to make "
                  "that the newest)" if earlier else "it is the run's only checkpoint; train again to evaluate one")
        raise UserError(f"checkpoint {resume.where} is unreadable ({cause_of(exc)}); {advice}") from None


def _weights(built, step: Optional[int], run_dir: Optional[str]):
    """The policy's weights in the compute dtype: the checkpoint's, or the loaded model's."""
    params = built.state.params
    if step is not None:
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
        params = _checkpoint_params(run_dir, step, target)
    return built.policy.forward_params(params)


def chunk_size(built) -> int:
    """Questions per rollout: rollout.prompts_per_step, rounded up to a size the mesh splits evenly."""
    step = question_multiple(built, built.eval_sampling.n)
    return -(-built.cfg.rollout.prompts_per_step // step) * step


class Progress:
    """One stderr line per chunk: questions done, questions/s, ETA."""

    def __init__(self, task: str, total: int, done: int):
        self.task, self.total, self.start_done, self.start = task, total, done, time.monotonic()

    def update(self, done: int) -> None:
        rate = (done - self.start_done) / max(time.monotonic() - self.start, 1e-9)
        eta = (self.total - done) / rate if rate > 0 else float("inf")
        print(f"eval {self.task}: {done}/{self.total} questions, {rate:.2f} questions/s, ETA {_duration(eta)}",
              file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


@dataclasses.dataclass
class EvalJob:
    """One model's evaluation: the built run, its weights, where results go."""

    built: Any
    weights: Any
    out: Path
    label: str
    fresh: bool = False
    stream: bool = False
    turns: Any = None  # a multi-turn run's eval rollout (grpo_runner_gsm8k.evaluation.multi_turn)

    @property
    def writes(self) -> bool:
        return self.built.layout.process_index == 0  # the processes of one run share the directory

    def settings(self, task_name: str, task: Any = None, options: Optional[dict] = None) -> dict[str, Any]:
        """What the samples are drawn and graded with: a re-run with other settings is refused."""
        sampling = self.built.eval_sampling
        return {"task": task_name, "model": self.label, "n": sampling.n, "greedy": sampling.greedy,
                "temperature": self.built.cfg.rollout.temperature, "max_new_tokens": sampling.max_new_tokens,
                "seed": self.built.cfg.train.seed, **self.turn_settings(), **grading_settings(self.built.cfg, task),
                **({} if options is None else {"options": dict(options)})}

    def turn_settings(self) -> dict[str, Any]:
        """A multi-turn eval's tools and limits (none for a single-turn run: its settings stay as they were)."""
        if self.turns is None:
            return {}
        multi = self.built.cfg.rollout.multi_turn
        return {"tools": list(multi.tools), "environment": multi.environment, "max_turns": multi.max_turns,
                "max_total_tokens": self.turns.turns.budget}

    def key(self, task_index: int, first_question: int):
        """A key per (task, chunk start): an interrupted eval re-draws exactly what it lost."""
        base = jax.random.fold_in(jax.random.key(self.built.cfg.train.seed), EVAL_STREAM)
        return jax.random.fold_in(jax.random.fold_in(base, task_index), first_question)


def grading_settings(cfg, task: Any) -> dict[str, Any]:
    """How a task's verdicts are reached, when eval.reward judges them (a task with its own grader: nothing)."""
    if task is None or not judged_by_reward(task):
        return {}
    options = {name: cfg.task.reward_options.get(name, {}) for name in sorted({cfg.eval.reward, "correctness"})}
    return {"judge": {"reward": cfg.eval.reward, "pass_threshold": cfg.eval.pass_threshold, "options": options}}


def _sample_chunks(job: EvalJob, task_index: int, task, examples: list, store: SampleStore,
                   progress: Progress) -> dict[str, list[dict]]:
    """Samples every question not already in the store, chunk by chunk (each chunk padded to
    the same size with its last question, so the rollout compiles once)."""
    n, size = job.built.eval_sampling.n, chunk_size(job.built)
    records = store.done(n)
    for start in range(0, len(examples), size):
        chunk = examples[start:start + size]
        if all(ex.id in records for ex in chunk):
            continue
        padded = chunk + [chunk[-1]] * (size - len(chunk))
        samples = sample_questions(job.built, job.weights, task, padded, job.key(task_index, start),
                                   job.built.eval_sampling, job.turns)[:len(chunk)]
        fresh = store.append(chunk, samples, question_fields(task, chunk))
        records.update({ex.id: question for ex, question in zip(chunk, fresh)})
        progress.update(sum(ex.id in records for ex in examples))
    return records


def _stream(job: EvalJob, task_index: int, task, examples: list, store: SampleStore,
            progress: Progress) -> dict[str, list[dict]]:
    """Samples every question not already in the store through streaming decode slots."""
    from grpo_runner_gsm8k.evaluation.stream import stream_questions

    records = store.done(job.built.eval_sampling.n)
    remaining = [ex for ex in examples if ex.id not in records]

    def write(positions: list[int], samples) -> None:
        done = [remaining[p] for p in positions]
        records.update({ex.id: q for ex, q in zip(done, store.append(done, samples, question_fields(task, done)))})
        progress.update(len(records))

    if remaining:
        stream_questions(job.built, job.weights, task, remaining, job.key(task_index, len(examples) - len(remaining)),
                         job.built.eval_sampling, chunk_size(job.built), write)
    return records


def record_sample(record: dict) -> Sample:
    """A samples.jsonl record as the graded sample it was written from."""
    return Sample(record["completion"], record["answer"], record["correct"], record.get("tools"))


def evaluate_task(job: EvalJob, task_index: int, name: str, task, limit: Optional[int] = None,
                  examples: Optional[list] = None, options: Optional[dict] = None) -> dict[str, Any]:
    """Samples, grades and summarises one task (its first `limit` questions, or `examples` when
    given); returns its summary (also in summary.json)."""
    examples = task.test_examples(limit) if examples is None else examples
    if not examples:
        raise UserError(f"task {name} has no test questions; check its data (task options)")
    store = SampleStore(job.out / name, job.settings(name, task, options), writes=job.writes, fresh=job.fresh)
    progress = Progress(name, len(examples), len(store.done(job.built.eval_sampling.n)))
    started = time.monotonic()
    sample = _stream if job.stream else _sample_chunks
    records = sample(job, task_index, task, examples, store, progress)
    samples = [[record_sample(r) for r in records[ex.id]] for ex in examples]
    summary = samples_metrics(samples, question_fields(task, examples), job.built.eval_sampling.greedy,
                              eval_ks(job.built.cfg.eval))
    summary.update(task=name, model=job.label, n=job.built.eval_sampling.n, greedy=job.built.eval_sampling.greedy,
                   seconds=round(time.monotonic() - started, 3))
    store.write_summary(summary)
    return summary


def summary_table(summaries: dict[str, dict[str, Any]]) -> str:
    """The metrics of each task as a Markdown table (breakdowns are in summary.json)."""
    columns = [k for k in next(iter(summaries.values())) if k.split("@")[0] in ("mean", "pass", "maj")
               or k in ("greedy_accuracy", "questions")]
    lines = ["| task | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, summary in summaries.items():
        cells = [f"{summary.get(c):.3f}" if isinstance(summary.get(c), float) else str(summary.get(c, ""))
                 for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def prepare(plan: EvalPlan, given: dict[str, Any]) -> dict[str, tuple[Any, list]]:
    """Every check that needs no model: the tasks built and their questions read, the grading
    settings, the output directory. Returns task name -> (task, test questions)."""
    tasks = task_questions(plan)
    check_grading(plan, {name: task for name, (task, _) in tasks.items()}, given)
    check_out_dir(plan.out)
    for name in tasks:
        check_out_dir(plan.out / name)
        for state in ("settings.json", "summary.json"):  # a corrupt one fails now, not after sampling
            if not plan.fresh and (plan.out / name / state).is_file():
                read_state(plan.out / name / state)
    return tasks


def _job(plan: EvalPlan, tasks: dict[str, tuple[Any, list]]) -> EvalJob:
    from grpo_runner_gsm8k.assembly.run import build_run

    built = build_run(plan.cfg, default_registry(), training=False)
    turns = MultiTurnEval(built, built.registry) if plan.cfg.rollout.multi_turn.enabled else None
    for task, examples in tasks.values() if turns is not None else ():  # prompts with the tools: too long fails now
        turns.check(task, examples)
    return EvalJob(built, _weights(built, plan.step, plan.run_dir), plan.out, plan.label, plan.fresh, plan.stream,
                   turns)


def main(argv: list[str]) -> int:
    args = _parser().parse_intermixed_args(argv)
    plan = plan_eval(args)
    remember_run(plan.cfg)  # a crash log goes to the run directory
    if args.regrade is not None:
        summary, changed, rows = regrade_file(plan.cfg, Path(args.regrade).expanduser(), list(plan.ks),
                                              lambda name: task_options(plan.cfg, name)[name])
        print(json.dumps(summary, indent=1))
        print(f"regraded {rows} samples of {args.regrade}: {changed} verdicts differ from the file", file=sys.stderr)
        return 0
    tasks = prepare(plan, eval_overrides(args.overrides))
    job = _job(plan, tasks)
    summaries = {name: evaluate_task(job, index, name, task, examples=examples, options=plan.tasks[name])
                 for index, (name, (task, examples)) in enumerate(tasks.items())}
    if job.writes:
        print(summary_table(summaries))
        print(f"samples and summaries in {job.out}", file=sys.stderr)
    return 0
