"""The built-in advantage estimators (`loss.advantage_estimator`), each a
`grpo_core.contracts.AdvantageEstimator` over one step's rewards: total r [N], each reward
function's r_k [N] and the rows dynamic sampling keeps [N]; N = P * K rows, the K rows of a
prompt consecutive (its group g). Every process holds the whole global step batch, so a
statistic "over the step" is the global step's, over its kept rows.

grpo      A_i = (r_i - mean_g r) / (std + eps): std of the group, of every row of the step, or
          1 without eps (`loss.scale_rewards` group / batch / none). Shao et al. 2024,
          DeepSeekMath (arXiv 2402.03300); none is Dr.GRPO (Liu et al. 2025, arXiv 2503.20783).
rloo      A_i = r_i - 1/(K-1) sum_{j != i} r_j = K/(K-1) (r_i - mean_g r): each row's baseline is
          the mean of the other rows of its group, unscaled. Kool et al. 2019 ("Buy 4 REINFORCE
          samples, get a baseline for free!"); Ahmadian et al. 2024 (arXiv 2402.14740).
reinforce_pp_baseline
          c_i = r_i - mean_g r;  A_i = c_i / (std_step(c) + eps), the std over the step's kept
          rows. Hu et al. 2025, REINFORCE++ (arXiv 2501.03262), its group-baseline variant.
gdpo      a_ki = (r_ki - mean_g r_k) / (std_g(r_k) + eps) per reward function k;
          s_i = sum_k w_k a_ki (w_k: task.rewards);  A_i = (s_i - mean_step(s)) / (std_step(s) + eps).
          Liu et al. 2026, GDPO (arXiv 2601.05242).

Every std uses `loss.std_ddof`. rloo, reinforce_pp_baseline and gdpo give 0 to the rows of a
group whose rewards all agree (`zero_std_groups`; for gdpo per reward function), also with
`loss.advantage_eps: 0`, and 0 to rows dynamic sampling masks. grpo is the arithmetic of
`group_advantages`, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
from grpo_core import AdvantageSpec, NoOptions
from grpo_core.advantage_records import AdvantageResult, AdvantageSetup, StepRewards, grouped, zero_std_groups
from grpo_core.config import setting

from grpo_losses.advantages import group_advantages


def kept_mean(values: np.ndarray, keep: np.ndarray) -> float:
    """Mean of [N] `values` over the kept rows (0.0 when none is kept)."""
    kept = np.asarray(values, np.float64).reshape(-1)[np.asarray(keep) > 0]
    return float(kept.mean()) if kept.size else 0.0


def kept_std(values: np.ndarray, keep: np.ndarray, ddof: int) -> float:
    """Std of [N] `values` over the kept rows (0.0 when ddof leaves no degree of freedom)."""
    kept = np.asarray(values, np.float64).reshape(-1)[np.asarray(keep) > 0]
    return float(kept.std(ddof=ddof)) if kept.size > ddof else 0.0


def group_centred(rewards: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(r - mean_g r, mean_g r), both [N] float64; exactly 0 centred in groups that all agree."""
    groups = grouped(rewards, group_size).astype(np.float64)  # [P, K]
    means = np.repeat(groups.mean(axis=1), group_size)
    centred = np.where(np.repeat(zero_std_groups(rewards, group_size), group_size), 0.0,
                       groups.reshape(-1) - means)
    return centred, means


def result(advantages: np.ndarray, keep: np.ndarray, baseline: float, std: float, **more: float) -> AdvantageResult:
    """Advantages (0 on masked rows) as float32, with the metrics every estimator reports."""
    metrics = {"train-other/adv_baseline_mean": baseline, "train-other/adv_std": std}
    metrics.update({f"train-other/{name}": value for name, value in more.items()})
    return AdvantageResult(np.where(np.asarray(keep) > 0, advantages, 0.0).astype(np.float32), metrics)


def needs_groups(name: str, setup: AdvantageSetup, why: str, least: int = 2) -> None:
    """Refuses groups of fewer than `least` rows for `name` (rollout.n samples per prompt)."""
    if setup.group_size < least:
        raise ValueError(f"rollout.n = {setup.group_size}: {name} {why}; set rollout.n >= {least}")


# ---- grpo --------------------------------------------------------------------------------
@dataclass(frozen=True)
class GroupRelative:
    """grpo: today's group-relative advantage with `loss.scale_rewards`, `std_ddof`, `advantage_eps`."""

    setup: AdvantageSetup

    def __call__(self, rewards: StepRewards) -> AdvantageResult:
        s = self.setup
        advantages = np.asarray(group_advantages(np.asarray(rewards.total, np.float32), s.group_size,
                                                 scale_rewards=s.scale_rewards, std_ddof=s.std_ddof, eps=s.eps))
        _, means = group_centred(rewards.total, s.group_size)
        return AdvantageResult(advantages, {"train-other/adv_baseline_mean": kept_mean(means, rewards.keep),
                                            "train-other/adv_std": kept_mean(self.divisor(rewards.total), rewards.keep)})

    def divisor(self, total: np.ndarray) -> np.ndarray:
        """[N] the std each row was divided by (1 for scale_rewards none)."""
        groups, s = grouped(total, self.setup.group_size).astype(np.float64), self.setup
        if s.scale_rewards == "none":
            return np.ones(groups.size)
        if s.scale_rewards == "batch":
            return np.full(groups.size, groups.std(ddof=s.std_ddof))
        return np.repeat(groups.std(axis=1, ddof=s.std_ddof), s.group_size)


def build_grpo(options: NoOptions, *, setup: AdvantageSetup) -> GroupRelative:
    s = setup
    if s.scale_rewards == "group" and s.group_size <= s.std_ddof:
        raise ValueError(f"rollout.n = {s.group_size} with loss.scale_rewards = 'group': a group's std with "
                         f"loss.std_ddof = {s.std_ddof} needs at least {s.std_ddof + 1} samples; set rollout.n >= "
                         f"{s.std_ddof + 1} or loss.scale_rewards=none")
    return GroupRelative(setup)


# ---- rloo --------------------------------------------------------------------------------
@dataclass(frozen=True)
class LeaveOneOut:
    """rloo: each row's baseline is the mean of the other K - 1 rows of its group."""

    group_size: int

    def __call__(self, rewards: StepRewards) -> AdvantageResult:
        k = self.group_size
        centred, means = group_centred(rewards.total, k)
        total = np.asarray(rewards.total, np.float64)
        baselines = (k * means - total) / (k - 1)  # [N] mean of the others
        return result(centred * k / (k - 1), rewards.keep, kept_mean(baselines, rewards.keep), 1.0)


def build_rloo(options: NoOptions, *, setup: AdvantageSetup) -> LeaveOneOut:
    needs_groups("rloo", setup, "needs at least one other sample per prompt for its leave-one-out baseline")
    return LeaveOneOut(setup.group_size)


# ---- reinforce_pp_baseline ---------------------------------------------------------------
@dataclass(frozen=True)
class StepNormalised:
    """reinforce_pp_baseline: group-mean baseline, divided by the std over the step's kept rows."""

    setup: AdvantageSetup

    def __call__(self, rewards: StepRewards) -> AdvantageResult:
        centred, means = group_centred(rewards.total, self.setup.group_size)
        std = kept_std(centred, rewards.keep, self.setup.std_ddof)
        return result(centred / (std + self.setup.eps) if std > 0 else np.zeros_like(centred), rewards.keep,
                      kept_mean(means, rewards.keep), std)


def build_reinforce_pp(options: NoOptions, *, setup: AdvantageSetup) -> StepNormalised:
    needs_groups("reinforce_pp_baseline", setup, "needs at least two samples per prompt for its group-mean "
                 "baseline (with one every advantage is 0)")
    return StepNormalised(setup)


# ---- gdpo --------------------------------------------------------------------------------
@dataclass(frozen=True)
class GdpoOptions:
    """Options of the `gdpo` estimator."""

    batch_norm: bool = setting(
        True, "Normalise the weighted sum over the step's kept rows (GDPO's last step); false = the sum as is.")


@dataclass(frozen=True)
class RewardDecoupled:
    """gdpo: each reward function normalised in its group, weighted, summed, normalised over the step."""

    setup: AdvantageSetup
    options: GdpoOptions

    def __call__(self, rewards: StepRewards) -> AdvantageResult:
        s, keep = self.setup, rewards.keep
        summed, group_stds = np.zeros(np.asarray(rewards.total).size), {}
        for name, weight in s.reward_weights.items():
            normalised, std = self.normalised(rewards.per_fn[name])
            summed += weight * normalised
            group_stds[f"adv_group_std/{name}"] = kept_mean(std, keep)
        if not self.options.batch_norm:
            return result(summed, keep, 0.0, 1.0, **group_stds)
        mean, std = kept_mean(summed, keep), kept_std(summed, keep, s.std_ddof)
        advantages = (summed - mean) / (std + s.eps) if std > 0 else np.zeros_like(summed)
        return result(advantages, keep, mean, std, **group_stds)

    def normalised(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """([N] group-normalised values, [N] the group std each was divided by)."""
        k = self.setup.group_size
        centred, _ = group_centred(values, k)
        std = np.repeat(grouped(values, k).astype(np.float64).std(axis=1, ddof=self.setup.std_ddof), k)
        divisor = std + self.setup.eps
        return np.divide(centred, divisor, out=np.zeros_like(centred), where=centred != 0), std


def build_gdpo(options: GdpoOptions, *, setup: AdvantageSetup) -> RewardDecoupled:
    needs_groups("gdpo", setup, f"normalises each reward function by its group std (loss.std_ddof = "
                 f"{setup.std_ddof})", least=max(2, setup.std_ddof + 1))
    weighted = trained_rewards(setup.reward_weights)
    if len(weighted) < 2:
        raise ValueError(f"gdpo normalises each reward function on its own, but task.rewards weights "
                         f"{len(weighted)} ({', '.join(weighted) or 'none'}); with one reward function gdpo equals "
                         "grpo (then normalised over the step): set loss.advantage_estimator=grpo or add a reward "
                         "function to task.rewards")
    return RewardDecoupled(setup, options)


def trained_rewards(weights: Mapping[str, float]) -> list[str]:
    """The reward functions with a non-zero weight (weight 0 only judges answers)."""
    return [name for name, weight in weights.items() if weight != 0]


ADVANTAGE_SPECS = [
    AdvantageSpec("grpo", build_grpo, NoOptions,
                  "(r - group mean) / (std + eps), std as loss.scale_rewards says (group, batch, none)"),
    AdvantageSpec("rloo", build_rloo, NoOptions,
                  "r minus the mean of the other samples of the group (leave-one-out), unscaled"),
    AdvantageSpec("reinforce_pp_baseline", build_reinforce_pp, NoOptions,
                  "REINFORCE++-baseline: r - group mean, divided by the std over the step's kept rows"),
    AdvantageSpec("gdpo", build_gdpo, GdpoOptions,
                  "GDPO: each reward normalised in its group, weighted and summed, then normalised over the step"),
]
