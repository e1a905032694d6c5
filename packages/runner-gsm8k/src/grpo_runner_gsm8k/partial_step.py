"""The step's rollout batch from partial rollouts (rollout.partial, see grpo_rollout.partial).

The pool has prompts_per_step x n decode slots, the rows of a synchronous rollout. Each
step runs rounds until prompts_per_step groups are complete and trains on them, so the
update has the shape of a synchronous step's. With several processes each draws from its
own data shard and the draws are gathered, so every process holds the same pool.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from grpo_core.contracts import Example, KeptCacheRollout, Policy
from grpo_core.errors import UserError
from grpo_core.rollout_records import DecodeTally, RolloutResult
from grpo_rollout.partial import PartialPool, groups_result

from grpo_runner_gsm8k.multihost import gather_objects, host_array
from grpo_runner_gsm8k.refill import Sampled
from grpo_runner_gsm8k.scoring import score


# What the pool reads of a round's result: whole on every process, also when sharded across hosts.
HOST_FIELDS = ("completion_ids", "lengths", "sampler_logps", "finished")


def round_generator(run, weights, sampling, kv_cache: str):
    """`one_round(prefixes, key, budget, cached) -> RolloutResult`: one round's decode of the pool's
    slots with `weights`, loaded into the backend only for its duration (training and eval streams)."""

    def one_round(prefixes, key, budget: int, cached) -> RolloutResult:
        run.rollout.load_weights(Policy(run.policy_graphdef, weights, run.qcfg))
        round_sampling = dataclasses.replace(sampling, n=1, max_new_tokens=budget)
        kwargs = dict(batch_sharding=run.rollout_sharding, pad_token_id=run.inputs.tokenizer.pad_token_id)
        try:
            if kv_cache != "reprefill":
                result = run.rollout.generate_round(prefixes, cached, key, round_sampling, **kwargs)
            else:
                result = run.rollout.generate(prefixes, key, round_sampling, **kwargs)
            return dataclasses.replace(result, **{name: host_array(getattr(result, name)) for name in HOST_FIELDS})
        finally:
            run.rollout.release_weights()

    return one_round


def kv_cache_mode(cfg, rollout) -> str:
    """rollout.partial.kv_cache resolved for this backend (auto: within_step when it keeps caches)."""
    mode, keeps = cfg.rollout.partial.kv_cache, isinstance(rollout, KeptCacheRollout)
    if mode == "auto":
        return "within_step" if keeps else "reprefill"
    if mode != "reprefill" and not keeps:
        raise UserError(f"rollout.partial.kv_cache={mode}: the rollout backend {cfg.rollout.backend!r} has no "
                        "generate_round (rounds on a kept KV cache); set rollout.partial.kv_cache=reprefill")
    return mode


class PartialSampler:
    """Owns the run's pool of carried rows; `sample` gives one step's complete groups."""

    def __init__(self, run, tokenize, decode):
        cfg = run.cfg.rollout
        self.run, self.tokenize, self.decode = run, tokenize, decode
        self.pool = PartialPool(cfg.prompts_per_step * cfg.n, cfg.n, cfg.partial.budget, cfg.max_new_tokens,
                                cfg.partial.max_staleness, cfg.partial.budget_quantile,
                                kv_cache_mode(run.cfg, run.rollout))
        if cfg.partial.kv_cache == "auto":
            print(f"partial rollouts: carried rows continue by {self.pool.kv_cache} (rollout.partial.kv_cache=auto)")

    def draw(self) -> list[tuple[dict, list[int]]]:
        """The task's next prompt of every process (one each: the data position counts exactly
        the prompts used), in process order."""
        examples = gather_objects(self.run.inputs.task.train_batch(1))
        return [(dataclasses.asdict(ex), ids) for ex, ids in zip(examples, self.tokenize(self.run, examples))]

    def generate(self, weights):
        """One round's decode with `weights`, loaded into the backend only for its duration."""
        return round_generator(self.run, weights, self.run.sampling, self.pool.kv_cache)

    def sample(self, weights, key, version: int, times: dict, tally: DecodeTally) -> tuple[Sampled, np.ndarray, dict]:
        """(complete groups scored, their tokens' policy versions [N, Tn], pool metrics)."""
        start = time.monotonic()
        cfg = self.run.cfg.rollout
        groups, stats = self.pool.step(self.generate(weights), self.draw, key, version, tally, cfg.prompts_per_step)
        if self.pool.kv_cache == "within_step":  # not needed again: free it before the update
            self.run.rollout.release_kept_cache()
        reward_start = time.monotonic()
        result, versions = groups_result(groups, cfg.max_new_tokens, self.run.inputs.tokenizer.pad_token_id)
        examples = [Example(**group.example) for group in groups]
        answers = [ex.answer for ex in examples for _ in range(cfg.n)]
        scores = score(self.run.inputs.rewards, self.decode(self.run.inputs.tokenizer, result), answers)
        times["rollout_s"] += reward_start - start
        times["reward_s"] += time.monotonic() - reward_start
        return Sampled(examples, result, scores), versions, self.metrics(version, versions, stats, len(groups))

    def metrics(self, version: int, versions: np.ndarray, stats, groups: int) -> dict:
        age = version - versions[versions >= 0]
        return {"train-rollout/rounds": stats.rounds, "train-rollout/groups": groups,
                "train-rollout/restarted_rows": stats.restarted, "train-rollout/round_budget": self.pool.round_budget(),
                "train-rollout/carried_rows": self.pool.carried_rows,
                "train-rollout/staleness_mean": float(age.mean()) if age.size else 0.0,
                "train-rollout/staleness_max": int(age.max(initial=0))}
