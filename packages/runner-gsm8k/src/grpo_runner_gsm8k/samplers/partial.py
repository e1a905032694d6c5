"""The step's rollout batch from partial rollouts (rollout.partial, see grpo_rollout.partial).

The pool has prompts_per_step x n decode slots, the rows of a synchronous rollout, or a
multiple of them (rollout.partial.slots). Each step runs rounds until prompts_per_step groups
are complete and trains on them, so the update has the shape of a synchronous step's. With
several processes each draws from its own data shard and the draws are gathered, so every
process holds the same pool. The pool's carried rows are run state: the sampler is a
`CarryingSampler`, saved and restored with the checkpoint.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from grpo_core.config import RolloutConfig
from grpo_core.contracts import Example, KeptCacheRollout, Policy
from grpo_core.errors import UserError
from grpo_core.rollout_records import RolloutResult, Sampled, waste_metrics
from grpo_core.step_samplers import loaded
from grpo_rollout.kept_shared import table_size
from grpo_rollout.partial import PartialPool, RoundStats, groups_result

from grpo_runner_gsm8k.multihost import gather_objects, host_array
from grpo_runner_gsm8k.samplers.plain import score_groups
from grpo_runner_gsm8k.tokens import decode_completions, tokenize_prompts


# What the pool reads of a round's result: whole on every process, also when sharded across hosts.
HOST_FIELDS = ("completion_ids", "lengths", "sampler_logps", "finished")


def round_generator(run: Any, backend: Any, sampling, kv_cache: str):
    """`one_round(prefixes, key, budget, cached) -> RolloutResult`: one round's decode of the pool's
    slots on `backend`, with the policy's weights loaded (`loaded`) around all of a step's rounds,
    so an 8-bit copy (rollout.quantize) is made once per step."""

    def one_round(prefixes, key, budget: int, cached, groups=None) -> RolloutResult:
        round_sampling = dataclasses.replace(sampling, n=1, max_new_tokens=budget)
        kwargs = dict(batch_sharding=run.rollout_sharding, pad_token_id=run.inputs.tokenizer.pad_token_id)
        if groups is not None:  # the pool keeps a prompt table (shared_prompt_table)
            kwargs["groups"] = groups
        if kv_cache != "reprefill":
            result = backend.generate_round(prefixes, cached, key, round_sampling, **kwargs)
        elif groups is not None:  # re-prefilled on the prompt table: every slot admitted, nothing kept
            result = backend.generate_round(prefixes, [False] * len(prefixes), key, round_sampling, **kwargs)
            backend.release_kept_cache()
        else:
            result = backend.generate(prefixes, key, round_sampling, **kwargs)
        return dataclasses.replace(result, **{name: host_array(getattr(result, name)) for name in HOST_FIELDS})

    return one_round


def kv_cache_mode(rollout_cfg: RolloutConfig, backend: Any) -> str:
    """rollout.partial.kv_cache resolved for this backend (auto: within_step when it keeps caches;
    multi-turn rows always re-prefill, other modes refused at load)."""
    if rollout_cfg.multi_turn.enabled:
        return "reprefill"
    mode, keeps = rollout_cfg.partial.kv_cache, isinstance(backend, KeptCacheRollout)
    if mode == "auto":
        return "within_step" if keeps else "reprefill"
    if mode != "reprefill" and not keeps:
        raise UserError(f"rollout.partial.kv_cache={mode}: the rollout backend {rollout_cfg.backend!r} has no "
                        "generate_round (rounds on a kept KV cache); set rollout.partial.kv_cache=reprefill")
    return mode


def slot_count(rollout_cfg: RolloutConfig) -> int:
    """The pool's decode slots: rollout.partial.slots, or a step's rows (null, and `auto` until the
    plan decides it: grpo_runner_gsm8k.plan.slots)."""
    slots = rollout_cfg.partial.slots
    return slots if isinstance(slots, int) else rollout_cfg.prompts_per_step * rollout_cfg.n


def shared_prompt_table(rollout_cfg: RolloutConfig, backend: Any) -> int | None:
    """G, the prompt table's group slots, where the backend runs each group's prompt once in a round
    (rollout.options.shared_prompt; grpo_rollout.kept_shared); None where it does not."""
    if rollout_cfg.n < 2 or rollout_cfg.multi_turn.enabled or not getattr(backend, "shares_round_prompts", False):
        return None
    return table_size(slot_count(rollout_cfg), rollout_cfg.n)


class PartialSampler:
    """Owns the run's pool of carried rows; `sample` gives one step's complete groups
    (`StepSampler`, `CarryingSampler`)."""

    def __init__(self, run: Any):
        cfg = run.cfg.rollout
        if cfg.partial.slots == "auto":
            raise ValueError("rollout.partial.slots=auto reached the sampler undecided: decide it before the run "
                             "is built (grpo_runner_gsm8k.plan.slots.decided_slots, as `grpo-run` does)")
        self.run = run
        self.pool = PartialPool(slot_count(cfg), cfg.n, cfg.partial.budget, cfg.max_new_tokens,
                                cfg.partial.max_staleness, cfg.partial.budget_quantile,
                                kv_cache_mode(cfg, run.rollout), shared_prompt_table(cfg, run.rollout))
        if cfg.partial.kv_cache == "auto":
            print(f"partial rollouts: carried rows continue by {self.pool.kv_cache} (rollout.partial.kv_cache=auto)")

    def draw(self) -> list[tuple[dict, list[int]]]:
        """The task's next prompt of every process (one each: the data position counts exactly
        the prompts used), in process order."""
        examples = gather_objects(self.run.inputs.task.train_batch(1))
        return [(dataclasses.asdict(ex), ids) for ex, ids in zip(examples, tokenize_prompts(self.run, examples))]

    def sample(self, policy: Policy, key: jax.Array, step: int) -> tuple[Sampled, dict[str, Any], dict[str, float]]:
        """The complete groups of rounds decoded with `policy` (version `step`), scored."""
        start = time.monotonic()
        cfg = self.run.cfg.rollout
        with loaded(self.run.rollout, policy) as backend:
            generate = round_generator(self.run, backend, self.run.sampling, self.pool.kv_cache)
            groups, stats = self.pool.step(generate, self.draw, key, step, cfg.prompts_per_step)
        if self.pool.kv_cache == "within_step":  # not needed again: free it before the update
            self.run.rollout.release_kept_cache()
        reward_start = time.monotonic()
        result, versions = groups_result(groups, cfg.max_new_tokens, self.run.inputs.tokenizer.pad_token_id)
        examples = [Example(**group.example) for group in groups]
        scores = score_groups(self.run, examples, decode_completions(self.run.inputs.tokenizer, result))
        seconds = {"rollout_s": reward_start - start, "reward_s": time.monotonic() - reward_start}
        metrics = {**self.metrics(step, versions, stats, len(groups)), **waste_metrics(stats.decode, result.lengths)}
        return Sampled(examples, result, scores), metrics, seconds

    def metrics(self, version: int, versions: np.ndarray, stats: RoundStats, groups: int) -> dict:
        return partial_rollout_metrics(version, versions, rounds=stats.rounds, groups=groups,
                                       restarted=stats.restarted, budget=self.pool.round_budget(),
                                       carried=self.pool.carried_rows, waited=stats.waited)

    def state(self) -> dict[str, Any]:
        """The carried rows, JSON-able (saved with the checkpoint)."""
        return self.pool.state()

    def restore(self, state: dict[str, Any]) -> None:
        self.pool.restore(state)


def partial_rollout_metrics(version: int, versions: np.ndarray, *, rounds: int, groups: int, restarted: int,
                            budget: int, carried: int, waited: int = 0) -> dict:
    """train-rollout/* of a step of partial rollouts; `versions` are the policy versions of its
    trained tokens (-1 where no policy sampled the token)."""
    age = version - versions[versions >= 0]
    return {"train-rollout/rounds": rounds, "train-rollout/groups": groups, "train-rollout/restarted_rows": restarted,
            "train-rollout/round_budget": budget, "train-rollout/carried_rows": carried,
            "train-rollout/slots_waited": waited,
            "train-rollout/staleness_mean": float(age.mean()) if age.size else 0.0,
            "train-rollout/staleness_max": int(age.max(initial=0))}
