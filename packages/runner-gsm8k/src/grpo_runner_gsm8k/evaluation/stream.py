"""Streaming eval: questions flow through a fixed set of decode slots, never waiting for the
longest row of a batch (`grpo-run eval --stream`).

The slots are a partial-rollout pool (grpo_rollout.partial.PartialPool) of `questions x n`
rows: each round decodes every slot for at most a quarter of eval.max_new_tokens; a row that
stops frees its slot for a row of the next question, and a question leaves the pool as soon
as its n rows are done, to be graded and written. Once every question is drawn, free slots
take filler rows of the first question (the batch keeps its shape; they are never graded).
Each question's prompt is run once for its n rows where the backend keeps a prompt table
(grpo_rollout.kept_shared).
A re-run after an interruption continues with the questions not yet written, drawn afresh.
"""

from __future__ import annotations

import itertools
from typing import Callable

import jax

from grpo_core.contracts import Example, Policy
from grpo_core.step_samplers import loaded
from grpo_rollout.kept_shared import table_size
from grpo_rollout.partial import PartialPool, groups_result

from grpo_runner_gsm8k.evaluation.evaluate import Sample, grade_all
from grpo_runner_gsm8k.samplers.partial import kv_cache_mode, round_generator
from grpo_runner_gsm8k.tokens import decode_completions, run_prompt_ids

FILLER = -1  # the position of a filler row's question


def _drawer(prompts: list[list[int]]) -> Callable[[], list[tuple[dict, list[int]]]]:
    queue = iter(range(len(prompts)))

    def draw() -> list[tuple[dict, list[int]]]:
        position = next(queue, FILLER)
        return [({"position": position}, prompts[max(position, 0)])]

    return draw


def stream_questions(run, weights, task, examples: list[Example], key, sampling, slot_questions: int,
                     on_done: Callable[[list[int], list[list[Sample]]], None]) -> None:
    """Samples `sampling.n` completions of every example through `slot_questions x n` slots;
    calls `on_done(positions, samples)` with each round's completed questions, graded."""
    n, max_new = sampling.n, sampling.max_new_tokens
    mode = kv_cache_mode(run.cfg.rollout, run.rollout)
    shares = n > 1 and getattr(run.rollout, "shares_round_prompts", False)  # each question's prompt run once
    pool = PartialPool(slot_questions * n, n, max(1, -(-max_new // 4)), max_new, kv_cache=mode,
                       prompt_table=table_size(slot_questions * n, n) if shares else None)
    draw = _drawer(run_prompt_ids(run, task.use_chat_template, examples))
    left = len(examples)
    with loaded(run.rollout, Policy(run.policy_graphdef, weights, run.qcfg)) as backend:
        generate = round_generator(run, backend, sampling, mode)
        for round_index in itertools.count():
            groups, _ = pool.step(generate, draw, jax.random.fold_in(key, round_index), 0, 1)
            groups += pool.take_complete(len(pool.groups))
            real = [g for g in groups if g.example["position"] != FILLER]
            if real:
                positions = [g.example["position"] for g in real]
                on_done(positions, _graded(run, task, [examples[p] for p in positions], real, max_new))
                left -= len(real)
            if left == 0:
                break
    if mode != "reprefill":
        run.rollout.release_kept_cache()


def _graded(run, task, examples: list[Example], groups, max_new: int) -> list[list[Sample]]:
    tokenizer = run.inputs.tokenizer
    result, _ = groups_result(groups, max_new, tokenizer.pad_token_id)
    completions = decode_completions(tokenizer, result)
    n = len(groups[0].rows)
    grades = grade_all(run, task, completions, [ex.answer for ex in examples for _ in range(n)])
    samples = [Sample(c, g.answer, g.correct) for c, g in zip(completions, grades)]
    return [samples[q * n:(q + 1) * n] for q in range(len(examples))]
