"""KV-cached generation: one jitted prefill, then the whole decode in ONE jitted
`lax.while_loop` (no host round trip per token), exiting as soon as every row ended.

The model contract used (grpo_core.models.QwenModel):
    cache = model.init_cache(batch, max_len, dtype)
    hidden, cache = model(ids [B, T], attention_mask=mask [B, T], cache=cache)
    logits = model.logits(hidden)                       # [B, T, V] f32
Rows are left-padded, so all rows write the same cache slot each step; a finished row
feeds mask 0, which keeps its slot invisible. The prompt pass is the model's own
forward; decode steps run `grpo_rollout.attention.decode_forward` (the model's modules
and cache with a single-query GQA attention) unless the backend asks for the model's.
`prefill_shared` runs each prompt once for its n samples into a `cascade.SharedCache`, which the
same `decode` then reads with `cascade.shared_decode_forward` (the prompt's cache once per group).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec

from grpo_rollout.attention import routed_decode_forward
from grpo_rollout.cascade import SharedCache, TableCache, routed_shared_decode_forward
from grpo_rollout.head_parallel import HeadParallel, LayoutUnsupported, grid_mesh, unsupported
from grpo_rollout.model_parallel import (ActivationLayout, model_parallel_weights, run_experts, split_layout,
                                         weight_shardings)
from grpo_rollout.slices import all_done, batch_slices, end_test_every
from grpo_core.contracts import SamplingParams
from grpo_core.rollout_records import routing_record_dtype
from grpo_core.sharding import as_tuple
from grpo_rollout.sampling import DEFAULT_TOP_P_CANDIDATES, sample_next


@struct.dataclass
class LoopState:
    """Decode loop carry. step: index of the next completion column to fill."""

    step: jax.Array  # [] int32
    last: jax.Array  # [N] int32 token fed at the next step
    done: jax.Array  # [N] bool   row sampled a stop token
    lengths: jax.Array  # [N] int32 tokens sampled while the row was live
    tokens: jax.Array  # [N, Tn] int32
    logps: jax.Array  # [N, Tn] f32
    experts: jax.Array | None = None  # [N, Tn, L, k] int8/16: a MoE model's routing of each column (-1: none)

    def record(self, sampled, logps, params: SamplingParams, pad_id: int, routing=None) -> "LoopState":
        live = ~self.done
        sampled = jnp.where(live, sampled, pad_id)
        logps = jnp.where(live, logps, 0.0)
        column = (0, self.step)
        return LoopState(
            step=self.step + 1,
            last=sampled,
            done=self.done | (live & is_stop(sampled, params.stop_token_ids)),
            lengths=self.lengths + live.astype(jnp.int32),
            tokens=jax.lax.dynamic_update_slice(self.tokens, sampled[:, None], column),
            logps=jax.lax.dynamic_update_slice(self.logps, logps[:, None], column),
            experts=self.record_routing(routing),
        )

    def record_routing(self, routing: jax.Array | None) -> jax.Array | None:
        """`experts` with `routing` [N, L, k], the experts of the token this step fed (column step - 1),
        written for the live rows (a finished row's fed token is not its own)."""
        if self.experts is None or routing is None:
            return self.experts
        fed = jnp.where(~self.done[:, None, None], routing, -1).astype(self.experts.dtype)
        return jax.lax.dynamic_update_slice(self.experts, fed[:, None], (0, self.step - 1, 0, 0))


def with_routing_record(state: LoopState, config, params: SamplingParams, batch_sharding=None) -> LoopState:
    """`state` with an empty routing record (-1) when `params.record_routing` and the model is a
    mixture of experts: [N, Tn, L, k] in the narrowest int that holds -1 .. E - 1."""
    if not (params.record_routing and config.family.sparse_mlp):
        return state
    dtype = routing_record_dtype(config.num_experts)
    shape = (state.last.shape[0], params.max_new_tokens, config.num_hidden_layers, config.num_experts_per_tok)
    return state.replace(experts=constrain(jnp.full(shape, -1, dtype), batch_sharding))


def is_stop(tokens: jax.Array, stop_ids: tuple[int, ...]) -> jax.Array:
    """[N] bool: token is one of stop_ids."""
    if not stop_ids:
        return jnp.zeros(tokens.shape, jnp.bool_)
    return jnp.any(tokens[:, None] == jnp.asarray(stop_ids, tokens.dtype)[None, :], axis=1)


def step_uniforms(key: jax.Array, step: jax.Array, rows: int) -> jax.Array:
    """[rows] uniforms of one step; a function of (key, step) only, so the same seed
    reproduces a rollout whatever the sharding (threefry is partitionable). key: one key, or
    one per row, a typed key array [rows] (each row's uniform then depends on its own key only)."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and key.ndim == 1:
        return jax.vmap(lambda row_key: jax.random.uniform(jax.random.fold_in(row_key, step), (), jnp.float32))(key)
    return jax.random.uniform(jax.random.fold_in(key, step), (rows,), jnp.float32)


# ---- sharding of the batch -----------------------------------------------------------
def batch_spec_axes(batch_sharding: NamedSharding | None):
    """Mesh axes the batch dimension is split over (None: not sharded)."""
    if batch_sharding is None:
        return None
    spec = batch_sharding.spec
    return spec[0] if len(spec) else None


def batch_sharding_of_rank(batch_sharding: NamedSharding, ndim: int) -> NamedSharding:
    """The batch sharding for an array of `ndim` dimensions, batch first."""
    return NamedSharding(batch_sharding.mesh, PartitionSpec(batch_spec_axes(batch_sharding), *([None] * (ndim - 1))))


def constrain(x: jax.Array, batch_sharding: NamedSharding | None, batch_dim: int = 0) -> jax.Array:
    """Pin x's batch dimension to the batch sharding (other dimensions replicated)."""
    if batch_sharding is None:
        return x
    spec = [None] * x.ndim
    spec[batch_dim] = batch_spec_axes(batch_sharding)
    return jax.lax.with_sharding_constraint(x, NamedSharding(batch_sharding.mesh, PartitionSpec(*spec)))


def cache_shardings(cache, batch_sharding: NamedSharding):
    """NamedShardings of a cache split like the batch: k/v [L, B, S, KV, D] on B, mask [B, S] on B."""
    mesh, axes = batch_sharding.mesh, batch_spec_axes(batch_sharding)
    kv = NamedSharding(mesh, PartitionSpec(None, axes))
    return cache.replace(k=kv, v=kv, mask=NamedSharding(mesh, PartitionSpec(axes)),
                         index=NamedSharding(mesh, PartitionSpec()))


def check_batch_divisible(rows: int, n: int, batch_sharding: NamedSharding | None) -> None:
    """The rollout batch must split evenly over the devices of its batch axes."""
    axes = batch_spec_axes(batch_sharding)
    if axes is None:
        return
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    shards = math.prod(batch_sharding.mesh.shape[a] for a in axes)
    if rows % shards:
        raise ValueError(
            f"rollout batch of {rows} rows ({rows // n} prompts x n={n}) cannot be split over the "
            f"{shards} devices of mesh axes {axes}; make prompts_per_step * n a multiple of {shards}.")


def place(array: np.ndarray, batch_sharding: NamedSharding | None) -> jax.Array:
    """A host array of rows onto the devices, split like the batch."""
    if batch_sharding is None:
        return jnp.asarray(array)
    return jax.device_put(array, batch_sharding_of_rank(batch_sharding, np.ndim(array)))


def group_sharding(batch_sharding: NamedSharding | None, groups: int) -> NamedSharding | None:
    """The sharding of per-prompt arrays [P, ...] beside a batch of P * n rows: split like the batch
    when its devices divide P (each device then holds whole groups), else over the longest run of
    its leading axes that divides P (across slices dp: each slice its own prompts, never gathered
    from another), else replicated."""
    if batch_sharding is None:
        return None
    mesh, axes = batch_sharding.mesh, as_tuple(batch_spec_axes(batch_sharding))
    ways = [math.prod(mesh.shape[a] for a in axes[:end]) for end in range(len(axes) + 1)]
    end = max(end for end, split in enumerate(ways) if groups % split == 0)
    if end == len(axes):
        return batch_sharding
    return NamedSharding(mesh, PartitionSpec(axes[:end]) if ways[end] > 1 else PartitionSpec())


def constrain_cache(cache, batch_sharding):
    """k/v [L, B, S, KV, D] and mask [B, S]: batch dimension sharded (a SharedCache: its
    completion part like the batch, its prompt part by `group_sharding`)."""
    if isinstance(cache, (SharedCache, TableCache)):  # a table's rows are of any group: replicated
        groups = cache.prompt.mask.shape[0] if isinstance(cache, SharedCache) else 0
        prompt = constrain_cache(cache.prompt, group_sharding(batch_sharding, groups) if groups else
                                 batch_sharding and NamedSharding(batch_sharding.mesh, PartitionSpec()))
        return cache.replace(prompt=prompt, completion=constrain_cache(cache.completion, batch_sharding))
    # An int8 cache's keys and values are (int8 values, scales): each split like the batch.
    keys, values = (jax.tree.map(lambda a: constrain(a, batch_sharding, 1), kv) for kv in (cache.k, cache.v))
    return cache.replace(k=keys, v=values, mask=constrain(cache.mask, batch_sharding, 0))


def rollout_graphdef(graphdef, weights, batch_sharding):
    """`graphdef` with the residual-stream sharding following the rollout batch sharding (a
    model sharded for training pins activations to the training batch axes). Called outside
    jit: the result is the static model structure the jitted prefill and decode receive."""
    model = nnx.merge(graphdef, weights)
    if batch_sharding is not None and hasattr(model, "set_activation_sharding"):
        model.set_activation_sharding(batch_sharding.mesh, (("batch", batch_spec_axes(batch_sharding)),))
    return nnx.split(model)[0]


def rollout_weights(weights, batch_sharding: NamedSharding | None, gather: bool):
    """The weights as the rollout reads them. `gather`: replicated on every device, one
    all-gather per jitted call instead of per-token collectives in the decode loop
    (XLA otherwise keeps FSDP-sharded weights in place and all-reduces partial
    activations, e.g. the [rows, V] logits, every token); costs a full copy per device."""
    if not gather or batch_sharding is None:
        return weights
    return jax.lax.with_sharding_constraint(weights, NamedSharding(batch_sharding.mesh, PartitionSpec()))


# ---- jitted phases -------------------------------------------------------------------
# The static arguments every jitted rollout phase takes (prefill, decode, kept_cache.admit).
PHASE_STATIC_ARGS = ("graphdef", "params", "pad_id", "cache_dtype", "batch_sharding", "block", "top_p_candidates",
                     "attention", "gather_weights", "model_parallel")


@functools.partial(jax.jit, static_argnames=PHASE_STATIC_ARGS)
def prefill(weights, prompt_ids, prompt_mask, key, *, graphdef, params: SamplingParams, pad_id: int,
            cache_dtype=None, batch_sharding=None, block=None, top_p_candidates=DEFAULT_TOP_P_CANDIDATES,
            attention="rollout", gather_weights=False, model_parallel=False):
    """Run the prompts [N, Tp] through the model into a fresh cache of Tp + Tn - 1 slots and
    sample the first completion token. Returns (cache, LoopState at step 1)."""
    del attention, model_parallel  # the prompt pass is the model's own (many queries per row, compute-bound)
    model = nnx.merge(graphdef, rollout_weights(weights, batch_sharding, gather_weights))
    rows, width = prompt_ids.shape
    cache = constrain_cache(model.init_cache(rows, width + params.max_new_tokens - 1, cache_dtype), batch_sharding)
    hidden, cache = model(prompt_ids, attention_mask=prompt_mask, cache=cache)  # [N, Tp, H]
    logits = model.logits(hidden[:, -1:])[:, 0]  # [N, V]; left padding: last column is real
    state = first_token(logits, key, params, pad_id, batch_sharding, block, top_p_candidates)
    return constrain_cache(cache, batch_sharding), with_routing_record(state, model.config, params, batch_sharding)


@functools.partial(jax.jit, static_argnames=PHASE_STATIC_ARGS)
def prefill_shared(weights, prompt_ids, prompt_mask, key, *, graphdef, params: SamplingParams, pad_id: int,
                   cache_dtype=None, batch_sharding=None, block=None, top_p_candidates=DEFAULT_TOP_P_CANDIDATES,
                   attention="rollout", gather_weights=False, model_parallel=False):
    """`prefill` with each of the P prompts [P, Tp] run once for its params.n samples: returns
    (SharedCache with the prompts' cache and room for Tn - 1 tokens per row, LoopState of the
    P * n rows at step 1); rows p*n .. p*n+n-1 sample from prompt p's logits."""
    del attention, model_parallel
    model = nnx.merge(graphdef, rollout_weights(weights, batch_sharding, gather_weights))
    groups, width = prompt_ids.shape
    rows = groups * params.n
    prompts = group_sharding(batch_sharding, groups)
    cache = constrain_cache(model.init_cache(groups, width, cache_dtype), prompts)
    hidden, cache = model(prompt_ids, attention_mask=prompt_mask, cache=cache)  # [P, Tp, H]
    logits = jnp.repeat(model.logits(hidden[:, -1:])[:, 0], params.n, axis=0)  # [P * n, V]
    own = model.init_cache(rows, max(params.max_new_tokens - 1, 1), cache_dtype)  # one slot keeps shapes non-empty
    shared = constrain_cache(SharedCache(prompt=cache, completion=own), batch_sharding)
    state = first_token(constrain(logits, batch_sharding), key, params, pad_id, batch_sharding, block, top_p_candidates)
    return shared, with_routing_record(state, model.config, params, batch_sharding)


def first_token(logits, key, params: SamplingParams, pad_id: int, batch_sharding, block, top_p_candidates) -> LoopState:
    """The LoopState at step 1: completion column 0 sampled from the prompts' last logits [N, V]."""
    rows = logits.shape[0]
    sampled, logps = sample_next(logits, step_uniforms(key, 0, rows), params, block=block,
                                 top_p_candidates=top_p_candidates)
    start = LoopState(
        step=jnp.zeros((), jnp.int32),
        last=sampled,
        done=jnp.zeros((rows,), jnp.bool_),
        lengths=jnp.zeros((rows,), jnp.int32),
        tokens=constrain(jnp.full((rows, params.max_new_tokens), pad_id, jnp.int32), batch_sharding),
        logps=constrain(jnp.zeros((rows, params.max_new_tokens), jnp.float32), batch_sharding),
    )
    return start.record(sampled, logps, params, pad_id)


def view_slots(cache, max_new_tokens: int, until: int | None) -> int | None:
    """Cache slots the decode steps before `until` fill (of a SharedCache: its completion part), the
    static view a segment ending there attends over; None: the whole cache. Step s feeds column s - 1,
    written to completion slot s - 1, after the prompt's slots in an unshared cache."""
    if until is None or until >= max_new_tokens:
        return None
    if isinstance(cache, SharedCache):
        return until - 1
    return cache.max_len - (max_new_tokens - until)


@functools.partial(jax.jit, static_argnames=PHASE_STATIC_ARGS + ("until",), donate_argnames=("cache", "state"))
def decode(weights, cache, state: LoopState, key, *, graphdef, params: SamplingParams, pad_id: int,
           cache_dtype=None, batch_sharding=None, block=None, top_p_candidates=DEFAULT_TOP_P_CANDIDATES,
           attention="rollout", gather_weights=False, model_parallel=False, until=None):
    """Sample columns state.step .. Tn-1 in one while loop; the cache and loop state are donated
    and updated in place. Returns (cache, final LoopState). until: a segment (grpo_rollout.segments)
    stops before step `until`, its attention reading only the slots those steps fill (`view_slots`).

    attention: "rollout" runs `attention.decode_forward` (single-query attention), "model" the model's
    own cached forward with T = 1. gather_weights: see `rollout_weights`; model_parallel: True splits the
    weights by heads / MLP columns / vocabulary over the batch devices (grpo_rollout.model_parallel),
    "experts" the same with a MoE model's experts whole per device, "heads" runs the attention where
    its KV heads are (grpo_rollout.head_parallel)."""
    del cache_dtype  # part of the shared static signature only
    rows, end = state.last.shape[0], params.max_new_tokens if until is None else min(until, params.max_new_tokens)
    view = view_slots(cache, params.max_new_tokens, until)
    layout, weights = decode_layout(weights, graphdef, cache, batch_sharding, gather_weights, model_parallel)
    every = 1 if batch_sharding is None else end_test_every(batch_slices(batch_sharding.mesh,
                                                                         batch_spec_axes(batch_sharding)))

    def unfinished(carry):
        _, s = carry
        return (s.step < end) & ~all_done(s, every)

    def one_token(carry):
        cache, s = carry
        model = run_experts(nnx.merge(graphdef, weights), layout)
        hidden, cache, routing = step_forward(model, s, cache, attention, layout, view)  # [N, 1, H]
        logits = layout.logits(model.logits(hidden)[:, 0])  # [N, V]
        sampled, logps = sample_next(logits, step_uniforms(key, s.step, rows), params, block=block,
                                     top_p_candidates=top_p_candidates)
        return pin_loop(cache, s.record(sampled, logps, params, pad_id, routing), batch_sharding, layout)

    # Head-parallel, the cache is split by rows and KV heads in the loop; the result is pinned so first (else the
    # batch's layout reaches into the carry), then handed back split like the batch, but by a segment before the
    # last as it is, for the next (`lay_out`).
    cache, state = pin_loop(*jax.lax.while_loop(unfinished, one_token, pin_loop(cache, state, batch_sharding, layout)),
                            batch_sharding, layout)
    return (cache if until is not None else constrain_cache(cache, batch_sharding)), state


def step_forward(model, s: LoopState, cache, attention: str, layout, view: int | None):
    """(hidden [N, 1, H], cache, routing or None) of feeding each row's last token: the model's own
    cached forward (attention "model", which records no routing) or the rollout's decode step."""
    if attention == "model" and not isinstance(cache, (SharedCache, TableCache)):
        return *model(s.last[:, None], attention_mask=~s.done[:, None], cache=cache), None
    forward = routed_shared_decode_forward if isinstance(cache, (SharedCache, TableCache)) else routed_decode_forward
    return forward(model, s.last, ~s.done, cache, layout, view=view)


def loop_shardings(weights, cache, *, graphdef, batch_sharding=None, gather_weights=False, model_parallel=False,
                   **_) -> tuple:
    """(the weights' shardings, the cache's) inside a decode loop of this layout (`decode`'s static
    arguments): a segmented decode moves them there once (`lay_out`), so its segments neither
    gather nor reshard them again, and each segment but the last hands the cache on as it is."""
    own = jax.tree.map(lambda a: a.sharding, (weights, cache))
    if batch_sharding is None or not (gather_weights or model_parallel):
        return own
    if model_parallel == "heads":
        layout = head_parallel_layout(nnx.merge(graphdef, weights).config, cache, batch_sharding)
        return layout.weight_shardings(weights), layout.cache_shardings(cache)
    if model_parallel:
        layout = decode_split_layout(weights, batch_sharding, model_parallel)
        return weight_shardings(weights, layout.mesh, layout.axes, layout.experts), own[1]
    return jax.tree.map(lambda _: NamedSharding(batch_sharding.mesh, PartitionSpec()), weights), own[1]


def lay_out(weights, cache, static: dict):
    """(weights, cache) moved into the decode loop's layout (`loop_shardings`): new arrays (the cache's
    old ones are freed when the caller drops them)."""
    weight_target, cache_target = loop_shardings(weights, cache, **static)
    return jax.device_put((weights, cache), (weight_target, cache_target))


def decode_layout(weights, graphdef, cache, batch_sharding, gather_weights: bool, model_parallel):
    """(layout, weights as the decode loop reads them): model_parallel True splits the weights by
    heads over the batch devices (grpo_rollout.model_parallel), "experts" its expert-parallel variant,
    "heads" runs the head-parallel decode (grpo_rollout.head_parallel), False keeps them sharded or
    gathers them."""
    if batch_sharding is None or not model_parallel:
        return ActivationLayout(), rollout_weights(weights, batch_sharding, gather_weights)
    if model_parallel == "heads":
        layout = head_parallel_layout(nnx.merge(graphdef, weights).config, cache, batch_sharding)
        return layout, layout.weights(weights)  # outside the loop: once per rollout
    layout = decode_split_layout(weights, batch_sharding, model_parallel)
    return layout, model_parallel_weights(weights, layout)


def decode_split_layout(weights, batch_sharding: NamedSharding, model_parallel) -> ActivationLayout:
    """The model-parallel layout over the batch devices ("experts": its expert-parallel variant)."""
    return split_layout(weights, batch_sharding.mesh, batch_spec_axes(batch_sharding), model_parallel == "experts")


def head_parallel_layout(config, cache, batch_sharding: NamedSharding) -> HeadParallel:
    """The HeadParallel layout over the batch mesh's devices; a model or batch it cannot split
    is refused (LayoutUnsupported)."""
    mesh = batch_sharding.mesh
    rows, groups = cache_rows(cache)
    slices = batch_slices(mesh, batch_spec_axes(batch_sharding))
    reason = unsupported(config, rows, groups, mesh.size, slices)
    if reason:
        raise LayoutUnsupported(f"gather_weights=head_parallel: {reason}; or set gather_weights to auto, "
                                "model_parallel, true or false.")
    return HeadParallel(grid_mesh(mesh, config.num_key_value_heads, slices))


def cache_rows(cache) -> tuple[int, int]:
    """(rows, prompts) of a decode cache: a plain cache holds one prompt per row. The prompt table
    of partial rollouts maps rows to any table slot, which a split by row groups cannot follow."""
    if isinstance(cache, TableCache):
        raise LayoutUnsupported("gather_weights=head_parallel: partial rollouts on the prompt table (rows map to "
                                "any table slot); set gather_weights to auto, model_parallel, true or false, or "
                                "rollout.options.shared_prompt=false.")
    if isinstance(cache, SharedCache):
        return cache.completion.mask.shape[0], cache.prompt.mask.shape[0]
    return cache.mask.shape[0], cache.mask.shape[0]


def pin_loop(cache, state: LoopState, batch_sharding, layout) -> tuple:
    """The decode loop's carry in its layout: the cache split by rows like the batch, or, head-
    parallel, by rows and KV heads with the rows' last tokens, flags and lengths replicated (every
    device then updates its cache mask, embeds the tokens and tests for the loop's end without a
    collective; the sampled tokens are gathered once instead)."""
    if not isinstance(layout, HeadParallel):
        return constrain_cache(cache, batch_sharding), state
    replicated = {name: layout.replicated(getattr(state, name)) for name in ("last", "done", "lengths")}
    return layout.pin_cache(cache), state.replace(**replicated)
