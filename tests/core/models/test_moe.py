"""Qwen3-MoE: the grouped-matmul experts against a dense per-expert reference, the router and its
statistics, the family's config checks, LoRA targets and sharding (HF logits parity itself:
test_hf_io / test_hf_parity)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from grpo_core.models import QwenConfig, init_from_config, load_pretrained
from grpo_core.models import lora
from grpo_core.models.moe import SparseMoE, grouped_swiglu, route
from grpo_core.models.router_stats import router_statistics
from grpo_core.sharding import DEFAULT_RULES, param_shardings
from jax.sharding import PartitionSpec

EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 4, 2, 8, 6
# f32 on CPU: both forms sum the same products in another order; O(1) outputs differ by ~1e-7.
F32_TOL = 1e-5


def _moe(seed: int = 0) -> SparseMoE:
    moe = SparseMoE(HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, normalize=True, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    rng = np.random.RandomState(seed)
    for variable in (moe.gate.kernel, moe.experts.gate_proj, moe.experts.up_proj, moe.experts.down_proj):
        variable[...] = jnp.asarray(rng.normal(0, 0.5, variable.shape), jnp.float32)
    return moe


def dense_reference(x, weights, experts, gate, up, down):
    """Every token through each of its experts one at a time, weighted and summed (numpy, f64)."""
    x, gate, up, down = (np.asarray(a, np.float64) for a in (x, gate, up, down))
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for slot in range(experts.shape[1]):
            e = int(experts[n, slot])
            g = x[n] @ gate[e]
            h = (g / (1 + np.exp(-g))) * (x[n] @ up[e])
            out[n] += float(weights[n, slot]) * (h @ down[e])
    return out


def test_grouped_matmul_equals_dense_per_expert_reference():
    moe = _moe()
    x = jnp.asarray(np.random.RandomState(1).normal(0, 1, (3, 9, HIDDEN)), jnp.float32)  # 27 tokens
    _, weights, experts = moe.route(x.reshape(-1, HIDDEN))
    expected = dense_reference(x.reshape(-1, HIDDEN), weights, np.asarray(experts), moe.experts.gate_proj[...],
                               moe.experts.up_proj[...], moe.experts.down_proj[...])
    got = np.asarray(moe(x)).reshape(-1, HIDDEN)
    assert np.abs(got - expected).max() <= F32_TOL
    assert np.abs(expected).max() > 0.5  # outputs are O(1): the bound is relative to them


def test_unbalanced_and_empty_expert_groups():
    """Dropless: one expert takes most tokens, one none; nothing is dropped or misplaced."""
    rng = np.random.RandomState(2)
    x = jnp.asarray(rng.normal(0, 1, (10, HIDDEN)), jnp.float32)
    experts = np.array([[0, 1]] * 7 + [[1, 2], [2, 0], [0, 2]], np.int32)  # expert 3 gets no token
    gate, up = (jnp.asarray(rng.normal(0, 0.5, (EXPERTS, HIDDEN, INTERMEDIATE)), jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.normal(0, 0.5, (EXPERTS, INTERMEDIATE, HIDDEN)), jnp.float32)
    per_slot = np.asarray(grouped_swiglu(x, jnp.asarray(experts), gate, up, down))  # [N, k, H]
    for slot in range(TOP_K):
        one_hot = np.eye(TOP_K)[[slot] * len(experts)]
        expected = dense_reference(x, one_hot, experts, gate, up, down)
        assert np.abs(per_slot[:, slot] - expected).max() <= F32_TOL


def test_gradients_equal_the_dense_reference_gradients():
    """The grouped matmul's backward (ragged_dot transposes) against a one-hot dense form."""
    moe = _moe(3)
    x = jnp.asarray(np.random.RandomState(4).normal(0, 1, (12, HIDDEN)), jnp.float32)
    _, weights, experts = moe.route(x)

    def dense(gate, up, down, x):
        mask = jax.nn.one_hot(experts, EXPERTS) * weights[..., None]  # [N, k, E]
        h = jax.nn.silu(jnp.einsum("nh,ehi->nei", x, gate)) * jnp.einsum("nh,ehi->nei", x, up)
        return jnp.einsum("nke,nei,eih->nh", mask, h, down)

    def grouped(gate, up, down, x):
        return jnp.einsum("nkh,nk->nh", grouped_swiglu(x, experts, gate, up, down), weights)

    params = (moe.experts.gate_proj[...], moe.experts.up_proj[...], moe.experts.down_proj[...], x)
    loss = lambda f: lambda *p: jnp.sum(jnp.sin(f(*p)))  # noqa: E731
    for ours, theirs in zip(jax.grad(loss(grouped), argnums=(0, 1, 2, 3))(*params),
                            jax.grad(loss(dense), argnums=(0, 1, 2, 3))(*params)):
        assert np.abs(np.asarray(ours) - np.asarray(theirs)).max() <= F32_TOL


def test_router_top_k_renormalised_in_f32():
    logits = jnp.asarray([[2.0, 0.0, 1.0, -1.0], [0.0, 0.0, 3.0, 1.0]], jnp.bfloat16)
    probs, weights, experts = route(logits, 2, normalize=True)
    assert probs.dtype == jnp.float32 and experts.tolist() == [[0, 2], [2, 3]]
    e = np.exp([[2.0, 1.0], [3.0, 1.0]])
    np.testing.assert_allclose(weights, e / e.sum(-1, keepdims=True), rtol=1e-6)
    _, raw, _ = route(logits, 2, normalize=False)
    np.testing.assert_allclose(raw, np.take_along_axis(np.asarray(probs), np.asarray(experts), 1), rtol=1e-6)


def test_hf_config_names_and_round_trip():
    """transformers 5 writes num_local_experts; we write num_experts; both read back the same."""
    tiny = QwenConfig.tiny("qwen3_moe")
    d = tiny.to_hf_dict()
    assert d["architectures"] == ["Qwen3MoeForCausalLM"] and d["num_experts"] == 4 and d["mlp_only_layers"] == []
    assert QwenConfig.from_hf_dict(d) == tiny
    v5 = {k: v for k, v in d.items() if k != "num_experts"} | {"num_local_experts": 4, "output_router_logits": False}
    assert QwenConfig.from_hf_dict(v5) == tiny


@pytest.mark.parametrize("change, key", [
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"num_experts": 0}, "num_experts"),
])
def test_unsupported_moe_options_are_refused_in_one_line(change, key):
    d = QwenConfig.tiny("qwen3_moe").to_hf_dict() | change
    with pytest.raises(ValueError, match=key) as raised:
        QwenConfig.from_hf_dict(d)
    assert "\n" not in str(raised.value)


def test_dense_family_with_experts_is_refused():
    with pytest.raises(ValueError, match="num_experts=4 is not supported; supported: 0 for model_type qwen3"):
        QwenConfig.tiny("qwen3", num_experts=4)


def test_lora_targets_attention_only_and_refuses_expert_targets():
    cfg = QwenConfig.tiny("qwen3_moe")
    assert sorted(lora.layer_shapes(cfg)) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    model = init_from_config(cfg)
    spec = lora.LoRASpec(rank=2, alpha=4.0, targets=lora.resolve_targets(["all-linear"]))
    with pytest.raises(ValueError, match="LoRA target 'gate_proj' is not a dense projection of a qwen3_moe model"):
        lora.add_adapters(model, spec, jax.random.key(0))
    ids = jnp.asarray([[3, 5, 7, 9]])
    before = np.asarray(model.logits(model(ids)))
    attention = lora.LoRASpec(rank=2, alpha=4.0, targets=("q_proj", "v_proj"))
    lora.add_adapters(model, attention, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(model.logits(model(ids))), before)  # b = 0: the base exactly


def test_expert_parameters_carry_the_expert_axis_and_shard_with_default_rules(mesh8, logits_of):
    model = init_from_config(QwenConfig.tiny("qwen3_moe"))
    experts = model.layers.mlp.experts
    assert experts.gate_proj.get_metadata()["out_sharding"] == ("layers", "expert", "embed", "mlp")
    assert experts.down_proj.get_metadata()["out_sharding"] == ("layers", "expert", "mlp", "embed")
    shardings = param_shardings(nnx.state(model, nnx.Param), mesh8, DEFAULT_RULES)
    # `expert` is replicated by default (no expert-parallel axis); embed on fsdp, mlp on tp.
    spec = shardings["layers"]["mlp"]["experts"]["gate_proj"].get_value().spec
    assert spec == PartitionSpec(None, None, "fsdp", "tp")
    ids = jnp.asarray(np.random.RandomState(5).randint(1, 128, (4, 6)))
    expected = logits_of(model, ids)
    nnx.update(model, jax.tree.map(jax.device_put, nnx.state(model, nnx.Param), shardings))
    assert experts.gate_proj[...].sharding.spec == PartitionSpec(None, None, "fsdp", "tp")
    assert np.abs(logits_of(model, ids) - expected).max() <= F32_TOL  # the grouped matmul on sharded experts


def test_router_statistics_equal_transformers_on_the_golden(golden):
    """Per-layer expert load and the balancing loss (HF `aux_loss`, padding masked) of the
    committed checkpoint, against the values transformers computed (make_golden.py)."""
    path = os.path.join(golden.GOLDEN_DIR, "qwen3_moe")
    io = np.load(os.path.join(path, "io.npz"))
    stats = router_statistics(load_pretrained(path, dtype="float32"), jnp.asarray(io["input_ids"]),
                              jnp.asarray(io["attention_mask"]))
    np.testing.assert_allclose(stats.load, io["router_load"], atol=1e-6)  # shares of 42 assignments: exact
    assert abs(float(stats.balance_loss) - float(io["aux_loss"])) <= F32_TOL
    with pytest.raises(ValueError, match="model_type qwen3 has none"):
        router_statistics(init_from_config(QwenConfig.tiny("qwen3")), jnp.asarray(io["input_ids"]),
                          jnp.asarray(io["attention_mask"]))
