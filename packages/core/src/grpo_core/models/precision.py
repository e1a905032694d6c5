"""Storage and compute dtypes: float32 master weights, forward and backward in `model.dtype`.

The trainable params are stored in `model.param_dtype` (float32 by default) so that an
update of lr ~1e-6 is kept: a bfloat16 weight of 0.02 has a spacing of 1.2e-4 and rounds
such an update away. Every forward pass (rollout, scoring, the update's forward and
backward) runs on `compute_params(params, model.dtype)`; inside a differentiated function
the cast's transpose casts the gradient back, so gradients land on the float32 masters.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def cast_floating(tree: Any, dtype: Any) -> Any:
    """`tree` with every floating leaf in `dtype`; integer leaves (counts, ids) unchanged."""
    dtype = jnp.dtype(dtype)

    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype else x

    return jax.tree.map(cast, tree)


def compute_params(params: Any, dtype: Any) -> Any:
    """`params` as the forward pass uses them: floating leaves in the compute `dtype`
    (None: unchanged)."""
    return params if dtype is None else cast_floating(params, dtype)


def needs_cast(params: Any, dtype: Any) -> bool:
    """Whether some floating leaf of `params` is stored in another dtype than `dtype`."""
    dtype = jnp.dtype(dtype)
    return any(jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype for x in jax.tree.leaves(params))


def abstract_compute_params(params: Any, dtype: Any) -> Any:
    """`compute_params` of abstract params (ShapeDtypeStructs): floating leaves in `dtype`,
    shapes and shardings kept."""
    def cast(x):
        kept = dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
        return jax.ShapeDtypeStruct(x.shape, kept, sharding=x.sharding)

    return jax.tree.map(cast, params)


def global_norm_f32(tree: Any) -> jax.Array:
    """sqrt(sum of squares) over every leaf, accumulated in float32 whatever the leaf dtype."""
    squares = [jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)]
    return jnp.sqrt(sum(squares, jnp.float32(0.0)))


def update_ratio(params: Any, updates: Any) -> jax.Array:
    """||applied|| / ||params|| over the whole tree, in float32, where `applied` is what adding
    `updates` really changes in the params' own dtype: the relative size of an update. Zero
    means the update was rounded away (or skipped). Computed before the params change, so
    the update can overwrite them in place."""
    def applied(p, u):
        before = p.astype(jnp.float32)
        return _stored(before + u, p.dtype) - before

    return global_norm_f32(jax.tree.map(applied, params, updates)) / jnp.maximum(global_norm_f32(params), jnp.finfo(jnp.float32).tiny)


def _stored(x: jax.Array, dtype: Any) -> jax.Array:
    """float32 `x` rounded as storing it in `dtype` would. reduce_precision, not a round
    trip through `dtype`: compilers may drop such a pair of casts as excess precision."""
    info = jnp.finfo(dtype)
    return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
