"""`grpo-run eval`: evaluate a model on one or more tasks' test sets, as papers report it.

    grpo-run eval --config X.yaml [overrides]          the base model of the config (model.path)
    grpo-run eval --model DIR --config X.yaml          an exported (or any HF) model directory
    grpo-run eval --run-dir R [--step S] [overrides]   a run's checkpoint, with the run's config

Tasks are `--tasks a,b`, else `eval.tasks`, else the config's training task. Each question
gets `eval.n` samples from the run's rollout backend on its mesh (`eval.greedy: true` is
one greedy sample); every sample goes to `<out>/<task>/samples.jsonl` and the metrics to
`summary.json`, where `<out>` defaults to `<run dir>/eval/<step-S | model>`. A re-run with
the same settings continues where an interrupted one stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import jax

from grpo_core.config_io import config_to_yaml, load_config, plugin_options
from grpo_core.errors import UserError
from grpo_core.registry import default_registry

from grpo_runner_gsm8k.cli import ArgumentParser
from grpo_runner_gsm8k.cli import _remember_run as remember_run
from grpo_runner_gsm8k.evaluation.store import SampleStore
from grpo_runner_gsm8k.assembly.eval_tasks import eval_tasks
from grpo_runner_gsm8k.evaluation.evaluate import (Sample, eval_ks, question_metrics, question_multiple,
                                          sample_questions)
from grpo_runner_gsm8k.evaluation.multi_turn import MultiTurnEval
from grpo_runner_gsm8k.multihost import gather_objects

EVAL_STREAM = 0x45564C  # the eval key's stream, as training's (loop.EVAL_STREAM)


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="grpo-run eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="YAML run config (default: the embedded tiny CPU config)")
    parser.add_argument("--run-dir", help="evaluate a checkpoint of this run (its saved config is the base)")
    parser.add_argument("--step", type=int, help="with --run-dir: the checkpoint step (default: the newest)")
    parser.add_argument("--model", help="an HF model directory (e.g. from grpo-run export): sets model.path")
    parser.add_argument("--tasks", help="comma-separated task names (default: eval.tasks, else task.name)")
    parser.add_argument("--limit", type=int, help="evaluate only the first N questions of each task")
    parser.add_argument("--out", help="output directory (default: <logging.dir>/eval/<step-S | model>)")
    parser.add_argument("--fresh", action="store_true", help="discard earlier samples in the output directory")
    parser.add_argument("--stream", action="store_true",
                        help="stream questions through the decode slots (a finished row takes the next question) "
                             "instead of sampling chunk by chunk")
    parser.add_argument("--debug", action="store_true", help="also print the traceback of an error")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    return parser


def _load_config(args: argparse.Namespace):
    """The run config (a checkpoint's, or --config) with the overrides; and the checkpoint step."""
    overrides = list(args.overrides) + ([f"model.path={args.model}"] if args.model else [])
    if args.run_dir is None:
        if args.step is not None:
            raise UserError("--step only applies to --run-dir; add --run-dir R")
        return load_config(args.config, overrides, registry=default_registry()), None
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


def _tasks(cfg, options: dict[str, dict], built) -> dict[str, Any]:
    """The tasks, built; the training task with its own options is the run's (its data is loaded)."""
    if list(options) == [cfg.task.name] and options[cfg.task.name] == cfg.task.options:
        return {cfg.task.name: built.inputs.task}
    return eval_tasks(options, default_registry(), cfg.task.seed)


def _weights(built, step: Optional[int], run_dir: Optional[str]):
    """The policy's weights in the compute dtype: the checkpoint's, or the loaded model's."""
    params = built.state.params
    if step is not None:
        from grpo_runner_gsm8k.operations.checkpoint import Resume

        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
        params = Resume.read(Path(run_dir).expanduser(), [step]).params(target)
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

    def settings(self, task_name: str) -> dict[str, Any]:
        sampling = self.built.eval_sampling
        return {"task": task_name, "model": self.label, "n": sampling.n, "greedy": sampling.greedy,
                "temperature": self.built.cfg.rollout.temperature, "max_new_tokens": sampling.max_new_tokens,
                "seed": self.built.cfg.train.seed, **self.turn_settings()}

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
        fresh = store.append([ex.id for ex in chunk], samples)
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
        records.update({ex.id: q for ex, q in zip(done, store.append([ex.id for ex in done], samples))})
        progress.update(len(records))

    if remaining:
        stream_questions(job.built, job.weights, task, remaining, job.key(task_index, len(examples) - len(remaining)),
                         job.built.eval_sampling, chunk_size(job.built), write)
    return records


def evaluate_task(job: EvalJob, task_index: int, name: str, task, limit: Optional[int]) -> dict[str, Any]:
    """Samples, grades and summarises one task; returns its summary (also in summary.json)."""
    examples = gather_objects(task.test_examples(limit))
    if not examples:
        raise UserError(f"task {name} has no test questions; check its data (task options)")
    store = SampleStore(job.out / name, job.settings(name), writes=job.writes, fresh=job.fresh)
    progress = Progress(name, len(examples), len(store.done(job.built.eval_sampling.n)))
    started = time.monotonic()
    sample = _stream if job.stream else _sample_chunks
    records = sample(job, task_index, task, examples, store, progress)
    samples = [[Sample(r["completion"], r["answer"], r["correct"], r.get("tools")) for r in records[ex.id]]
               for ex in examples]
    summary = question_metrics(task, examples, samples, job.built.eval_sampling.greedy, eval_ks(job.built.cfg.eval))
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


def _job(args: argparse.Namespace) -> tuple[EvalJob, dict[str, Any]]:
    from grpo_runner_gsm8k.assembly.run import build_run

    cfg, step = _load_config(args)
    remember_run(cfg)  # a crash log goes to the run directory
    _check_sampling(cfg, args.stream)
    eval_ks(cfg.eval)  # k outside 1..eval.n fails before any device work
    options = task_options(cfg, args.tasks)
    built = build_run(cfg, default_registry(), training=False)
    tasks = _tasks(cfg, options, built)
    label = f"step-{step}" if step is not None else "model"
    out = Path(args.out).expanduser() if args.out else Path(cfg.logging.dir) / "eval" / label
    turns = MultiTurnEval(built, built.registry) if cfg.rollout.multi_turn.enabled else None
    for task in tasks.values() if turns is not None else ():  # prompts with the tools: too long fails now
        turns.check(task, task.test_examples(args.limit))
    return EvalJob(built, _weights(built, step, args.run_dir), out, label, args.fresh, args.stream, turns), tasks


def main(argv: list[str]) -> int:
    args = _parser().parse_intermixed_args(argv)
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit {args.limit}: need at least 1 question per task")
    job, tasks = _job(args)
    summaries = {name: evaluate_task(job, index, name, task, args.limit) for index, (name, task) in enumerate(tasks.items())}
    if job.writes:
        print(summary_table(summaries))
        print(f"samples and summaries in {job.out}", file=sys.stderr)
    return 0
