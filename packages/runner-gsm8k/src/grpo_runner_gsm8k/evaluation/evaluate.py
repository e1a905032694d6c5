"""Evaluation shared by training (`eval.every_steps`) and `grpo-run eval`: n samples per
question from the run's rollout backend on its mesh, each graded by the task's own grader
(`GradedTask.grade`; tasks without one are judged by `eval.reward`), then summarised by
`eval_metrics` (mean@n, pass@k, maj@k, greedy accuracy, breakdowns by the task's fields).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, NamedTuple, Protocol, Sequence, runtime_checkable

import jax
import numpy as np
from grpo_core.config import EvalConfig
from grpo_core.contracts import CompletionText, Example, Policy
from grpo_core.rollout_records import RolloutResult
from grpo_core.step_samplers import loaded
from grpo_rollout.decode import batch_spec_axes

from grpo_runner_gsm8k.tasks.answers import extract_answer
from grpo_runner_gsm8k.evaluation.metrics import breakdown, check_k, ks_up_to, summarize
from grpo_runner_gsm8k.tasks.grading import Graded, normalize_answer
from grpo_runner_gsm8k.multihost import gather_objects
from grpo_runner_gsm8k.samplers.trajectory import tool_metrics
from grpo_runner_gsm8k.training.scoring import score
from grpo_runner_gsm8k.tokens import decode_completions, run_prompt_ids, with_prompts


@runtime_checkable
class GradedTask(Protocol):
    """A task that grades its own completions (the boxed-math family, countdown)."""

    def grade(self, completion: str, reference: str) -> Graded:
        """The completion's extracted, normalised answer and whether it is right."""


@runtime_checkable
class FieldedTask(Protocol):
    """A task whose examples carry fields eval results are broken down by (MATH's subject, level)."""

    def example_fields(self, example_id: str) -> dict[str, Any]:
        """The breakdown fields of one example."""


class Sample(NamedTuple):
    """One graded completion of one question; tools: a multi-turn row's tool work
    (grpo_runner_gsm8k.samplers.trajectory.row_counts), None for a single-turn one."""

    completion: CompletionText
    answer: str | None
    correct: bool
    tools: dict | None = None


def rollout_prompts(run, weights, prompts: list[list[int]], key, sampling) -> RolloutResult:
    """One rollout of token-id prompts with `weights` (compute dtype) loaded into the backend
    for its duration only: the update that follows needs that memory."""
    with loaded(run.rollout, Policy(run.policy_graphdef, weights, run.qcfg)) as backend:
        return backend.generate(prompts, key, sampling, pad_token_id=run.inputs.tokenizer.pad_token_id,
                                batch_sharding=run.rollout_sharding)


def _answer_text(answer: Fraction | str | None) -> str | None:
    return None if answer is None else normalize_answer(str(answer))


def reward_grades(run, completions: Sequence[CompletionText], references: Sequence[str]) -> list[Graded]:
    """Verdicts of `eval.reward` (at least `eval.pass_threshold`), answers as the correctness reward reads them."""
    return judge_grades(run.cfg, run.inputs.rewards, completions, references)


def judge_grades(cfg, rewards: dict, completions: Sequence[CompletionText], references: Sequence[str]) -> list[Graded]:
    """`reward_grades` from the config and the run's reward functions (name -> (function, weight)),
    so a samples file is regraded without a model. The answer is the number the correctness
    reward reads, as its exact value ("1,000" and "1000.0" are one answer in a majority vote)."""
    judge = cfg.eval.reward
    judged = score({judge: (rewards[judge][0], 1.0)}, completions, references)
    fallback = cfg.task.reward_options.get("correctness", {}).get("fallback", "final_line")
    return [Graded(_answer_text(extract_answer(c, fallback)), bool(total >= cfg.eval.pass_threshold))
            for c, total in zip(completions, judged.total)]


def grade_all(run, task, completions: Sequence[CompletionText], references: Sequence[str]) -> list[Graded]:
    if isinstance(task, GradedTask):
        return task_grades(task, completions, references)
    return reward_grades(run, completions, references)


def task_grades(task: GradedTask, completions: Sequence[str], references: Sequence[str]) -> list[Graded]:
    """The task's verdicts, all at once when it grades batches (`grade_many`: the code tasks run
    their sandboxes concurrently), else one by one."""
    grade_many = getattr(task, "grade_many", None)
    if grade_many is not None:
        return list(grade_many(list(completions), list(references)))
    return [task.grade(c, r) for c, r in zip(completions, references)]


def question_multiple(run, n: int) -> int:
    """The fewest questions whose rows (questions x n) split evenly over the devices of the
    rollout's batch axes."""
    sharding = run.rollout_sharding
    axes = batch_spec_axes(sharding)
    axes = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
    shards = math.prod(sharding.mesh.shape[a] for a in axes)
    return shards // math.gcd(shards, n)


def sample_questions(run, weights, task, examples: list[Example], key, sampling,
                     turns: Any = None) -> list[list[Sample]]:
    """`sampling.n` graded samples of each example, in sampling order. turns: a multi-turn run's
    eval rollout (grpo_runner_gsm8k.evaluation.multi_turn.MultiTurnEval), which rolls out the
    tasks it offers the tools to; other tasks are sampled in one turn. The single-turn batch is
    padded with the last example up to a size the mesh splits evenly; the padding is not graded."""
    if turns is not None and turns.offers(task):
        return turns.sample(weights, task, examples, key, sampling.n)
    multiple = question_multiple(run, sampling.n)
    padded = examples + [examples[-1]] * (-len(examples) % multiple)
    prompts = run_prompt_ids(run, task.use_chat_template, padded)
    completions = decode_completions(run.inputs.tokenizer, rollout_prompts(run, weights, prompts, key, sampling))
    n = sampling.n
    completions = with_prompts(completions[:len(examples) * n], examples, n, run.cfg.task.system_prompt)
    references = [ex.answer for ex in examples for _ in range(n)]
    grades = grade_all(run, task, completions, references)
    samples = [Sample(c, g.answer, g.correct) for c, g in zip(completions, grades)]
    return [samples[q * n:(q + 1) * n] for q in range(len(examples))]


def eval_ks(eval_cfg: EvalConfig) -> list[int]:
    """The k of pass@k and maj@k: `eval.k`, else 1, 2, 4, ... up to eval.n."""
    ks = list(getattr(eval_cfg, "k", None) or ks_up_to(eval_cfg.n))
    for k in ks:
        check_k(int(k), eval_cfg.n)
    return sorted({int(k) for k in ks})


def tool_counts(samples: list[list[Sample]]) -> list[dict]:
    """The tool work of each multi-turn sample ([] when the task was sampled in one turn)."""
    return [s.tools for question in samples for s in question if s.tools is not None]


def question_fields(task, examples: list[Example]) -> list[dict[str, Any]]:
    """The breakdown fields of each example ({} each for a task without fields)."""
    if isinstance(task, FieldedTask):
        return [task.example_fields(ex.id) for ex in examples]
    return [{} for _ in examples]


def question_metrics(task, examples: list[Example], samples: list[list[Sample]], greedy: bool,
                     ks: list[int]) -> dict[str, Any]:
    """The summary of one task's questions, with a breakdown by its fields when it has any."""
    return samples_metrics(samples, question_fields(task, examples), greedy, ks)


def samples_metrics(samples: list[list[Sample]], fields: list[dict[str, Any]], greedy: bool,
                    ks: list[int]) -> dict[str, Any]:
    """The summary of graded samples per question, broken down by the questions' fields when
    any has one (what `grpo-run eval` writes and `--regrade` recomputes from a samples file)."""
    verdicts = [[s.correct for s in question] for question in samples]
    answers = [[s.answer for s in question] for question in samples]
    out: dict[str, Any] = summarize(verdicts, answers, greedy, ks)
    if tool_counts(samples):  # a multi-turn eval: its rows' tool work
        out["tools"] = tool_metrics(tool_counts(samples), "")
    if any(fields):
        out["by"] = breakdown(verdicts, answers, fields, greedy, ks)
    return out


def training_eval(run, weights, extra_tasks: dict[str, Any], key, ks: list[int], turns: Any = None) -> dict[str, float]:
    """Training's eval: the training task's first-sample accuracy (and pass@n), then every task
    of eval.tasks as eval/<task>/<metric>, each with its own key. turns: a multi-turn run's eval
    rollout (see sample_questions); its tool metrics are eval/tools/<metric> and
    eval/<task>/tools/<metric>."""
    task, sampling = run.inputs.task, run.eval_sampling
    examples = gather_objects(task.test_examples(run.cfg.eval.num_questions))
    samples = sample_questions(run, weights, task, examples, key, sampling, turns)
    out = {"eval/accuracy": float(np.mean([question[0].correct for question in samples]))}
    if sampling.n > 1:
        out[f"eval/pass@{sampling.n}"] = float(np.mean([any(s.correct for s in q) for q in samples]))
    if tool_counts(samples):
        out.update(tool_metrics(tool_counts(samples), "eval/tools/"))
    for index, (name, extra) in enumerate(extra_tasks.items(), 1):
        examples = extra.test_examples(run.cfg.eval.num_questions)
        samples = sample_questions(run, weights, extra, examples, jax.random.fold_in(key, index), sampling, turns)
        out.update(flat_metrics(f"eval/{name}", question_metrics(extra, examples, samples, sampling.greedy, ks)))
    return out


def flat_metrics(prefix: str, summary: dict[str, Any]) -> dict[str, float]:
    """`summary` as `<prefix>/<metric>` scalars (breakdowns as `<prefix>/by/<field>/<value>/<metric>`)."""
    out = {}
    for key, value in summary.items():
        if isinstance(value, dict):
            out.update(flat_metrics(f"{prefix}/{key}", value))
        else:
            out[f"{prefix}/{key}"] = value
    return out
