"""Qwen2 / Qwen2.5 / Qwen3 decoder in Flax NNX, numerically matching HF transformers.

Parameter tree (mirrors the HF module names; kernels are [in..., out...]). The decoder
layers are one DecoderLayer whose parameters are stacked over a leading `layers` axis
(logical name `layers`, never sharded), so the forward pass is one `lax.scan` and its
compile time does not grow with depth; `layers.X` below is [L, ...X's own shape]:

    embed_tokens.embedding                   [V, H]      (vocab, embed)
    layers.input_layernorm.scale          [H]         (norm,)
    layers.self_attn.q_proj.kernel        [H, N, D]   (embed, heads, head_dim)
    layers.self_attn.q_proj.bias          [N, D]      (heads, head_dim)        qwen2 / qwen3+attention_bias
    layers.self_attn.{k,v}_proj.kernel    [H, KV, D]  (embed, kv_heads, head_dim)
    layers.self_attn.{k,v}_proj.bias      [KV, D]     (kv_heads, head_dim)
    layers.self_attn.o_proj.kernel        [N, D, H]   (heads, head_dim, embed)
    layers.self_attn.o_proj.bias          [H]         (embed,)                 qwen3+attention_bias only
    layers.self_attn.{q,k}_norm.scale     [D]         (norm,)                  qwen3 only
    layers.post_attention_layernorm.scale [H]         (norm,)
    layers.{pre,post}_feedforward_layernorm.scale [H] (norm,)                  gemma3_text only
    layers.mlp.{gate,up}_proj.kernel      [H, I]      (embed, mlp)
    layers.mlp.down_proj.kernel           [I, H]      (mlp, embed)
    (qwen3_moe: layers.mlp is grpo_core.models.moe.SparseMoE, its parameters listed there)
    norm.scale                               [H]         (norm,)
    lm_head.kernel                           [H, V]      (embed, vocab)           untied only
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from grpo_core.models.attention import Attention, KVCache
from grpo_core.models.kv_quant import STORED as QUANTIZED_CACHES
from grpo_core.models.attention_impls import CausalMask, check_attention
from grpo_core.models.config import QwenConfig
from grpo_core.models.layer_grads import scan_accumulating
from grpo_core.models.layers import MLP, Embedding, Projection, RMSNorm, contract_f32, rope_tables
from grpo_core.sharding import Rules, check_auto_mesh, divides, freeze_rules, logical_to_spec

REMAT_POLICIES = {
    # Keep projection matmul outputs, recompute attention and elementwise ops.
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Save nothing inside a layer: only its input survives the forward pass.
    "full": jax.checkpoint_policies.nothing_saveable,
}
REMAT_MODES = ("none", *REMAT_POLICIES)

# Logical names of the residual stream [B, T, H]; `act_embed` is separate from the
# parameter axis `embed` so FSDP rules (embed -> fsdp) do not shard activations' hidden dim.
ACTIVATION_AXES = ("batch", "length", "act_embed")

# The window of a global layer beside sliding ones: longer than any sequence.
GLOBAL_WINDOW = 2**30

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(dtype: Any) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; use one of {', '.join(DTYPES)}.")
        return jnp.dtype(DTYPES[dtype])
    return jnp.dtype(dtype)


def check_remat(remat: str) -> str:
    if remat not in REMAT_MODES:
        raise ValueError(f"remat={remat!r} is not supported; use one of {', '.join(REMAT_MODES)}.")
    return remat


def positions_from_mask(token_mask: jax.Array) -> jax.Array:
    """[B, T] positions counting only real tokens: cumsum(mask) - 1, clipped at 0."""
    return jnp.maximum(jnp.cumsum(token_mask.astype(jnp.int32), axis=1) - 1, 0)


def _norm(cfg: QwenConfig, dtype, rngs: nnx.Rngs) -> RMSNorm:
    return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, rngs=rngs, adds_one=cfg.family.norm_adds_one(cfg))


class DecoderLayer(nnx.Module):
    """Pre-norm block; with the family's post-norms (Gemma) post_attention_layernorm norms the
    attention output and pre/post_feedforward_layernorm the MLP's input and output."""

    def __init__(self, cfg: QwenConfig, *, dtype, rngs: nnx.Rngs):
        self.input_layernorm = _norm(cfg, dtype, rngs)
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = _norm(cfg, dtype, rngs)
        post_norms = cfg.family.post_norms(cfg)
        self.pre_feedforward_layernorm = _norm(cfg, dtype, rngs) if post_norms else None
        # A family may replace the MLP block (qwen3_moe: routed experts); else the shared gated MLP.
        family_mlp = cfg.family.mlp(cfg, dtype=dtype, rngs=rngs)
        self.mlp = family_mlp if family_mlp is not None else MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype,
                                                                 rngs=rngs, activation=cfg.hidden_act)
        self.post_feedforward_layernorm = _norm(cfg, dtype, rngs) if post_norms else None

    def __call__(self, x, cos, sin, visible, cache: KVCache | None = None, layer: int = 0, replay=None):
        attn_out, cache = self.self_attn(self.input_layernorm(x), cos, sin, visible, cache, layer)
        return self.add_mlp(self.add_attention(x, attn_out), replay=replay), cache

    def add_attention(self, x, attn_out):
        """The residual x plus the attention output (normed first with post-norms)."""
        if self.pre_feedforward_layernorm is None:
            return x + attn_out
        return x + self.post_attention_layernorm(attn_out)

    def add_mlp(self, x, reduce=lambda y: y, replay=None):
        """The residual x plus the MLP of the normed x; `reduce` completes the MLP's output before it
        is normed or added (a model-parallel decode's all-reduce of partial sums). `replay`: a sparse
        MLP's recorded experts [..., k] (routing replay; grpo_core.models.moe.replayed)."""
        return self.add_routed_mlp(x, reduce, replay)[0]

    def add_routed_mlp(self, x, reduce=lambda y: y, replay=None):
        """(`add_mlp`, the experts a sparse MLP sent each token to [N, k], or None for a dense MLP)."""
        routed = getattr(self.mlp, "routed", None)
        normed = self.post_attention_layernorm(x) if self.pre_feedforward_layernorm is None else \
            self.pre_feedforward_layernorm(x)
        out, experts = routed(normed, replay) if routed is not None else (self.mlp(normed), None)
        if self.pre_feedforward_layernorm is None:
            return x + reduce(out), experts
        return x + self.post_feedforward_layernorm(reduce(out)), experts


def stack_layers(layers: list[DecoderLayer]) -> DecoderLayer:
    """One DecoderLayer whose every parameter is the stack [L, ...] of `layers`' own,
    with the logical axis `layers` prepended to its names."""
    graphdef, _ = nnx.split(layers[0])
    states = [nnx.state(layer) for layer in layers]

    def stack(*variables):
        names = variables[0].get_metadata()["out_sharding"]
        value = jnp.stack([v.get_value() for v in variables])
        return variables[0].replace(value, out_sharding=("layers", *names))

    stacked = jax.tree.map(stack, *states, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, stacked)


class QwenModel(nnx.Module):
    """Decoder returning final hidden states; the LM head is applied separately.

    Cache-free (training / scoring):

        hidden = model(input_ids, attention_mask=mask)          # [B, T, H]
        logits = model.logits(hidden)                           # [B, T, V] f32

    A mixture-of-experts model takes `routing=` [B, T, L, k] int (-1: none), the experts each token
    was sent to in each layer in the rollout, and replays them (grpo_core.models.moe.replayed).

    Left padding is handled by the mask: positions are cumsum(mask) - 1, so a padded
    row gives the same hidden states on its real tokens as the unpadded row.

    KV-cached (rollout) contract:

        cache = model.init_cache(batch, max_len)                # index 0, empty mask
        hidden, cache = model(prompt_ids, attention_mask=prompt_mask, cache=cache)
        # step: ids [B, 1], mask [B, 1] (0 for rows that finished: slot stays invisible)
        hidden, cache = model(ids, attention_mask=step_mask, cache=cache)

    A call with a cache writes its T tokens to slots [cache.index, cache.index + T) of
    every row, marks those slots real where attention_mask is 1, attends over the whole
    cache (static shapes: [B, T, S_max] visibility, no repeated K/V) and returns the
    cache with index advanced by T. Positions default to cache.lengths() plus the
    running count of real tokens in the call; pass `positions` [B, T] to override.
    The caller keeps cache.index + T <= max_len (slices past the end are clamped by
    XLA, not checked). Shapes are static, so a jitted step can donate the cache:

        graphdef, state = nnx.split(model)
        @functools.partial(jax.jit, donate_argnums=2)
        def step(state, ids, cache, mask):
            return nnx.merge(graphdef, state)(ids, attention_mask=mask, cache=cache)

    which is the body a `lax.while_loop` sampler runs; with T = 1 the attention is a
    single-query [B, KV, G, 1, S_max] product.
    """

    def __init__(
        self, cfg: QwenConfig, *, dtype: Any = "float32", rngs: nnx.Rngs, remat: str = "none", scan_layers: bool = True
    ):
        dtype = resolve_dtype(dtype)
        self.config = cfg
        self.remat = check_remat(remat)
        self.scan_layers = scan_layers  # False: a Python loop over layers (same params), for debugging
        self.activation_sharding = None  # (mesh, rules) once sharded; see set_activation_sharding
        self.attention = "xla"  # multi-token attention implementation; see set_attention
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        # Built one by one (so random init draws as an unstacked model would), then stacked.
        self.layers = stack_layers([DecoderLayer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_hidden_layers)])
        self.norm = _norm(cfg, dtype, rngs)
        untied = not cfg.tie_word_embeddings
        self.lm_head = (
            Projection((cfg.hidden_size,), (cfg.vocab_size,), ("embed", "vocab"), bias=False, dtype=dtype, rngs=rngs)
            if untied
            else None
        )

    @property
    def dtype(self) -> jnp.dtype:
        return self.embed_tokens.embedding.dtype

    def set_activation_sharding(self, mesh: Mesh | None, rules: Rules | None = None) -> None:
        """Constrain the residual stream [B, T, H] to logical axes ACTIVATION_AXES on
        `mesh` (None turns it off). Nothing is constrained when the rules map none of
        them, or when a dimension does not divide its mesh axes (propagation decides)."""
        if mesh is not None:
            check_auto_mesh(mesh)
        self.activation_sharding = None if mesh is None else (mesh, freeze_rules(rules or ()))
        # A sparse MLP splits its experts over the axis the rules give `expert` (expert parallelism).
        set_expert_parallel = getattr(self.layers.mlp, "set_expert_parallel", None)
        if set_expert_parallel is not None:
            set_expert_parallel(mesh, rules)

    def set_attention(self, name: str) -> None:
        """Multi-token attention implementation (attention_impls: xla, chunked, splash,
        cudnn; resolve 'auto' with resolve_attention first)."""
        if check_attention(name) == "auto":
            raise ValueError("set_attention needs a resolved implementation; call resolve_attention('auto', dtype).")
        self.attention = name

    def _mask(self, real: jax.Array, offset: jax.Array | None = None) -> CausalMask:
        return CausalMask(real, offset, impl=self.attention, sharding=self.activation_sharding)

    def _constrain(self, x: jax.Array) -> jax.Array:
        if self.activation_sharding is None:
            return x
        mesh, rules = self.activation_sharding
        spec = logical_to_spec(ACTIVATION_AXES, rules)
        if all(axes is None for axes in spec) or not divides(x.shape, spec, mesh):
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    def lm_head_weight(self) -> jax.Array:
        """[H, V]: the untied head, or the tied embedding transposed."""
        if self.lm_head is not None:
            return self.lm_head.kernel[...]
        return self.embed_tokens.embedding[...].T

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[B, T, H] -> [B, T, V] in f32 (f32 accumulation whatever the param dtype)."""
        head = self.lm_head.kernel.get_value() if self.lm_head is not None else self.lm_head_weight()
        return contract_f32(hidden, head, ((2,), (0,)))

    def init_cache(self, batch: int, max_len: int, dtype: Any = None) -> KVCache:
        """dtype: of the keys and values; None, the model's; "int8" | "fp8", 8-bit read back in the model's (kv_quant)."""
        if dtype in QUANTIZED_CACHES:
            return KVCache.zeros(self.config, batch, max_len, self.dtype, quantized=dtype)
        return KVCache.zeros(self.config, batch, max_len, resolve_dtype(dtype) if dtype else self.dtype)

    def __call__(self, input_ids, attention_mask=None, *, positions=None, cache: KVCache | None = None,
                 routing=None):
        token_mask = (
            jnp.ones(input_ids.shape, jnp.bool_) if attention_mask is None else attention_mask.astype(jnp.bool_)
        )
        if positions is None:
            positions = positions_from_mask(token_mask)
            if cache is not None:
                positions = positions + cache.lengths()[:, None]
        x, cos, sin = self._embedded(input_ids, positions)
        if cache is None:
            visible = self._mask(token_mask)

            def step(layer, i, x):
                replay = layer_routing(routing, i)
                return self._constrain(layer(x, *self.layer_context(i, cos, sin, visible), replay=replay)[0])

            return self.norm(self.over_layers(step, x, remat=self.remat))
        cache = cache.with_new_tokens(token_mask)
        visible = self._mask(cache.mask, cache.index)

        def cached_step(layer, i, carry):
            x, cache = layer(carry[0], *self.layer_context(i, cos, sin, visible), carry[1], i)
            return self._constrain(x), cache

        x, cache = self.over_layers(cached_step, (x, cache))
        return self.norm(x), cache.advance(input_ids.shape[1])

    def _embedded(self, input_ids, positions) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(residual stream [B, T, H], rope cos, sin [B, T, D/2]) of the tokens at `positions`;
        with sliding-window layers cos and sin are [2, B, T, D/2]: global, then sliding tables."""
        cos, sin = self.rope(positions)
        return self._constrain(self.scale_embeddings(self.embed_tokens(input_ids))), cos, sin

    def rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """RoPE (cos, sin) [B, T, D/2] at positions [B, T]; with sliding-window layers
        [2, B, T, D/2]: the global tables, then the sliding layers' (`layer_tables` picks)."""
        cfg = self.config
        cos, sin = rope_tables(positions, cfg.rope_frequencies())
        if cfg.sliding_windows is not None:
            local_cos, local_sin = rope_tables(positions, cfg.family.sliding_rope_frequencies(cfg))
            cos, sin = jnp.stack([cos, local_cos]), jnp.stack([sin, local_sin])
        return cos, sin

    def scale_embeddings(self, x: jax.Array) -> jax.Array:
        """Token embeddings times the family's factor (none for most)."""
        scale = self.config.family.embedding_scale(self.config)
        if scale is None:
            return x
        return x * jnp.asarray(scale, x.dtype)  # rounded to the model dtype first, as HF does

    def layer_tables(self, i: jax.Array, cos, sin) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """(cos, sin, window) of layer i (traced) from `rope`'s tables: a sliding-window layer's own
        RoPE tables and its window, a global layer's with GLOBAL_WINDOW; without sliding layers the
        tables as they are and window None."""
        windows = self.config.sliding_windows
        if windows is None:
            return cos, sin, None
        window = jnp.asarray(windows, jnp.int32)[i]
        sliding = (window > 0).astype(jnp.int32)
        return cos[sliding], sin[sliding], jnp.where(window > 0, window, GLOBAL_WINDOW)

    def layer_context(self, i: jax.Array, cos, sin, visible: CausalMask):
        """(cos, sin, visible) of layer i (traced): a sliding-window layer gets its own RoPE
        tables and its window on the mask; without such layers, the shared ones as they are."""
        cos, sin, window = self.layer_tables(i, cos, sin)
        return cos, sin, visible if window is None else visible.replace(window=window)

    def accumulating_forward(self, input_ids, attention_mask, layer_grads, compute_dtype: Any = None, routing=None):
        """Cache-free forward of a training step whose stacked decoder layers stay in their
        stored dtype and are cast one layer at a time to `compute_dtype` (the rest of the
        model is passed in that dtype already). Returns (hidden, layer_grads):
        `layer_grads` (float32, shaped like the layers' state) comes back unchanged and its
        cotangent gains the layers' gradients inside the backward loop (see
        grpo_core.models.layer_grads); full remat whatever `self.remat`. `routing`: as in `__call__`."""
        token_mask = attention_mask.astype(jnp.bool_)
        x, cos, sin = self._embedded(input_ids, positions_from_mask(token_mask))
        graphdef, stacked = nnx.split(self.layers)
        apply_layer = functools.partial(_apply_layer, graphdef, self._constrain, self.layer_context)
        x, layer_grads = scan_accumulating(apply_layer, compute_dtype, stacked, x,
                                           (cos, sin, self._mask(token_mask), routing), layer_grads)
        return self.norm(x), layer_grads

    def over_layers(self, step, carry, remat: str = "none"):
        """Thread `carry` through every decoder layer: carry = step(layer, i, carry), with
        `layer` a DecoderLayer holding layer i's parameters and i a traced int32 index.
        One `lax.scan` over the stacked parameters (a Python loop when scan_layers is
        False); `remat` wraps the per-layer body in jax.checkpoint with that policy."""
        graphdef, stacked = nnx.split(self.layers)

        def body(carry, xs):
            params, i = xs
            return step(nnx.merge(graphdef, params), i, carry), None

        if remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[remat])
        xs = (stacked, jnp.arange(self.config.num_hidden_layers, dtype=jnp.int32))
        if self.scan_layers:
            return jax.lax.scan(body, carry, xs)[0]
        for i in range(self.config.num_hidden_layers):
            carry = body(carry, jax.tree.map(lambda a: a[i], xs))[0]
        return carry

    def num_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(nnx.state(self, nnx.Param)))


def _apply_layer(graphdef: nnx.GraphDef, constrain, layer_context, weights, x, context, index):
    *tables, routing = context
    layer = nnx.merge(graphdef, weights)
    return constrain(layer(x, *layer_context(index, *tables), replay=layer_routing(routing, index))[0])


def layer_routing(routing: jax.Array | None, i: jax.Array) -> jax.Array | None:
    """Layer i's recorded experts [B, T, k] of a routing record [B, T, L, k] (None: none)."""
    return None if routing is None else jax.lax.dynamic_index_in_dim(routing, i, axis=2, keepdims=False)


def init_from_config(
    cfg: QwenConfig, seed: int = 0, dtype: Any = "float32", remat: str = "none", scan_layers: bool = True
) -> QwenModel:
    """A randomly initialised model (normal(0.02) kernels, zero biases, unit norms)."""
    return QwenModel(cfg, dtype=dtype, rngs=nnx.Rngs(params=seed), remat=remat, scan_layers=scan_layers)
