"""The policy-gradient term of the objective, `loss.policy_loss`: clip, CISPO or SAPO.

With r the importance ratio (per token, or GSPO's per sequence; see objective.py), A the
advantage (per row or per token) and logp the token's log-prob under the current policy:

clip (PPO; GRPO, DAPO's clip-higher, GSPO):
    pg = -min(r * A, clip(r, 1 - epsilon_low, 1 + epsilon_high) * A)
    pg = min(pg, epsilon_c * |A|) where A < 0                (dual clip, when set)

cispo (MiniMax, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
Attention", arXiv:2506.13585, 2025): clip the importance-sampling weight, not the update,
and stop its gradient, so every token keeps its gradient (PPO's clip zeroes it):
    pg = -sg(min(r, eps_max)) * A * logp          eps_max = cispo_epsilon_max
d pg / d logp = -min(r, eps_max) * A (token-level r), the REINFORCE gradient reweighted by the capped ratio.
The paper tunes only the upper bound (no lower bound), as TRL's `loss_type="cispo"` does
with its cap `epsilon_high` (the eps_max of ScaleRL, Khatri et al. 2025, arXiv:2510.13786,
recommended 5.0). The loss *value* is a surrogate (A * logp), not comparable to clip's.

sapo (Soft Adaptive Policy Optimization, Gao et al., Qwen, arXiv:2511.20347, 2025): a smooth
gate replaces the hard clip,
    f_tau(r) = sigmoid(tau * (r - 1)) * 4 / tau
    pg = -f_tau(r) * A         tau = sapo_temperature_pos where A > 0, sapo_temperature_neg else
so d pg / d logp = -4 sigmoid(tau (r - 1)) (1 - sigmoid(tau (r - 1))) * r * A: equal to the
plain policy gradient at r = 1 and decaying smoothly as r leaves 1, faster for larger tau
(the paper takes tau_neg = 1.05 > tau_pos = 1.0: negative updates spread over the vocabulary
and destabilise sooner). The gate weight 4 sigmoid (1 - sigmoid) in (0, 1] is the metric.

Metrics (token sums, merged like the others): `capped`, tokens whose CISPO weight was capped
(r > eps_max, whatever A's sign); `gate_sum`, the SAPO gate weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from grpo_core.config import LossConfig

from grpo_losses.logps import Array

POLICY_LOSSES = ("clip", "cispo", "sapo")


def policy_gradient_term(ratio: Array, adv: Array, logp: Array, cfg: LossConfig) -> Array:
    """Per-token policy loss [B, T] of `cfg.policy_loss`; ratio [B, T] or [B, 1], adv [B, 1] or [B, T]."""
    if cfg.policy_loss == "clip":
        return clipped_surrogate(ratio, adv, cfg)
    if cfg.policy_loss == "cispo":
        return cispo_surrogate(ratio, adv, logp, cfg.cispo_epsilon_max)
    if cfg.policy_loss == "sapo":
        return sapo_surrogate(ratio, adv, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
    raise ValueError(f"loss.policy_loss must be one of {', '.join(POLICY_LOSSES)}, got {cfg.policy_loss!r}")


def clipped_surrogate(ratio: Array, adv: Array, cfg: LossConfig) -> Array:
    """PPO clipped policy loss, with the dual clip for negative advantages."""
    clipped = jnp.clip(ratio, 1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high)
    loss = -jnp.minimum(ratio * adv, clipped * adv)
    if cfg.epsilon_c is not None:
        loss = jnp.where(adv < 0, jnp.minimum(loss, -cfg.epsilon_c * adv), loss)
    return loss


def cispo_surrogate(ratio: Array, adv: Array, logp: Array, epsilon_max: float) -> Array:
    """-sg(min(r, eps_max)) * A * logp."""
    return -jax.lax.stop_gradient(jnp.minimum(ratio, epsilon_max)) * adv * logp


def sapo_surrogate(ratio: Array, adv: Array, temperature_pos: float, temperature_neg: float) -> Array:
    """-f_tau(r) * A with the temperature of A's sign."""
    tau = sapo_temperature(adv, temperature_pos, temperature_neg)
    return -jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv


def sapo_temperature(adv: Array, temperature_pos: float, temperature_neg: float) -> Array:
    return jnp.where(adv > 0, temperature_pos, temperature_neg)


def sapo_gate_weight(ratio: Array, adv: Array, cfg: LossConfig) -> Array:
    """d f_tau / d r = 4 sigmoid (1 - sigmoid): the gate's scale on r * A * grad logp, 1 at r = 1."""
    gate = jax.nn.sigmoid(sapo_temperature(adv, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg) * (ratio - 1.0))
    return 4.0 * gate * (1.0 - gate)


def check_policy_loss(cfg: LossConfig) -> None:
    """Combinations without a meaning, refused with what to change."""
    if cfg.policy_loss not in POLICY_LOSSES:
        raise ValueError(f"loss.policy_loss must be one of {', '.join(POLICY_LOSSES)}, got {cfg.policy_loss!r}")
    if cfg.policy_loss != "clip" and cfg.epsilon_c is not None:
        raise ValueError(f"loss.epsilon_c = {cfg.epsilon_c} is the dual clip of the clipped surrogate, but "
                         f"loss.policy_loss = {cfg.policy_loss!r} has none; set loss.epsilon_c=null")
