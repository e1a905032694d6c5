"""grpo_losses: the GRPO objective, group advantages, and per-token log-prob
implementations (`jax` reference, `fused` pure-JAX blocks, `pallas` kernels).

Typical use in a training step::

    impl = FusedLogps(FusedOptions())                # or via the `grpo` plugin registry
    old = per_token_logps(impl, hidden, lm_head, targets, temperature)
    out = grpo_loss(impl, hidden, lm_head, targets, mask, advantages, old, None, cfg,
                    temperature=temperature)
    # accumulate over micro-batches: loss = sum(out.numerator) / sum(out.denominator)
"""

from grpo_losses.advantages import Advantages, compute_advantages, group_advantages, zero_std_groups
from grpo_losses.corrections import MismatchWeights, high_entropy_tokens, mismatch_weights
from grpo_losses.fused import FusedLogps, FusedOptions
from grpo_losses.logps import TokenLogps, TokenLogpsImpl, per_token_logps
from grpo_losses.objective import (
                                   LossMetrics,
                                   LossOutput,
                                   aggregate,
                                   finalize_loss,
                                   grpo_loss,
                                   kl_estimate,
                                   loss_denominator,
                                   token_losses,
)
from grpo_losses.pallas_kernels import PallasLogps, PallasOptions, validate_block_shape
from grpo_losses.reference import ReferenceLogps

__all__ = [
                                   "Advantages",
                                   "FusedLogps",
                                   "FusedOptions",
                                   "LossMetrics",
                                   "LossOutput",
                                   "MismatchWeights",
                                   "PallasLogps",
                                   "PallasOptions",
                                   "ReferenceLogps",
                                   "TokenLogps",
                                   "TokenLogpsImpl",
                                   "aggregate",
                                   "compute_advantages",
                                   "finalize_loss",
                                   "group_advantages",
                                   "high_entropy_tokens",
                                   "grpo_loss",
                                   "kl_estimate",
                                   "loss_denominator",
                                   "mismatch_weights",
                                   "per_token_logps",
                                   "token_losses",
                                   "validate_block_shape",
                                   "zero_std_groups",
]
