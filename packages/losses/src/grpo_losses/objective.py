"""The GRPO objective: one definition of the math for every implementation.

Per token (masked positions contribute nothing):
    log r  = logp - old_logp                    (old = stop_grad(logp) when None)
             GSPO (`importance_sampling_level: sequence`): the masked mean of
             log r over the sequence, shared by all its tokens
    log r  = clip(log r, -logratio_clamp, +logratio_clamp)   when set
    pg     = the `policy_loss` term (policy_losses.py), by default PPO's clip:
             -min(r * A, clip(r, 1 - epsilon_low, 1 + epsilon_high) * A)
             with min(pg, epsilon_c * |A|) where A < 0   (dual clip, when set);
             cispo (MiniMax-M1, arXiv:2506.13585): -sg(min(r, eps_max)) * A * logp;
             sapo (Gao et al., arXiv:2511.20347): -sigmoid(tau (r - 1)) * 4 / tau * A
    pg     = pg * w_mismatch * selected          (both off by default; see corrections.py)
    loss   = pg + beta * KL_k(policy || ref) - entropy_coef * entropy
with KL estimators on log q = ref_logp - logp:  k1 = -log q,  k2 = (log q)^2 / 2,
k3 = exp(log q) - log q - 1; with `kl_importance_weighted` the estimate is
multiplied by the ratio r above (differentiable, as TRL's
`use_bias_correction_kl` does: samples come from the old policy, so r * k
estimates the KL under the current one), and the `kl_mean` metric reports that
product. The entropy bonus is part of the per-token loss, so it is aggregated
exactly like the loss (e.g. per-sequence means for seq_mean_token_mean), not as
a separate token mean.

A is the row's advantage on each of its tokens, or the token's own advantage when
advantages are given per token [B, T] (e.g. a teacher's per-token signal in on-policy
distillation); a per-token A constant along its row is exactly the per-row case. With
GSPO's sequence ratio s_i, a per-token advantage keeps its own sign in the clip:
pg_t = -min(s_i * A_t, clip(s_i) * A_t), so every token still shares s_i's gradient.

Exact gradient accumulation. `grpo_loss` returns a `numerator` and a
`denominator` per micro-batch; the big-batch loss is
    sum_k numerator_k / sum_k denominator_k
for every aggregation, because each denominator counts only things a
micro-batch owns (micro-batches split whole sequences):
    token_mean           num = sum m*l                      den = sum m (tokens)
    seq_mean_token_mean  num = sum_i (sum_t m*l / n_i)      den = #sequences
    seq_mean_token_sum   num = sum m*l                      den = #sequences
    fixed_length_norm    num = sum m*l                      den = #sequences * max_completion_length
(n_i = tokens of sequence i; a sequence counts when it has >= 1 unmasked token,
so padding rows and groups dropped by dynamic sampling count nowhere; TRL's
formulas count every row, which is the same whenever no row is fully masked.)
Denominators depend on the mask only, so the runner may compute the total up
front with `loss_denominator` and differentiate each numerator_k / total, or
sum grad(numerator_k) and divide once at the end.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from grpo_core.config import LossConfig

from grpo_losses.corrections import MismatchWeights, high_entropy_tokens, mismatch_weights
from grpo_losses.logps import Array, TokenLogpsImpl
from grpo_losses.policy_losses import check_policy_loss, policy_gradient_term, sapo_gate_weight

F32 = jnp.float32


class LossMetrics(NamedTuple):
    """Sums over unmasked tokens, so micro-batches merge exactly (`merge`) before
    `summary()` turns them into means. `kl_sum` is None without ref_logp,
    `entropy_sum` None unless entropy was computed; the mismatch sums are None
    without `mismatch_correction`, `selected` None without entropy selection."""

    tokens: Array
    clip_low: Array  # tokens with A < 0 and r < 1 - epsilon_low
    clip_high: Array  # tokens with A > 0 and r > 1 + epsilon_high
    ratio_sum: Array
    ratio_min: Array  # +inf when no token is unmasked
    ratio_max: Array  # -inf when no token is unmasked
    kl_sum: Array | None = None
    entropy_sum: Array | None = None
    mismatch_kl_sum: Array | None = None  # k3 KL(sampler || train) per token
    mismatch_ratio_sum: Array | None = None
    mismatch_ratio_max: Array | None = None  # -inf when no token is unmasked
    mismatch_rejected: Array | None = None  # tokens whose weight was truncated or masked
    selected: Array | None = None  # tokens kept by high-entropy selection
    capped: Array | None = None  # cispo: tokens whose importance weight was capped at cispo_epsilon_max
    gate_sum: Array | None = None  # sapo: sum of the gate weights 4 sigmoid (1 - sigmoid)
    distill_kl_sum: Array | None = None  # teacher.estimator full: sum of the exact reverse KL (grpo_losses.full_kl)

    def merge(self, other: LossMetrics) -> LossMetrics:
        """The metrics of both micro-batches together."""
        def combine(name, a, b):
            if a is None:
                return None
            maxima = {"ratio_min": jnp.minimum, "ratio_max": jnp.maximum, "mismatch_ratio_max": jnp.maximum}
            return maxima.get(name, jnp.add)(a, b)

        return LossMetrics(*(combine(name, a, b) for name, a, b in zip(self._fields, self, other)))

    def summary(self) -> dict[str, Array]:
        """clip_frac_low/high, ratio_mean/min/max, and where available kl_mean, entropy_mean,
        mismatch_kl/ratio_mean/ratio_max/rejected_frac, entropy_selected_frac, cispo_capped_frac,
        sapo_gate_mean, distill_full_kl."""
        tokens = jnp.maximum(self.tokens, 1.0)
        out = {"clip_frac_low": self.clip_low / tokens, "clip_frac_high": self.clip_high / tokens,
               "ratio_mean": self.ratio_sum / tokens, "ratio_min": self.ratio_min, "ratio_max": self.ratio_max}
        if self.kl_sum is not None:
            out["kl_mean"] = self.kl_sum / tokens
        if self.entropy_sum is not None:
            out["entropy_mean"] = self.entropy_sum / tokens
        if self.mismatch_kl_sum is not None:
            out.update(mismatch_kl=self.mismatch_kl_sum / tokens, mismatch_ratio_mean=self.mismatch_ratio_sum / tokens,
                       mismatch_ratio_max=self.mismatch_ratio_max, mismatch_rejected_frac=self.mismatch_rejected / tokens)
        optional = {"entropy_selected_frac": self.selected, "cispo_capped_frac": self.capped,
                    "sapo_gate_mean": self.gate_sum, "distill_full_kl": self.distill_kl_sum}
        out.update({name: value / tokens for name, value in optional.items() if value is not None})
        return out


class LossOutput(NamedTuple):
    """What `grpo_loss` returns for one micro-batch.

    numerator, denominator: float32 scalars; loss = sum numerators / sum denominators.
    logp: per-token log-probs [B, T] float32 (differentiable).
    metrics: `LossMetrics` sums.
    """

    numerator: Array
    denominator: Array
    logp: Array
    metrics: LossMetrics

    @property
    def loss(self) -> Array:
        """The loss of this micro-batch alone (= the batch loss when there is one)."""
        return finalize_loss(self.numerator, self.denominator)


def finalize_loss(numerator: Array, denominator: Array) -> Array:
    """numerator / denominator; 0 when nothing is unmasked (denominators are counts)."""
    return numerator / jnp.maximum(denominator, 1.0)


def grpo_loss(impl: TokenLogpsImpl, hidden: Array, lm_head: Array, targets: Array, mask: Array,
              advantages: Array, old_logp: Array | None, ref_logp: Array | None, cfg: LossConfig,
              *, temperature: float | Array = 1.0, sampler_logp: Array | None = None) -> LossOutput:
    """The GRPO loss of one micro-batch through `impl`.

    hidden [B, T, H] (states that predict `targets`, i.e. already shifted),
    lm_head [H, V], targets [B, T] int, mask [B, T] (1 = completion token),
    advantages [B] (per row) or [B, T] (per token, like the mask), old_logp /
    ref_logp [B, T] float32 or None (None old means on-policy: ratio 1 with the
    policy gradient intact), temperature = the sampling temperature, sampler_logp
    [B, T] the rollout's log-probs (needed by `mismatch_correction` only).
    Differentiate `numerator` (see module doc).

    Implementations with a one-pass gradient (`impl.one_pass`, e.g. `fused`) get
    the whole per-token objective when every per-token term depends on its own
    token alone: they form the gradient while computing the logits, and `logp`
    then carries no gradient.
    """
    _check_config(cfg, ref_logp)
    check_policy_loss(cfg)
    row_or_token_advantages(advantages, mask)  # a wrong shape fails here, before any compute
    need_entropy = cfg.compute_entropy or cfg.entropy_coef > 0 or cfg.top_entropy_quantile < 1.0
    mask = mask.astype(F32)
    if getattr(impl, "one_pass", False) and is_elementwise(cfg):
        terms = TokenTerms.of(mask, advantages, old_logp, ref_logp, cfg, sampler_logp)
        numerator, out = impl.loss_numerator(hidden, lm_head, targets, temperature, terms,
                                             weighted_token_loss(cfg), entropy=need_entropy,
                                             entropy_grad=cfg.entropy_coef > 0)
        _, metrics = token_losses(out.logp, out.entropy, mask, advantages, old_logp, ref_logp, cfg,
                                  sampler_logp=sampler_logp)
        return LossOutput(numerator, loss_denominator(mask, cfg), out.logp, metrics)
    out = impl(hidden, lm_head, targets, temperature, entropy=need_entropy)
    entropy = out.entropy if cfg.entropy_coef > 0 else _metric_only(out.entropy)
    selected = None if cfg.top_entropy_quantile >= 1.0 else high_entropy_tokens(out.entropy, mask, cfg.top_entropy_quantile)
    per_token, metrics = token_losses(out.logp, entropy, mask, advantages, old_logp, ref_logp, cfg,
                                      sampler_logp=sampler_logp, selected=selected)
    numerator, denominator = aggregate(per_token, mask, cfg)
    return LossOutput(numerator, denominator, out.logp, metrics)


def is_elementwise(cfg: LossConfig) -> bool:
    """Whether each token's loss depends on its own token only (no sequence-level ratio or
    weight, no batch-wide entropy threshold): what a one-pass gradient needs."""
    sequence_weight = cfg.mismatch_correction != "none" and cfg.mismatch_level == "sequence"
    return (cfg.importance_sampling_level == "token" and not sequence_weight
            and cfg.top_entropy_quantile >= 1.0)


class TokenTerms(NamedTuple):
    """Everything the per-token loss needs besides logp and entropy, each [B, T]
    (the layout the one-pass kernels slice into token blocks)."""

    mask: Array
    advantage: Array  # the token's advantage (the row's, repeated, for per-row advantages)
    weight: Array  # d numerator / d per-token loss (see `token_weights`)
    old_logp: Array | None
    ref_logp: Array | None
    sampler_logp: Array | None = None

    @classmethod
    def of(cls, mask: Array, advantages: Array, old_logp: Array | None, ref_logp: Array | None,
           cfg: LossConfig, sampler_logp: Array | None = None) -> TokenTerms:
        advantage = jnp.broadcast_to(row_or_token_advantages(advantages, mask), mask.shape)
        return cls(mask, advantage, token_weights(mask, cfg), old_logp, ref_logp, sampler_logp)


def weighted_token_loss(cfg: LossConfig):
    """(logp, entropy, TokenTerms) -> per-token contribution to the numerator, any
    shape; sums to `aggregate`'s numerator. Token-level ratios only: each token's
    value depends on its own logp and entropy, so its gradient is elementwise."""
    def loss(logp: Array, entropy: Array | None, terms: TokenTerms) -> Array:
        entropy = entropy if cfg.entropy_coef > 0 else _metric_only(entropy)
        per_token, _ = token_losses(logp, entropy, terms.mask, terms.advantage, terms.old_logp, terms.ref_logp, cfg,
                                    sampler_logp=terms.sampler_logp)
        return per_token * terms.weight

    return loss


def _metric_only(entropy: Array | None) -> Array | None:
    return None if entropy is None else jax.lax.stop_gradient(entropy)


def _check_config(cfg: LossConfig, ref_logp: Array | None) -> None:
    if cfg.beta > 0 and ref_logp is None:
        raise ValueError(f"loss.beta is {cfg.beta} but ref_logp is None; pass reference log-probs "
                         "(per_token_logps of the reference model) or set loss.beta: 0")
    if cfg.aggregation == "fixed_length_norm" and cfg.max_completion_length is None:
        raise ValueError("loss.aggregation is fixed_length_norm but loss.max_completion_length is null; "
                         "set it (the runner fills it from rollout.max_new_tokens)")


def token_losses(logp: Array, entropy: Array | None, mask: Array, advantages: Array,
                 old_logp: Array | None, ref_logp: Array | None, cfg: LossConfig, *,
                 sampler_logp: Array | None = None, selected: Array | None = None) -> tuple[Array, LossMetrics]:
    """Per-token loss [B, T] (zero where mask is 0) and the metric sums.
    advantages: [B] (per row) or [B, T] (per token); selected [B, T]: the high-entropy
    selection (None = every token)."""
    ratio = importance_ratio(logp, old_logp, mask, cfg)  # [B, T] or [B, 1]
    adv = row_or_token_advantages(advantages, mask)  # [B, 1] or [B, T]
    per_token = policy_gradient_term(ratio, adv, logp, cfg)
    mismatch = None
    if cfg.mismatch_correction != "none":
        mismatch = mismatch_weights(logp if old_logp is None else old_logp, sampler_logp, mask, cfg)
        per_token = per_token * mismatch.weight
    if selected is not None:
        per_token = per_token * selected
    kl = None if ref_logp is None else kl_estimate(logp, ref_logp, mask, cfg.kl_estimator)
    if kl is not None and cfg.kl_importance_weighted:
        kl = kl * ratio
    if cfg.beta > 0:
        per_token = per_token + cfg.beta * kl
    if cfg.entropy_coef > 0:
        per_token = per_token - cfg.entropy_coef * entropy
    ratio = jnp.broadcast_to(ratio, logp.shape)
    metrics = _policy_metrics(_metrics(ratio, adv, mask, kl, entropy if cfg.compute_entropy else None, cfg),
                              ratio, adv, mask, cfg)
    return per_token * mask, _with_selection_metrics(metrics, mask, mismatch, selected)


def row_or_token_advantages(advantages: Array, mask: Array) -> Array:
    """float32 advantages shaped to broadcast against the mask [B, T]: [B, 1] from per-row
    [B], [B, T] as given."""
    if advantages.shape == mask.shape[:1]:
        return advantages.astype(F32)[:, None]
    if advantages.shape == mask.shape:
        return advantages.astype(F32)
    raise ValueError(f"advantages have shape {tuple(advantages.shape)} but the mask is {tuple(mask.shape)}; pass "
                     f"one per row {tuple(mask.shape[:1])} or one per token {tuple(mask.shape)}")


def importance_ratio(logp: Array, old_logp: Array | None, mask: Array, cfg: LossConfig) -> Array:
    """exp(log r): per token [B, T], or per sequence [B, 1] for GSPO."""
    old = jax.lax.stop_gradient(logp) if old_logp is None else old_logp
    log_ratio = jnp.where(mask > 0, logp - old, 0.0)  # padding may hold any old_logp
    if cfg.importance_sampling_level == "sequence":
        log_ratio = jnp.sum(log_ratio, axis=1, keepdims=True) / _tokens_per_sequence(mask)
    if cfg.logratio_clamp is not None:
        log_ratio = jnp.clip(log_ratio, -cfg.logratio_clamp, cfg.logratio_clamp)
    return jnp.exp(log_ratio)


def kl_estimate(logp: Array, ref_logp: Array, mask: Array, estimator: str) -> Array:
    """Per-token estimate of KL(policy || reference) [B, T] (Schulman's k1/k2/k3)."""
    log_q = jnp.where(mask > 0, ref_logp - logp, 0.0)  # padding may hold any ref_logp
    if estimator == "k1":
        return -log_q
    if estimator == "k2":
        return 0.5 * jnp.square(log_q)
    if estimator == "k3":
        return jnp.exp(log_q) - log_q - 1.0
    raise ValueError(f"loss.kl_estimator must be k1, k2 or k3, got {estimator!r}")


def aggregate(per_token: Array, mask: Array, cfg: LossConfig) -> tuple[Array, Array]:
    """(numerator, denominator) of the configured aggregation (see module doc)."""
    return jnp.sum(per_token * token_weights(mask, cfg)), loss_denominator(mask, cfg)


def token_weights(mask: Array, cfg: LossConfig) -> Array:
    """[B, T] weight of each per-token loss in the numerator: the mask, divided by
    the sequence's token count for seq_mean_token_mean. Depends on the mask only."""
    if cfg.aggregation == "seq_mean_token_mean":
        return mask / _tokens_per_sequence(mask)
    if cfg.aggregation not in ("token_mean", "seq_mean_token_sum", "fixed_length_norm"):
        raise ValueError(f"unknown loss.aggregation {cfg.aggregation!r}; use token_mean, seq_mean_token_mean, "
                         "seq_mean_token_sum or fixed_length_norm")
    return mask


def loss_denominator(mask: Array, cfg: LossConfig) -> Array:
    """The denominator of `aggregate` for this mask [B, T]; additive over micro-batches."""
    mask = mask.astype(F32)
    if cfg.aggregation == "token_mean":
        return jnp.sum(mask)
    sequences = jnp.sum(jnp.any(mask > 0, axis=1).astype(F32))
    if cfg.aggregation == "fixed_length_norm":
        if cfg.max_completion_length is None:
            raise ValueError("fixed_length_norm needs loss.max_completion_length (got null)")
        return sequences * cfg.max_completion_length
    return sequences


def _tokens_per_sequence(mask: Array) -> Array:
    return jnp.maximum(jnp.sum(mask, axis=1, keepdims=True), 1.0)  # [B, 1]


def _metrics(ratio: Array, adv: Array, mask: Array, kl: Array | None, entropy: Array | None,
             cfg: LossConfig) -> LossMetrics:
    ratio = jax.lax.stop_gradient(ratio)
    low = (ratio < 1.0 - cfg.epsilon_low) & (adv < 0)
    high = (ratio > 1.0 + cfg.epsilon_high) & (adv > 0)
    valid = mask > 0
    return LossMetrics(
        tokens=jnp.sum(mask), clip_low=jnp.sum(low * mask), clip_high=jnp.sum(high * mask),
        ratio_sum=jnp.sum(ratio * mask),
        ratio_min=jnp.min(jnp.where(valid, ratio, jnp.inf)), ratio_max=jnp.max(jnp.where(valid, ratio, -jnp.inf)),
        kl_sum=None if kl is None else jnp.sum(jax.lax.stop_gradient(kl) * mask),
        entropy_sum=None if entropy is None else jnp.sum(jax.lax.stop_gradient(entropy) * mask))


def _policy_metrics(metrics: LossMetrics, ratio: Array, adv: Array, mask: Array, cfg: LossConfig) -> LossMetrics:
    """`metrics` plus the sums of the cispo / sapo policy loss in use (ratio [B, T])."""
    ratio = jax.lax.stop_gradient(ratio)
    if cfg.policy_loss == "cispo":
        return metrics._replace(capped=jnp.sum((ratio > cfg.cispo_epsilon_max) * mask))
    if cfg.policy_loss == "sapo":
        return metrics._replace(gate_sum=jnp.sum(sapo_gate_weight(ratio, adv, cfg) * mask))
    return metrics


def _with_selection_metrics(metrics: LossMetrics, mask: Array, mismatch: MismatchWeights | None,
                            selected: Array | None) -> LossMetrics:
    """`metrics` plus the sums of the mismatch correction and entropy selection in use."""
    if mismatch is not None:
        ratio = jnp.broadcast_to(mismatch.ratio, mask.shape)
        metrics = metrics._replace(
            mismatch_kl_sum=jnp.sum(mismatch.token_kl * mask),
            mismatch_ratio_sum=jnp.sum(jnp.where(mask > 0, ratio, 0.0)),  # a sequence ratio may be inf
            mismatch_ratio_max=jnp.max(jnp.where(mask > 0, ratio, -jnp.inf)),
            mismatch_rejected=jnp.sum(jnp.broadcast_to(mismatch.rejected, mask.shape) * mask))
    if selected is not None:
        metrics = metrics._replace(selected=jnp.sum(selected * mask))
    return metrics
