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
questions and the output directory are checked before any model is loaded
(`grpo_runner_gsm8k.commands.eval_plan`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional

import jax

from grpo_core.errors import UserError
from grpo_core.registry import default_registry

from grpo_runner_gsm8k.cli import _remember_run as remember_run
from grpo_runner_gsm8k.evaluation.store import SampleStore, read_state
from grpo_runner_gsm8k.evaluation.evaluate import (Sample, eval_ks, question_fields, question_multiple,
                                                   sample_questions, samples_metrics)
from grpo_runner_gsm8k.evaluation.multi_turn import MultiTurnEval
from grpo_runner_gsm8k.commands.eval_plan import (EvalPlan, check_grading, check_out_dir, eval_overrides,
                                                   judged_by_reward, eval_parser, plan_eval, task_options, task_questions)
from grpo_runner_gsm8k.commands.regrade import regrade_file

EVAL_STREAM = 0x45564C  # the eval key's stream, as training's (loop.EVAL_STREAM)


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

    if plan.stream:
        _check_stream(plan.cfg)
    built = build_run(plan.cfg, default_registry(), training=False)
    turns = MultiTurnEval(built, built.registry) if plan.cfg.rollout.multi_turn.enabled else None
    for task, examples in tasks.values() if turns is not None else ():  # prompts with the tools: too long fails now
        turns.check(task, examples)
    return EvalJob(built, _weights(built, plan.step, plan.run_dir), plan.out, plan.label, plan.fresh, plan.stream,
                   turns)


def _check_stream(cfg) -> None:
    """The streaming slots' decode layout, from the model's architecture alone (before any weights)."""
    from grpo_runner_gsm8k.assembly.build import build_tokenizer, model_config
    from grpo_runner_gsm8k.assembly.decode_layouts import check_stream_layout

    check_stream_layout(cfg.rollout, model_config(cfg.model, build_tokenizer(cfg.model)))


def main(argv: list[str]) -> int:
    args = eval_parser().parse_intermixed_args(argv)
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
