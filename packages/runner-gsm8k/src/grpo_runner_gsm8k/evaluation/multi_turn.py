"""The eval of a multi-turn run (rollout.multi_turn): its questions are rolled out turn by turn
with the tools (and the environment) the run trains with, so the eval measures the policy it
trains.

Each of the n rows of a question runs the training turn loop (grpo_runner_gsm8k.samplers:
the same tools, `max_turns`, `max_total_tokens`, kept cache or re-prefill, tool calls and
environment steps on process 0 with their outcomes shared), sampled as the eval samples
(`eval.greedy`, `eval.n`; `eval.max_new_tokens` tokens a turn, and a row's budget
`max_total_tokens`, else `eval.max_new_tokens`). A row is graded on its final answer, the text
after its last tool turn (a `ConversationText`, so a reward judging it also sees the whole
conversation and the environment's information). Each sample records its row's tool work
(turns, calls, errors, timeouts, tool seconds, masked tokens).

The eval has its own tools and key (the eval's stream of train.seed): it draws nothing from
training's keys, data or tools, so a run resumes bitwise whether or when it evaluates. A task
that does not use the chat template (`use_chat_template: false`) cannot be offered tools,
since tool turns are rendered by the template: it is sampled in one turn, as in a single-turn
run, and has no tool metrics.
"""

from __future__ import annotations

from typing import Any

from grpo_core.contracts import Example, Policy

from grpo_runner_gsm8k.evaluation.evaluate import Sample, grade_all
from grpo_runner_gsm8k.samplers.multi_turn_step import ToolRows, conversation_texts
from grpo_runner_gsm8k.samplers.trajectory import row_counts


class MultiTurnEval(ToolRows):
    """The eval rollout of a multi-turn run `run` (built once, with tools of its own)."""

    def __init__(self, run: Any, registry: Any):
        sampling, total = run.eval_sampling, run.cfg.rollout.multi_turn.max_total_tokens
        super().__init__(run, registry, sampling, total or sampling.max_new_tokens)

    def offers(self, task: Any) -> bool:
        """Whether `task`'s questions are rolled out with the tools (its prompts use the chat template)."""
        return bool(task.use_chat_template)

    def check(self, task: Any, examples: list[Example]) -> None:
        """The examples' prompts rendered with the tools, as the eval renders them: one longer than
        rollout.max_prompt_length is a UserError (an environment's openings are checked as rows start)."""
        if self.offers(task) and self.environment is None:
            self.render(examples)

    def sample(self, weights: Any, task: Any, examples: list[Example], key: Any, n: int) -> list[list[Sample]]:
        """n graded samples of each example (rows in sampling order), each rolled out turn by turn."""
        run = self.run
        rows, _ = self.rolled_out(Policy(run.policy_graphdef, weights, run.qcfg), examples, n, key)
        completions = conversation_texts(run.inputs.tokenizer, rows, self.turns.budget)
        grades = grade_all(run, task, completions, [ex.answer for ex in examples for _ in range(n)])
        samples = [Sample(c, g.answer, g.correct, row_counts(row)) for c, g, row in zip(completions, grades, rows)]
        return [samples[q * n:(q + 1) * n] for q in range(len(examples))]
