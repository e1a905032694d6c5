"""A `grpo_losses` plugin: a naive loss implementation (`loss.impl: naive`) that
materialises the logits; a `grpo_core.contracts.TokenLogpsImpl`."""

from dataclasses import dataclass
import jax, jax.numpy as jnp
from grpo_core import LossSpec, hookimpl
from grpo_core.contracts import TokenLogps

@dataclass(frozen=True)
class Options:
    upcast: bool = True

def build(options: Options):
    def token_logps(hidden, lm_head, targets, temperature=1.0, *, entropy=False):
        logits = jnp.einsum("bth,hv->btv", hidden, lm_head) / temperature
        if options.upcast:
            logits = logits.astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        target_logp = jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
        ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1) if entropy else None
        return TokenLogps(target_logp.astype(jnp.float32), ent)
    return token_logps

@hookimpl
def grpo_losses():
    return [LossSpec("naive", build, Options, "Naive logits-materialising loss")]
