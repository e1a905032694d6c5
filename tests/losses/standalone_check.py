"""Standalone check that grpo-losses works with only grpo-core installed.

CI installs just the grpo-core and grpo-losses wheels into a fresh venv and runs
    python tests/losses/standalone_check.py
which computes a `fused` GRPO loss and its gradient and prints one JSON line.
Exit status 1 when the results are not finite or the loss is zero.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from grpo_core.config import LossConfig
from grpo_losses import FusedLogps, FusedOptions, compute_advantages, grpo_loss, per_token_logps


def main() -> int:
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    batch, time, hidden_size, vocab = 4, 16, 32, 1000  # vocab not a multiple of the block
    hidden = jax.random.normal(keys[0], (batch, time, hidden_size))
    lm_head = jax.random.normal(keys[1], (hidden_size, vocab)) * 0.2
    targets = jax.random.randint(keys[2], (batch, time), 0, vocab)
    mask = (jnp.arange(time)[None, :] < jnp.array([16, 9, 4, 12])[:, None]).astype(jnp.float32)
    cfg = LossConfig(beta=0.04)
    advantages = compute_advantages(jax.random.uniform(keys[3], (batch,)), 2, cfg).advantages
    impl = FusedLogps(FusedOptions(block_size=256, time_block=32))
    old = jax.lax.stop_gradient(per_token_logps(impl, hidden, lm_head, targets))

    def loss(h, w):
        return grpo_loss(impl, h, w, targets, mask, advantages, old, old - 0.1, cfg).loss

    value, (d_hidden, d_lm_head) = jax.jit(jax.value_and_grad(loss, (0, 1)))(hidden, lm_head)
    grad_norm = float(jnp.sqrt(jnp.sum(d_hidden ** 2) + jnp.sum(d_lm_head ** 2)))
    print(json.dumps({"impl": "fused", "loss": float(value), "grad_norm": grad_norm}))
    ok = np.isfinite(float(value)) and np.isfinite(grad_norm) and float(value) != 0.0 and grad_norm > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
