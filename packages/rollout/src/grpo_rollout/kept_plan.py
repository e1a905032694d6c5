"""`grpo-run --plan` for partial-rollout rounds on kept caches: the widest round of
`JaxRollout.generate_round` compiled as the run executes it, on one cache row per slot
(grpo_rollout.kept_cache) or, with `shapes.prompt_table`, on the groups' prompt table
(grpo_rollout.kept_shared)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_core.contracts import PhaseCompiler, RolloutShapes
from grpo_rollout.cascade import TableCache
from grpo_rollout.decode import batch_sharding_of_rank, cache_shardings
from grpo_rollout.kept_cache import admit, compact, round_start
from grpo_rollout.kept_shared import admit_table, fill_table
from grpo_rollout.prompts import bucket_length


def _abstract_cache(rollout, shapes: RolloutShapes, rows: int, width: int, sharding) -> Any:
    model = nnx.merge(shapes.policy.graphdef, shapes.policy.weights)
    cache = jax.eval_shape(lambda: model.init_cache(rows, width, rollout.cache_dtype))
    if sharding is None:
        return cache
    def placed(leaf_sharding, part):  # the shardings are a prefix: one covers an 8-bit store's values and scales
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=leaf_sharding), part)

    return jax.tree.map(placed, cache_shardings(cache, sharding), cache)


def _replicated(sharding):
    return sharding and jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())


def kept_cache(rollout, shapes: RolloutShapes, kept: bool = True) -> Any:
    """The abstract KV cache of the widest round: every slot kept with the longest carried prefix but
    its last token and new prompts admitted beside (kept=False: every slot admitting that prefix), a
    round's budget of room. With a prompt table: (the slots' own caches, the table)."""
    buckets, rows, budget = rollout.options.prompt_buckets, shapes.prompts * shapes.sampling.n, \
        shapes.sampling.max_new_tokens
    if shapes.prompt_table:
        own = bucket_length(shapes.kept_prefix - shapes.max_prompt_length, buckets)  # carried tokens
        table = _abstract_cache(rollout, shapes, shapes.prompt_table[0],
                                bucket_length(shapes.max_prompt_length - 1, buckets), _replicated(shapes.batch_sharding))
        return _abstract_cache(rollout, shapes, rows, own + budget, shapes.batch_sharding), table
    width = bucket_length(shapes.kept_prefix - 1, buckets) + budget
    if kept:
        width += bucket_length(shapes.max_prompt_length - 1, buckets)
    return _abstract_cache(rollout, shapes, rows, width, shapes.batch_sharding)


def _rows_of(shapes: RolloutShapes, dtype=jnp.int32, *columns: int):
    batch = shapes.batch_sharding
    shape = (shapes.prompts * shapes.sampling.n, *columns)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=batch and batch_sharding_of_rank(batch, len(shape)))


def compile_round(rollout, shapes: RolloutShapes, compiler: PhaseCompiler, static: dict[str, Any]) -> None:
    """The widest rounds: every slot admitting the longest carried prefix (a step's first round, or
    one after a resume), then compaction, new prompts admitted beside slots kept at that prefix, and
    the decode over that cache."""
    if shapes.prompt_table:
        compile_shared_round(rollout, shapes, compiler, static)
        return
    weights, buckets, batch = shapes.policy.weights, rollout.options.prompt_buckets, shapes.batch_sharding

    def admission(name: str, cache: Any, width: int) -> Any:
        args = (weights, cache, _rows_of(shapes, jnp.int32, width), _rows_of(shapes, jnp.int32, width))
        return compiler.compile(name, lambda: admit.lower(*args, **static).compile(), args)

    carried = kept_cache(rollout, shapes, kept=False)
    carried_width = carried.max_len - shapes.sampling.max_new_tokens
    if admission("rollout admission of carried rows", carried, carried_width) is None:
        return
    cache = kept_cache(rollout, shapes)
    args = (cache, _rows_of(shapes, jnp.bool_))
    base = bucket_length(shapes.kept_prefix - 1, buckets)
    if compiler.compile("rollout compaction", lambda: compact.lower(
            *args, base=base, width=cache.max_len, batch_sharding=batch).compile(), args) is None:
        return
    if admission("rollout admission", cache, bucket_length(shapes.max_prompt_length - 1, buckets)) is None:
        return
    _compile_round_decode(rollout, shapes, compiler, static, cache)


def _compile_round_decode(rollout, shapes: RolloutShapes, compiler: PhaseCompiler, static, cache) -> None:
    batch = shapes.batch_sharding
    state = jax.eval_shape(lambda t: round_start(t, shapes.sampling.max_new_tokens, shapes.pad_token_id, batch),
                           _rows_of(shapes))
    rollout.compile_decode(compiler, (shapes.policy.weights, cache, state, shapes.key), static)


def compile_shared_round(rollout, shapes: RolloutShapes, compiler: PhaseCompiler, static: dict[str, Any]) -> None:
    """The widest rounds on a prompt table of G groups: every group's prompt run into it (a step's
    first round), the own caches compacted, every slot admitting its carried tokens on the table,
    and the decode over the TableCache."""
    weights, (groups, members) = shapes.policy.weights, shapes.prompt_table
    own, table = kept_cache(rollout, shapes)
    rows_new = 1 << max(groups - 1, 0).bit_length()
    prompts = jax.ShapeDtypeStruct((rows_new, table.max_len), jnp.int32)
    args = (weights, table, prompts, prompts, jax.ShapeDtypeStruct((rows_new,), jnp.int32))
    unsharded = {**static, "batch_sharding": None}  # as the run fills it (a few rows, any group)
    if compiler.compile("rollout prompt table", lambda: fill_table.lower(*args, **unsharded).compile(), args) is None:
        return
    carried = own.max_len - shapes.sampling.max_new_tokens
    args = (own, _rows_of(shapes, jnp.bool_))
    if compiler.compile("rollout compaction", lambda: compact.lower(
            *args, base=carried, width=own.max_len, batch_sharding=shapes.batch_sharding).compile(), args) is None:
        return
    cache = TableCache(prompt=table, completion=own, group=_rows_of(shapes), member=_rows_of(shapes), members=members)
    ids = _rows_of(shapes, jnp.int32, carried)
    args = (weights, cache, ids, ids)
    if compiler.compile("rollout admission of carried rows", lambda: admit_table.lower(*args, **static).compile(),
                        args) is None:
        return
    _compile_round_decode(rollout, shapes, compiler, static, cache)
