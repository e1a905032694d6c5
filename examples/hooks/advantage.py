"""A `grpo_advantages` plugin: rank-based advantages (`loss.advantage_estimator: group_rank`);
a `grpo_core.contracts.AdvantageEstimator`. Within each group the rewards are ranked (ties
share their mean rank) and a row's advantage is its centred rank scaled into [-1, 1]: robust
to the reward's scale and outliers."""

from dataclasses import dataclass
import numpy as np
from grpo_core import AdvantageSpec, hookimpl
from grpo_core.advantage_records import AdvantageResult, grouped, zero_std_groups

@dataclass(frozen=True)
class Options:
    scale: float = 1.0  # the largest advantage

class GroupRank:
    def __init__(self, options, *, setup):
        if setup.group_size < 2:
            raise ValueError(f"rollout.n = {setup.group_size}: group_rank ranks the samples of a prompt; "
                             "set rollout.n >= 2")
        self.scale, self.k = options.scale, setup.group_size

    def __call__(self, rewards):
        groups = grouped(rewards.total, self.k)  # [P, K]
        below = (groups[:, None, :] < groups[:, :, None]).sum(-1)  # [P, K] rows ranked lower
        ties = (groups[:, None, :] == groups[:, :, None]).sum(-1)
        ranks = below + (ties - 1) / 2  # 0 .. K-1, ties averaged
        centred = (ranks - (self.k - 1) / 2) * 2 / (self.k - 1)  # in [-1, 1]
        centred[zero_std_groups(rewards.total, self.k)] = 0.0
        advantages = (self.scale * centred).reshape(-1).astype(np.float32)
        kept = np.asarray(rewards.keep) > 0
        spread = float(np.abs(advantages[kept]).mean()) if kept.any() else 0.0
        return AdvantageResult(advantages, {"train-other/adv_rank_abs_mean": spread})

@hookimpl
def grpo_advantages():
    return [AdvantageSpec("group_rank", GroupRank, Options, "centred rank of the reward within its group")]
