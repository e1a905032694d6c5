"""The LoRA update: only the adapters move (the base is an untouched, undonated argument),
the optimizer state is adapter-sized, and the step equals an independent SGD step through
the merged weights W + scale * A . B for every loss implementation, micro-batched, with
remat, and FSDP-sharded over 8 devices."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from grpo_core.models import init_from_config
from grpo_core.models import lora
from grpo_core.sharding import param_shardings, shard_model
from grpo_losses import FusedLogps, FusedOptions, PallasLogps, PallasOptions, ReferenceLogps, grpo_loss
from grpo_runner_gsm8k.training.step import make_update


def _step_tests():
    """The shared fixtures of test_step.py (model config, batches, the FSDP strategy)."""
    spec = importlib.util.spec_from_file_location("step_tests", Path(__file__).with_name("test_step.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_steps = _step_tests()
FSDP8, LOSS, QCFG, place, random_batch = _steps.FSDP8, _steps.LOSS, _steps.QCFG, _steps.place, _steps.random_batch

IMPLS = {"jax": ReferenceLogps(), "fused": FusedLogps(FusedOptions(block_size=128, time_block=4)),
         "pallas": PallasLogps(PallasOptions(block_size=128, time_block=8))}
SPEC = lora.LoRASpec(4, 8.0, lora.resolve_targets(["all-linear"]))
LR = 0.5


def lora_parts(strategy, remat="none"):
    """(base graphdef, train graphdef, base state, adapters with a random b so a has a gradient)."""
    model = init_from_config(QCFG, seed=0, remat=remat)
    if strategy is not None:
        mesh = strategy.build_mesh()
        shard_model(model, mesh, strategy.param_rules)
        model.set_activation_sharding(mesh, strategy.activation_rules)
    base_graphdef, base = nnx.split(model)
    lora.add_adapters(model, SPEC, jax.random.key(3))
    graphdef, state = nnx.split(model)
    adapters = lora.split_adapters(state)[0]
    rng = np.random.default_rng(5)
    adapters = jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.05, x.shape), jnp.float32), adapters)
    if strategy is not None:
        adapters = jax.device_put(adapters, param_shardings(adapters, mesh, strategy.param_rules))
    return base_graphdef, graphdef, base, adapters


def lora_update(impl, strategy=None, micro_batches=1, remat="none"):
    base_graphdef, graphdef, base, adapters = lora_parts(strategy, remat)
    before = jax.tree.map(np.asarray, base)
    optimizer = optax.sgd(LR)
    opt_state = optimizer.init(adapters)
    update = make_update(graphdef, IMPLS[impl], LOSS, optimizer, 1.0, micro_batches)
    batch = random_batch() if strategy is None else place(random_batch(), jax.tree.leaves(base)[0].sharding.mesh)
    new, _, metrics = update(adapters, opt_state, batch, base)
    assert float(metrics["skipped"]) == 0.0
    for b, a in zip(jax.tree.leaves(before), jax.tree.leaves(base), strict=True):
        assert np.array_equal(b, a)  # frozen and still alive (not donated)
    return jax.tree.map(np.asarray, new)


def merged_sgd_step() -> dict:
    """The reference: jax.grad of the big-batch loss through the merged weights, one SGD step."""
    base_graphdef, _, base, adapters = lora_parts(None)
    batch = random_batch()

    def loss(ad):
        model = nnx.merge(base_graphdef, lora.merged_state(base, ad, SPEC))
        hidden = model(batch.input_ids, attention_mask=batch.attention_mask)[:, batch.prompt_width - 1 : -1]
        out = grpo_loss(IMPLS["jax"], hidden, model.lm_head_weight(), batch.targets, batch.loss_mask,
                        batch.advantages, None, None, LOSS, temperature=1.0)
        return out.numerator / out.denominator

    grads = jax.grad(loss)(adapters)
    return jax.tree.map(lambda p, g: np.asarray(p - LR * g), adapters, grads)


@pytest.fixture(scope="module")
def reference():
    return merged_sgd_step()


def assert_close(actual, expected):
    # float32 sums in another order (unmerged vs merged matmuls, micro-batch regrouping)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, e, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("impl", ["jax", "fused", "pallas"])
def test_lora_update_equals_sgd_through_the_merged_weights(impl, reference):
    assert_close(lora_update(impl), reference)


@pytest.mark.parametrize("micro_batches, remat", [(2, "none"), (4, "full"), (2, "dots")])
def test_micro_batched_and_rematerialised_lora_update(micro_batches, remat, reference):
    assert_close(lora_update("fused", micro_batches=micro_batches, remat=remat), reference)


def test_fsdp_sharded_lora_update_equals_unsharded(reference):
    assert_close(lora_update("fused", FSDP8, micro_batches=2), reference)


def test_optimizer_state_is_adapter_sized():
    _, _, base, adapters = lora_parts(None)
    moments = optax.adamw(1e-3).init(adapters)
    size = lambda tree: sum(x.size for x in jax.tree.leaves(tree))  # noqa: E731
    assert size(moments) == 2 * size(adapters) + 1  # mu, nu and the step count
    assert size(adapters) < 0.1 * size(base)
