"""Example `grpo_losses` plugin: Loss implementations selectable with `loss.impl: <name>`.

A complete plugin module (register it in pyproject.toml as
`[project.entry-points.grpo] my_plugin = "my_plugin.plugin"`); tests/e2e/test_hookspec_examples.py
trains one step of the tiny config with it.
"""

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
