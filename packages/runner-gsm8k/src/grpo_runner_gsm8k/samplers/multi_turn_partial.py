"""The step's rollout batch from multi-turn rows carried across steps (rollout.multi_turn with
rollout.partial; the pool is grpo_runner_gsm8k.samplers.multi_turn_pool).

Prompts, tools, the turn rules and the rewards are the multi-turn sampler's; the rounds,
the slots and the groups that reach the update are the partial rollouts'. The carried rows
are run state: the sampler is a `CarryingSampler`, saved and restored with the checkpoint,
their environments' episodes included (an environment must be a `SavedEnvironment`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from grpo_core.contracts import Example, Policy, SavedEnvironment
from grpo_core.errors import UserError
from grpo_core.rollout_records import Sampled, waste_metrics
from grpo_core.step_samplers import loaded

from grpo_runner_gsm8k.multihost import gather_objects
from grpo_runner_gsm8k.samplers.multi_turn_pool import ConversationGroup, ConversationPool
from grpo_runner_gsm8k.samplers.multi_turn_step import MultiTurnSampler, conversation_texts
from grpo_runner_gsm8k.samplers.partial import partial_rollout_metrics, round_generator
from grpo_runner_gsm8k.samplers.shared_environments import SharedEnvironment, share
from grpo_runner_gsm8k.samplers.shared_tools import runs_tools
from grpo_runner_gsm8k.samplers.trajectory import episode_arrays, trajectory_metrics, trajectory_result
from grpo_runner_gsm8k.training.scoring import score
from grpo_runner_gsm8k.tokens import with_prompts


class MultiTurnPartialSampler(MultiTurnSampler):
    """Owns the run's tools and its pool of carried conversations; `sample` gives one step's
    complete groups, scored (`StepSampler`, `CarryingSampler`)."""

    def __init__(self, run: Any, registry: Any):
        super().__init__(run, registry)
        cfg = run.cfg.rollout
        if self.environment is not None:
            check_saved(self.environment, self.environment_options)
        self.pool = ConversationPool(cfg.prompts_per_step * cfg.n, cfg.n, cfg.partial.budget, cfg.max_new_tokens,
                                     self.turns, self.restore_environment)

    def draw(self) -> list[tuple[dict, list[list[int]], list]]:
        """The task's next example of every process (one each), in process order: its rows' prompts
        rendered with the tools (or their environments reset, on process 0, and shared)."""
        drawn = []
        for example in gather_objects(self.run.inputs.task.train_batch(1)):
            prompts, environments = self.start_rows([example], self.run.cfg.rollout.n)
            drawn.append((dataclasses.asdict(example), prompts, share(environments) if environments else
                          [None] * len(prompts)))
        return drawn

    def restore_environment(self, saved: dict) -> SharedEnvironment:
        """A carried row's environment from its saved state: rebuilt and restored on process 0."""
        environment = None
        if runs_tools():
            environment = self.environment.factory(self.environment_options)
            environment.restore(saved["episode"])
        return SharedEnvironment(environment, bool(saved["done"]), dict(saved["info"]))

    def sample(self, policy: Policy, key: jax.Array, step: int) -> tuple[Sampled, dict[str, Any], dict[str, float]]:
        """The complete groups of rounds decoded with `policy` (version `step`), scored."""
        start = time.monotonic()
        run, cfg = self.run, self.run.cfg.rollout
        with loaded(run.rollout, policy) as backend:
            generate = round_generator(run, backend, self.turns.sampling, "reprefill")
            groups, rounds, work = self.pool.step(generate, self.draw, key, step, cfg.prompts_per_step)
        reward_start = time.monotonic()
        rows = [row.trajectory for group in groups for row in group.rows]
        result = trajectory_result(rows, cfg.n, self.turns.budget, run.inputs.tokenizer.pad_token_id)
        examples = [Example(**group.example) for group in groups]
        answers = [ex.answer for ex in examples for _ in range(cfg.n)]
        texts = with_prompts(conversation_texts(run.inputs.tokenizer, rows, self.turns.budget), examples, cfg.n,
                             run.cfg.task.system_prompt)
        scores = score(run.inputs.rewards, texts, answers)
        scores = scores._replace(episodes=episode_arrays(rows, self.turns.budget))
        seconds = {"rollout_s": reward_start - start, "reward_s": time.monotonic() - reward_start}
        metrics = {**trajectory_metrics(rows), **self.metrics(step, groups, rounds),
                   **waste_metrics(work, np.asarray(result.lengths))}
        return Sampled(examples, result, scores), metrics, seconds

    def metrics(self, version: int, groups: list[ConversationGroup], rounds: int) -> dict:
        """The partial rollouts' metrics (train-rollout/*) of this step's groups."""
        versions = np.array([v for group in groups for row in group.rows for v in row.versions], np.int64)
        return partial_rollout_metrics(version, versions, rounds=rounds, groups=len(groups), restarted=0,
                                       budget=self.pool.budget, carried=self.pool.carried_rows)

    def state(self) -> dict[str, Any]:
        """The carried conversations, JSON-able (saved with the checkpoint)."""
        return self.pool.state()

    def restore(self, state: dict[str, Any]) -> None:
        self.pool.restore(state)


def check_saved(spec: Any, options: Any) -> None:
    """An environment whose rows are carried across steps must save its episode (one is built to see)."""
    if not isinstance(spec.factory(options), SavedEnvironment):
        raise UserError(f"rollout.multi_turn.environment = {spec.name!r} with rollout.partial.enabled: its "
                        "environment has no state()/restore() (grpo_core.contracts.SavedEnvironment), so a carried "
                        "row's episode cannot be saved; add them, or set rollout.partial.enabled=false")
