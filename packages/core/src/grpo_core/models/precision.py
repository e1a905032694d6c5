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


def global_norm_f32(tree: Any) -> jax.Array:
    """sqrt(sum of squares) over every leaf, accumulated in float32 whatever the leaf dtype."""
    squares = [jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)]
    return jnp.sqrt(sum(squares, jnp.float32(0.0)))


def update_ratio(new: Any, old: Any) -> jax.Array:
    """||new - old|| / ||old|| over the whole tree, in float32: the relative size of an update.
    Zero means the update was rounded away (or skipped)."""
    delta = jax.tree.map(lambda a, b: a.astype(jnp.float32) - b.astype(jnp.float32), new, old)
    return global_norm_f32(delta) / jnp.maximum(global_norm_f32(old), jnp.finfo(jnp.float32).tiny)
