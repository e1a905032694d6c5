"""Dynamic sampling that refills the batch (DAPO, `loss.dynamic_sampling_mode: refill`).

A group whose K rewards all agree has zero advantage and teaches nothing. After the
step's rollout, while fewer than `prompts_per_step` groups are informative and fewer
than `loss.max_extra_rollouts` extra rollouts were made, another `prompts_per_step`
fresh prompts are drawn from the task and rolled out. The step then trains on the
first `prompts_per_step` informative groups in the order they were sampled; when the
limit runs out first, the batch is completed with uninformative groups of the earliest
rollouts, which dynamic sampling masks as usual. Informative groups beyond the batch
are discarded, as in DAPO.

The rollouts are the plain sampler's (`PlainRollouts`) or, with rollout.multi_turn, the
multi-turn sampler's: refilled groups are rolled out turn by turn like the first ones, and
their loss masks and per-turn information are merged with the rows.

Every decision reads host values that are identical on every process (the gathered
rewards), so every process draws, rolls out and selects alike. The task's data
position advances by every prompt drawn and is saved with the checkpoint, so a
resumed run draws exactly the prompts the uninterrupted one would. Extra rollout i
samples with the step's key folded with i, so the step's randomness is its key alone.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from grpo_core.advantage_records import zero_std_groups
from grpo_core.contracts import Policy
from grpo_core.rollout_records import DecodeTally, RolloutResult, Sampled, Scores, waste_metrics
from grpo_meshes import train_batch_sharding

from grpo_runner_gsm8k.multihost import host_array
from grpo_runner_gsm8k.samplers.plain import scored_rollout


class RefillSampler:
    """Rollouts until `prompts_per_step` groups are informative or the extra rollouts run out
    (`StepSampler`)."""

    def __init__(self, run: Any, rollouts: Any = None):
        """rollouts: what rolls out and scores fresh prompts (`scored_rollout(policy, key)`) and
        gives the step's own metrics of every rollout made (`step_metrics()`); PlainRollouts by default."""
        self.run = run
        self.rollouts = rollouts or PlainRollouts(run)
        self.train_sharding = train_batch_sharding(run.mesh)
        self.row_sharding = train_batch_sharding(run.mesh, ndim=1)

    def sample(self, policy: Policy, key: jax.Array, step: int) -> tuple[Sampled, dict[str, Any], dict[str, float]]:
        loss, n, want = self.run.cfg.loss, self.run.cfg.rollout.n, self.run.cfg.rollout.prompts_per_step
        rounds: list[Sampled] = []
        work, seconds = DecodeTally(), {"rollout_s": 0.0, "reward_s": 0.0}
        while not rounds or needs_more(rounds, n, want, loss.max_extra_rollouts):
            round_key = jax.random.fold_in(key, len(rounds)) if rounds else key
            sampled, round_work, round_seconds = self.rollouts.scored_rollout(policy, round_key)
            rounds.append(sampled)
            work = work + round_work
            seconds = {name: seconds[name] + round_seconds[name] for name in seconds}
        picks = pick_groups(rounds, n, want)
        result = self.on_train_devices(merge_results([r.result for r in rounds], picks, n))
        examples = [rounds[i].examples[g] for i, g in picks]
        scores = merge_scores([r.scores for r in rounds], picks, n)
        metrics = {**refill_metrics(rounds, picks, n), **waste_metrics(work, host_array(result.lengths)),
                   **self.rollouts.step_metrics()}
        return Sampled(examples, result, scores), metrics, seconds

    def on_train_devices(self, result: RolloutResult) -> RolloutResult:
        """A host-side result placed like the update batch (host values: the same on every process)."""
        return jax.tree.map(lambda x: jax.device_put(x, self.train_sharding if x.ndim == 2 else self.row_sharding),
                            result)


class PlainRollouts:
    """One rollout of fresh prompts at a time (plain.scored_rollout), with no metrics of its own."""

    def __init__(self, run: Any):
        self.run = run

    def scored_rollout(self, policy: Policy, key: jax.Array) -> tuple[Sampled, DecodeTally, dict[str, float]]:
        return scored_rollout(self.run, policy, key)

    def step_metrics(self) -> dict[str, Any]:
        return {}


def informative(scores: Scores, n: int) -> np.ndarray:
    """[P] bool: the group's rewards do not all agree."""
    return ~zero_std_groups(scores.total, n)


def needs_more(rounds: list[Sampled], n: int, want: int, max_extra: int) -> bool:
    """Whether another rollout is due: too few informative groups, and rollouts left."""
    found = sum(int(informative(r.scores, n).sum()) for r in rounds)
    return found < want and len(rounds) - 1 < max_extra


def pick_groups(rounds: list[Sampled], n: int, want: int) -> list[tuple[int, int]]:
    """(rollout index, group index) of the `want` groups the step trains on: informative
    ones first in sampling order, then uninformative ones of the earliest rollouts."""
    groups = [(i, g, bool(good)) for i, r in enumerate(rounds) for g, good in enumerate(informative(r.scores, n))]
    chosen = [(i, g) for i, g, good in groups if good][:want]
    chosen += [(i, g) for i, g, good in groups if not good][: want - len(chosen)]
    return chosen


def merge_results(results: list[RolloutResult], picks: list[tuple[int, int]], n: int) -> RolloutResult:
    """The rows of the picked groups as one host-side result; prompts are left-padded to
    the widest prompt bucket among the rollouts. Multi-turn rows keep their loss masks."""
    width = max(r.prompt_ids.shape[1] for r in results)
    names = _ROW_FIELDS + tuple(name for name in ("loss_mask", "experts") if getattr(results[0], name) is not None)
    fields = {name: [_host_rows(r, name, width) for r in results] for name in names}
    sources = [(i, row) for i, g in picks for row in range(g * n, (g + 1) * n)]
    merged = {name: np.stack([parts[i][row] for i, row in sources]) for name, parts in fields.items()}
    return RolloutResult(**merged, num_prompts=len(picks), n=n)


_ROW_FIELDS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "lengths", "sampler_logps",
               "finished")


def _host_rows(result: RolloutResult, name: str, width: int) -> np.ndarray:
    values = host_array(getattr(result, name))
    if name not in ("prompt_ids", "prompt_mask") or values.shape[1] == width:
        return values
    pad = np.zeros((values.shape[0], width - values.shape[1]), values.dtype)  # masked: any id does
    return np.concatenate([pad, values], axis=1)


def merge_scores(scores: list[Scores], picks: list[tuple[int, int]], n: int) -> Scores:
    """The scores of the picked groups' rows; error counts are summed over every rollout. A
    multi-turn row's episode values go with it (an environment value a rollout lacks is 0, as
    for a row that lacks it)."""
    def rows(arrays: list[np.ndarray]) -> np.ndarray:
        return np.concatenate([arrays[i][g * n:(g + 1) * n] for i, g in picks])

    per_fn = {name: rows([s.per_fn[name] for s in scores]) for name in scores[0].per_fn}
    errors = {name: sum(s.errors[name] for s in scores) for name in scores[0].errors}
    episode_names = sorted({name for s in scores for name in s.episodes})
    episodes = {name: rows([s.episodes.get(name, np.zeros(len(s.total), np.float32)) for s in scores])
                for name in episode_names}
    return Scores(rows([s.total for s in scores]), per_fn, errors, episodes)


def refill_metrics(rounds: list[Sampled], picks: list[tuple[int, int]], n: int) -> dict:
    """train-other/refill_* of one step."""
    found = sum(int(informative(r.scores, n).sum()) for r in rounds)
    prompts = sum(len(r.examples) for r in rounds)
    return {"train-other/refill_extra_rollouts": len(rounds) - 1,
            "train-other/refill_prompts_consumed": prompts,
            "train-other/refill_groups_dropped": prompts - found,  # zero-std groups sampled
            "train-other/refill_groups_missing": len(picks) - min(found, len(picks))}  # masked in the batch
