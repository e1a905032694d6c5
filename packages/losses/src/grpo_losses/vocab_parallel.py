"""custom_vjp + shard_map plumbing shared by the blockwise implementations.

A `VocabKernels` object computes, on ONE device's slice of tokens and vocab,
the online softmax state (forward) and the gradients from recomputed logits
blocks (backward). This module turns it into a differentiable
`(hidden, lm_head, targets, temperature) -> TokenLogps`:

- Without a mesh (or a one-device mesh) the kernels see everything.
- With a mesh (passed in, or the one set by `jax.set_mesh`), the work runs in
  `jax.shard_map` over every mesh axis: lm_head's V dim is split over
  `vocab_axis` (default "tp"), the batch over the remaining axes. Each vocab shard
  computes its partial state; `finish_stats` combines them with pmax/psum, so
  every shard sees the exact global log-sum-exp. In the backward each shard
  builds dL/dz for its own columns only; d hidden is psum-ed over `vocab_axis`
  and d lm_head over the batch axes. A device holds its [H, V / tp] weight
  slice (gathered over other axes, e.g. fsdp, as any FSDP matmul would) and its
  gradient, plus a few logits blocks.

The shard_maps run with check_vma=False: kernels start loop carries from
constants, which the varying-axes checker rejects; the collectives here are
placed by hand and nothing is differentiated through shard_map itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AbstractMesh, AxisType, Mesh
from jax.sharding import PartitionSpec as P

from grpo_losses.blockmath import F32, TokenStats, VocabStats, finish_stats
from grpo_losses.logps import Array, TokenLogps


class VocabKernels(Protocol):
    """Per-device blockwise kernels. Shapes are the device-local ones:
    h [N, H], w [H, Vl], targets [N, 1] int32 as LOCAL column ids (-1 when
    the target lives on another vocab shard), inv_temp float32 scalar, per-token
    statistics and cotangents [N, 1] float32."""

    def stats(self, h: Array, w: Array, targets: Array, inv_temp: Array, with_entropy: bool) -> VocabStats:
        """Online softmax state over this device's vocab columns."""
        ...

    def grads(self, h: Array, w: Array, targets: Array, inv_temp: Array, stats: TokenStats,
              g_lp: Array, g_ent: Array | None) -> tuple[Array, Array]:
        """(d h [N, H], d w [H, Vl]), float32, from this device's columns only."""
        ...


TokenLoss = Callable[[Array, "Array | None", Any], Array]


class OnePassKernels(VocabKernels, Protocol):
    """Kernels that also produce the gradient of a per-token loss in the forward."""

    def one_pass(self, h: Array, w: Array, targets: Array, inv_temp: Array, terms, token_grads,
                 with_entropy: bool, vocab_axis: str | None) -> tuple[Array, Array | None, Array, Array]:
        """(logp [N, 1], entropy [N, 1] or None, d h [N, H], d w [H, Vl]) of this device.

        `terms` holds [N, 1] columns; `token_grads(logp, entropy, terms)` gives the
        per-token cotangents (g_lp, g_ent) of a block of them. Softmax states are
        combined over `vocab_axis` (None: the vocab is not split) per token block."""
        ...


@dataclass(frozen=True)
class ShardPlan:
    """How the batch and vocab dims map onto mesh axes."""

    mesh: Mesh | AbstractMesh
    batch_axes: tuple[str, ...]
    vocab_axis: str | None

    def specs(self) -> dict[str, P]:
        batch = self.batch_axes or None
        return {"tokens": P(batch, None), "hidden": P(batch, None, None), "lm_head": P(None, self.vocab_axis)}

    def conform(self, args: tuple, specs: tuple) -> tuple:
        """Reshard args to `specs` where the mesh has Explicit axes (shard_map does
        not reshard those itself); Auto axes are left to shard_map."""
        if AxisType.Explicit not in tuple(self.mesh.axis_types):
            return args
        return tuple(_reshard_tree(arg, spec) for arg, spec in zip(args, specs))


def _reshard_tree(arg: Any, spec: Any) -> Any:
    """`spec` is one PartitionSpec for every leaf of `arg`, or a tree of them shaped like `arg`."""
    if isinstance(spec, P):
        return jax.tree.map(lambda x: jax.sharding.reshard(x, spec), arg)
    return jax.tree.map(jax.sharding.reshard, arg, spec, is_leaf=lambda x: x is None)


def plan_sharding(mesh: Mesh | AbstractMesh | None, vocab_axis: str, batch: int, vocab: int) -> ShardPlan | None:
    """The shard_map layout for `mesh` (None: the context mesh); None when unsharded.

    The batch dim splits over all non-vocab axes when they divide it, else it is
    replicated (still exact, just redundant work).
    """
    mesh = _context_mesh() if mesh is None else mesh
    if mesh is None or mesh.empty or math.prod(mesh.shape.values()) == 1:
        return None
    sizes = dict(mesh.shape)
    vocab_axis_used = vocab_axis if sizes.get(vocab_axis, 1) > 1 else None
    if vocab_axis_used and vocab % sizes[vocab_axis]:
        raise ValueError(
            f"lm_head vocab size {vocab} is not divisible by mesh axis {vocab_axis!r} of size "
            f"{sizes[vocab_axis]}; pad the LM head's vocab to a multiple of it or use a {vocab_axis} size that divides it")
    batch_axes = tuple(name for name in mesh.axis_names if name != vocab_axis_used and sizes[name] > 1)
    if batch % math.prod(sizes[name] for name in batch_axes):
        batch_axes = ()
    return ShardPlan(mesh, batch_axes, vocab_axis_used)


def _context_mesh() -> AbstractMesh | None:
    """The mesh set by `jax.set_mesh` (visible inside and outside jit), or None."""
    abstract = jax.sharding.get_abstract_mesh()
    return None if abstract.empty else abstract


def blockwise_token_logps(kernels: VocabKernels, hidden: Array, lm_head: Array, targets: Array,
                          temperature: float | Array, *, entropy: bool, vocab_axis: str = "tp",
                          mesh: Mesh | AbstractMesh | None = None) -> TokenLogps:
    """TokenLogps [B, T] of hidden [B, T, H] and lm_head [H, V] through `kernels`.

    Never builds [B, T, V]; the backward recomputes logits blocks. Gradients flow
    to hidden and lm_head; temperature receives a zero cotangent.
    """
    plan = plan_sharding(mesh, vocab_axis, hidden.shape[0], lm_head.shape[1])
    fn = _differentiable(kernels, plan, entropy)
    logp, ent = fn(hidden, lm_head, targets.astype(jnp.int32), 1.0 / jnp.asarray(temperature, F32))
    return TokenLogps(logp, ent)


def _differentiable(kernels: VocabKernels, plan: ShardPlan | None, with_entropy: bool):
    @jax.custom_vjp
    def logps(h, w, targets, inv_temp):
        stats = _forward(kernels, plan, with_entropy, h, w, targets, inv_temp)
        return stats.logp, stats.entropy

    def forward(h, w, targets, inv_temp):
        stats = _forward(kernels, plan, with_entropy, h, w, targets, inv_temp)
        return (stats.logp, stats.entropy), (h, w, targets, inv_temp, stats)

    def backward(residuals, cotangents):
        h, w, targets, inv_temp, stats = residuals
        g_lp, g_ent = cotangents
        dh, dw = _backward(kernels, plan, h, w, targets, inv_temp, stats, g_lp, g_ent)
        return dh.astype(h.dtype), dw.astype(w.dtype), None, jnp.zeros_like(inv_temp)

    logps.defvjp(forward, backward)
    return logps


def _forward(kernels, plan, with_entropy, h, w, targets, inv_temp) -> TokenStats:
    """TokenStats [B, T] each; kernels see tokens flattened to [N, ...] columns."""
    def local(h, w, targets, inv_temp):
        batch, time, width = h.shape
        local_targets = _local_targets(targets.reshape(-1, 1), w.shape[1], plan and plan.vocab_axis)
        state = kernels.stats(h.reshape(-1, width), w, local_targets, inv_temp, with_entropy)
        stats = finish_stats(state, plan and plan.vocab_axis)
        return TokenStats(*(None if x is None else x.reshape(batch, time) for x in stats))

    if plan is None:
        return local(h, w, targets, inv_temp)
    spec = plan.specs()
    in_specs = (spec["hidden"], spec["lm_head"], spec["tokens"], P())
    args = plan.conform((h, w, targets, inv_temp), in_specs)
    return jax.shard_map(local, mesh=plan.mesh, in_specs=in_specs, out_specs=spec["tokens"], check_vma=False)(*args)


def _backward(kernels, plan, h, w, targets, inv_temp, stats, g_lp, g_ent):
    def local(h, w, targets, inv_temp, stats, g_lp, g_ent):
        batch, time, width = h.shape
        local_targets = _local_targets(_column(targets), w.shape[1], plan and plan.vocab_axis)
        dh, dw = kernels.grads(h.reshape(-1, width), w, local_targets, inv_temp,
                               TokenStats(*(_column(x) for x in stats)), _column(g_lp), _column(g_ent))
        return _reduce_grads(plan, dh.reshape(batch, time, width), dw)

    if plan is None:
        return local(h, w, targets, inv_temp, stats, g_lp, g_ent)
    spec = plan.specs()
    in_specs = (spec["hidden"], spec["lm_head"], spec["tokens"], P(), spec["tokens"], spec["tokens"], spec["tokens"])
    args = plan.conform((h, w, targets, inv_temp, stats, g_lp, g_ent), in_specs)
    return jax.shard_map(local, mesh=plan.mesh, in_specs=in_specs, out_specs=(spec["hidden"], spec["lm_head"]),
                         check_vma=False)(*args)


def _column(x: Array | None) -> Array | None:
    return None if x is None else x.reshape(-1, 1)


def _reduce_grads(plan: ShardPlan | None, dh: Array, dw: Array) -> tuple[Array, Array]:
    """Sum one device's partial gradients over the devices that share them."""
    if plan is None:
        return dh, dw
    if plan.vocab_axis:
        dh = lax.psum(dh, plan.vocab_axis)  # every vocab shard contributes to each token
    if plan.batch_axes:
        dw = lax.psum(dw, plan.batch_axes)  # every batch shard contributes to each column
    return dh, dw


def blockwise_loss_numerator(kernels: OnePassKernels, hidden: Array, lm_head: Array, targets: Array,
                             temperature: float | Array, terms, token_loss: TokenLoss, *, entropy: bool,
                             entropy_grad: bool, vocab_axis: str = "tp",
                             mesh: Mesh | AbstractMesh | None = None) -> tuple[Array, TokenLogps]:
    """(sum of token_loss over all tokens, TokenLogps [B, T] without gradient).

    `terms` is a pytree of [B, T] arrays handed to `token_loss(logp, entropy,
    terms)`, which must be elementwise over tokens. Under differentiation the
    forward also produces d hidden and d lm_head (the kernels' `one_pass`), so
    the backward only scales them by the numerator's cotangent; `terms` and
    `temperature` receive zero cotangents.
    """
    plan = plan_sharding(mesh, vocab_axis, hidden.shape[0], lm_head.shape[1])
    token_grads = _token_grads(token_loss, entropy_grad)
    fn = _one_pass_differentiable(kernels, plan, entropy, token_loss, token_grads)
    numerator, logp, ent = fn(hidden, lm_head, targets.astype(jnp.int32), 1.0 / jnp.asarray(temperature, F32), terms)
    return numerator, TokenLogps(lax.stop_gradient(logp), None if ent is None else lax.stop_gradient(ent))


def _token_grads(token_loss: TokenLoss, entropy_grad: bool):
    """(logp, entropy, terms) -> (d token_loss/d logp, d/d entropy or None), per token."""
    def grads(logp, entropy, terms):
        def total(lp, ent):
            return jnp.sum(token_loss(lp, ent, terms))

        if not entropy_grad:
            return jax.grad(total)(logp, entropy), None
        return jax.grad(total, (0, 1))(logp, entropy)

    return grads


def _one_pass_differentiable(kernels, plan, with_entropy, token_loss, token_grads):
    def numerator(logp, ent, terms):
        return jnp.sum(token_loss(logp, ent, terms))

    @jax.custom_vjp
    def loss(h, w, targets, inv_temp, terms):
        stats = _forward(kernels, plan, with_entropy, h, w, targets, inv_temp)
        return numerator(stats.logp, stats.entropy, terms), stats.logp, stats.entropy

    def forward(h, w, targets, inv_temp, terms):
        logp, ent, dh, dw = _one_pass(kernels, plan, with_entropy, token_grads, h, w, targets, inv_temp, terms)
        # the gradients wait in the param dtype (a no-op for float32, half the bytes for bf16)
        return (numerator(logp, ent, terms), logp, ent), (dh.astype(h.dtype), dw.astype(w.dtype), inv_temp, terms)

    def backward(residuals, cotangents):
        dh, dw, inv_temp, terms = residuals
        g = cotangents[0]  # logp and entropy leave as stop_gradient: their cotangents are zero
        return ((g * dh).astype(dh.dtype), (g * dw).astype(dw.dtype), None, jnp.zeros_like(inv_temp),
                jax.tree.map(jnp.zeros_like, terms))

    loss.defvjp(forward, backward)
    return loss


def _one_pass(kernels, plan, with_entropy, token_grads, h, w, targets, inv_temp, terms):
    """(logp [B, T], entropy [B, T] or None, d hidden f32, d lm_head f32) for a numerator cotangent of 1."""
    vocab_axis = plan and plan.vocab_axis

    def local(h, w, targets, inv_temp, terms):
        batch, time, width = h.shape
        local_targets = _local_targets(_column(targets), w.shape[1], vocab_axis)
        logp, ent, dh, dw = kernels.one_pass(h.reshape(-1, width), w, local_targets, inv_temp,
                                             jax.tree.map(_column, terms), token_grads, with_entropy, vocab_axis)
        rows = lambda x: None if x is None else x.reshape(batch, time)
        return (rows(logp), rows(ent), *_reduce_grads(plan, dh.reshape(batch, time, width), dw))

    if plan is None:
        return local(h, w, targets, inv_temp, terms)
    spec = plan.specs()
    term_specs = jax.tree.map(lambda _: spec["tokens"], terms)
    in_specs = (spec["hidden"], spec["lm_head"], spec["tokens"], P(), term_specs)
    args = plan.conform((h, w, targets, inv_temp, terms), in_specs)
    out_specs = (spec["tokens"], spec["tokens"] if with_entropy else None, spec["hidden"], spec["lm_head"])
    return jax.shard_map(local, mesh=plan.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)


def _local_targets(targets: Array, local_vocab: int, vocab_axis: str | None) -> Array:
    """Global target ids -> column ids of this vocab shard, -1 when elsewhere."""
    if vocab_axis is None:
        return targets
    local = targets - lax.axis_index(vocab_axis) * local_vocab
    return jnp.where((local >= 0) & (local < local_vocab), local, -1)
