"""The jitted policy update: micro-batched GRPO loss with exact gradient accumulation.

One call = one optimizer update over the whole rollout batch:
    grads = sum_k grad(numerator_k) / sum_k denominator_k
which is the gradient of the big-batch loss for every aggregation, because the
denominators depend on the masks only (see grpo_losses.objective). A non-finite
loss or gradient, or an update that would make a param non-finite, leaves params and
optimizer state untouched.

Precision: the forward and backward run on the params cast to `compute_dtype`
(grpo_core.models.precision); the gradients of the stored params (float32 masters)
are summed over micro-batches in float32. With scanned layers and full remat, the layer
gradients are summed inside the backward layer loop (grpo_core.models.layer_grads): no
per-micro-batch gradient buffer beside the accumulator.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct

from grpo_core.config import LossConfig
from grpo_core.models.precision import compute_params, update_ratio
from grpo_losses import LossMetrics, finalize_loss, grpo_loss, per_token_logps
from grpo_losses.full_kl import FullKLTerm, full_kl_numerator
from grpo_losses.objective import token_weights

from grpo_runner_gsm8k.training.router_term import router_update_terms


@struct.dataclass
class UpdateBatch:
    """A rollout batch ready for the update. N rows, T columns, C = T - prompt_width.

    input_ids, attention_mask [N, T]; targets, loss_mask [N, C] (completion tokens,
    already multiplied by the dynamic-sampling keep mask); advantages [N] per row, or
    [N, C] per token (sharded like loss_mask; see `update_advantages`);
    old_logp / ref_logp [N, C] or None; sampler_logp [N, C] the rollout's log-probs, carried
    only when the loss corrects rollout/training mismatch (`loss.mismatch_correction`);
    teacher_hidden [N, C, H_teacher] the teacher's states that predict the completion tokens and
    teacher_head [H_teacher, V] its LM head, with `teacher.estimator: full` (grpo_losses.full_kl);
    the head is one per update, never split into micro-batches; routing [N, T, L, k] int, a
    mixture-of-experts rollout's experts per token and layer (-1: none) with `loss.routing_replay`:
    every forward of the update replays them (grpo_core.models.moe.replayed).
    """

    input_ids: jax.Array
    attention_mask: jax.Array
    targets: jax.Array
    loss_mask: jax.Array
    advantages: jax.Array
    old_logp: Optional[jax.Array] = None
    ref_logp: Optional[jax.Array] = None
    sampler_logp: Optional[jax.Array] = None
    teacher_hidden: Optional[jax.Array] = None
    teacher_head: Optional[jax.Array] = None
    routing: Optional[jax.Array] = None
    prompt_width: int = struct.field(pytree_node=False, default=1)


def update_advantages(advantages: Any, completion_width: int) -> np.ndarray:
    """float32 advantages for `UpdateBatch`: per row [N] as given, or per token [N, W] aligned
    with the rollout's completion columns (W = rollout.max_new_tokens, or already the trained
    width) cut to the trained completion columns [N, completion_width]: the training batch
    keeps completion columns 0 .. C-1 (grpo_core.rollout_records.trim_batch)."""
    values = np.asarray(advantages, np.float32)
    if values.ndim == 1 or (values.ndim == 2 and values.shape[1] >= completion_width):
        return values if values.ndim == 1 else values[:, :completion_width]
    raise ValueError(f"advantages have shape {values.shape}; the update takes one per row [N] or one per "
                     f"completion token [N, W] with W >= the {completion_width} trained completion columns "
                     "(align a per-token advantage with the rollout's completion columns)")


def completion_hidden(graphdef: nnx.GraphDef, params: nnx.State, input_ids, attention_mask,
                      prompt_width: int, routing=None) -> tuple[jax.Array, jax.Array]:
    """Hidden states that predict the completion tokens [N, C, H], and the LM head [H, V].

    Only completion positions go through the LM head: the prompt never needs logits. `routing`:
    the experts to replay (`UpdateBatch.routing`), or None.
    """
    model = nnx.merge(graphdef, params)
    hidden = model(input_ids, attention_mask=attention_mask, routing=routing)
    return predicting_completion(hidden, prompt_width), model.lm_head_weight()


def predicting_completion(hidden: jax.Array, prompt_width: int) -> jax.Array:
    """[N, T, H] -> [N, C, H]: the positions whose next token is a completion token."""
    return hidden[:, prompt_width - 1 : -1]


def make_score(graphdef: nnx.GraphDef, impl: Any, temperature: float):
    """A jitted `score(params, input_ids, attention_mask, targets, prompt_width=..., routing=None)`:
    per-token log-probs [N, C] of the completion tokens (no gradient needed), the experts of
    `routing` replayed (`UpdateBatch.routing`)."""

    @functools.partial(jax.jit, static_argnames="prompt_width")
    def score(params, input_ids, attention_mask, targets, prompt_width: int, routing=None) -> jax.Array:
        hidden, lm_head = completion_hidden(graphdef, params, input_ids, attention_mask, prompt_width, routing)
        return per_token_logps(impl, hidden, lm_head, targets, temperature)

    return score


def make_completion_hidden(graphdef: nnx.GraphDef):
    """A jitted `hidden(params, input_ids, attention_mask, prompt_width=...)`: the states that
    predict the completion tokens [N, C, H] (a teacher's side of the full reverse KL)."""

    @functools.partial(jax.jit, static_argnames="prompt_width")
    def hidden(params, input_ids, attention_mask, prompt_width: int) -> jax.Array:
        return completion_hidden(graphdef, params, input_ids, attention_mask, prompt_width)[0]

    return hidden


def _split_micro(batch: UpdateBatch, micro_batches: int) -> UpdateBatch:
    """[N, ...] leaves -> [M, N / M, ...] for lax.scan; micro-batch m holds rows m, m + M, ...

    Strided, not contiguous: rows are sharded over the data devices in contiguous blocks
    whose size is a multiple of M, so every micro-batch takes the same number of rows
    from each device's own block and is never moved between devices. (The row order
    does not matter: the loss sums numerators and denominators over all rows.)
    """
    def split(x):
        strided = x.reshape(x.shape[0] // micro_batches, micro_batches, *x.shape[1:])
        return jnp.swapaxes(strided, 0, 1)

    return jax.tree.map(split, batch)


def _merge_stacked(stacked: LossMetrics, count: int) -> LossMetrics:
    parts = [jax.tree.map(lambda x: x[i], stacked) for i in range(count)]
    return functools.reduce(LossMetrics.merge, parts)


def _all_finite(tree) -> jax.Array:
    return functools.reduce(jnp.logical_and, [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)])


def _where_tree(pred, new, old):
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), new, old)


def _add_f32(total, g):
    return total + g.astype(jnp.float32)


def split_layers(state: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(the stacked decoder layers, everything else) of a model's state."""
    return nnx.split_state(state, nnx.PathContains("layers"), ...)


def accumulates_in_backward(graphdef: nnx.GraphDef, params: nnx.State, micro_batches: int) -> bool:
    """Whether the layer gradients are summed inside the backward layer loop: several
    micro-batches (so there is an accumulator to sum into) and layers scanned with full
    remat. Otherwise jax.grad: with one micro-batch its gradient buffer is the sum, and the
    TPU compiler's plan for the 7B v4-16 preset is 2.4 GiB smaller that way."""
    model = nnx.merge(graphdef, params)
    return (micro_batches > 1 and hasattr(model, "accumulating_forward") and model.scan_layers
            and model.remat == "full")


LossTerms = Callable[[jax.Array, jax.Array, UpdateBatch], tuple[jax.Array, tuple[jax.Array, LossMetrics]]]


def _micro_step(graphdef: nnx.GraphDef, loss_terms: LossTerms, weights: nnx.State, frozen: Any = None):
    """Scan body over micro-batches: grads (float32) += jax.grad of this micro-batch's
    numerator w.r.t. `weights` (the params in the compute dtype); `frozen` (LoRA's base,
    or None) completes the model's state and gets no gradient."""
    def numerator(w, mb: UpdateBatch):
        state = w if frozen is None else nnx.merge_state(frozen, w)
        hidden = completion_hidden(graphdef, state, mb.input_ids, mb.attention_mask, mb.prompt_width, mb.routing)
        return loss_terms(*hidden, mb)

    grad_fn = jax.value_and_grad(numerator, has_aux=True)

    def body(grads, mb: UpdateBatch):
        (num, (den, metrics)), g = grad_fn(weights, mb)
        return jax.tree.map(_add_f32, grads, g), (num, den, metrics)

    return body


def _micro_step_in_backward(graphdef: nnx.GraphDef, loss_terms: LossTerms, compute_dtype: Any,
                            layers: nnx.State, others: nnx.State):
    """Scan body over micro-batches for scanned, fully rematerialised layers: `layers`
    (stored dtype) are cast one at a time in the layer loop and their gradients added to
    the layer part of grads inside the backward loop (grpo_core.models.layer_grads);
    `others` (compute dtype) are differentiated as usual."""
    def numerator(other_weights, layer_grads, mb: UpdateBatch):
        model = nnx.merge(graphdef, nnx.merge_state(layers, other_weights))
        hidden, layer_grads = model.accumulating_forward(mb.input_ids, mb.attention_mask, layer_grads, compute_dtype,
                                                         mb.routing)
        num, aux = loss_terms(predicting_completion(hidden, mb.prompt_width), model.lm_head_weight(), mb)
        return (num, layer_grads), aux

    def body(grads, mb: UpdateBatch):
        layer_total, other_total = split_layers(grads)
        (num, _), vjp, (den, metrics) = jax.vjp(functools.partial(numerator, mb=mb), others,
                                                layer_total["layers"], has_aux=True)
        other_g, layer_sum = vjp((jnp.ones_like(num), layer_total["layers"]))  # seeded: total + gradient
        new_total = nnx.merge_state(nnx.State({"layers": layer_sum}), jax.tree.map(_add_f32, other_total, other_g))
        return new_total, (num, den, metrics)

    return body


def _accumulate(graphdef: nnx.GraphDef, loss_terms: LossTerms, compute_dtype: Any, micro_batches: int,
                params: nnx.State, batch: UpdateBatch, frozen: Any = None):
    """(float32 gradient sums, numerator, denominator, metrics) over the micro-batches. The
    params are cast to the compute dtype once per update, not per micro-batch (the
    gradient w.r.t. the copy is the gradient w.r.t. the params: a cast's transpose is a cast).
    With `frozen` (LoRA's base, already in the compute dtype) `params` are the adapters:
    jax.grad w.r.t. them alone, whose gradient buffer is adapter-sized."""
    if batch.teacher_head is not None:  # one per update: every micro-batch's loss sees the whole head
        loss_terms, batch = _with_teacher_head(loss_terms, batch.teacher_head), batch.replace(teacher_head=None)
    if frozen is not None:
        body = _micro_step(graphdef, loss_terms, compute_params(params, compute_dtype), frozen)
    elif accumulates_in_backward(graphdef, params, micro_batches):
        layers, others = split_layers(params)
        body = _micro_step_in_backward(graphdef, loss_terms, compute_dtype, layers, compute_params(others, compute_dtype))
    else:
        body = _micro_step(graphdef, loss_terms, compute_params(params, compute_dtype))
    zeros = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=jnp.float32), params)
    grads, (nums, dens, metrics) = jax.lax.scan(body, zeros, _split_micro(batch, micro_batches))
    return grads, jnp.sum(nums), jnp.sum(dens), _merge_stacked(metrics, micro_batches)


def _with_teacher_head(loss_terms: LossTerms, head: jax.Array) -> LossTerms:
    return lambda hidden, lm_head, mb: loss_terms(hidden, lm_head, mb.replace(teacher_head=head))


def apply_finite_update(optimizer: optax.GradientTransformation, grads, opt_state, params, finite: jax.Array,
                         grads_stored: bool):
    """(params, opt_state, update_ratio, applied) after the optimizer step, or the inputs,
    ratio 0 and applied false when `finite` is false or the update or the params it makes
    are not finite (a huge lr can overflow them from a finite gradient).

    Two passes over the update: the first only reduces it (is it finite, its applied size,
    which is not finite when a new parameter would not be), so it is never stored; the
    second recomputes it elementwise and writes params and moments in place. The barrier
    keeps the compiler from merging them. `grads_stored`: the float32 gradient sums are a
    buffer anyway (several micro-batches), so they join the barrier and no scaled copy is
    shared between the passes; otherwise they stay out, not to force a float32 copy of
    jax.grad's compute-dtype gradients. TPU plans, train-step temp against one pass:
    Qwen2.5-3B v6e-8 (4 micro-batches) 5.73 -> 4.76 GiB, Qwen2.5-7B v4-16 (one) 8.87 -> 6.10."""
    updates, _ = optimizer.update(grads, opt_state, params)
    ratio = update_ratio(params, updates)
    finite = finite & _all_finite(updates) & jnp.isfinite(ratio)
    if grads_stored:
        finite, grads, opt_state, params = jax.lax.optimization_barrier((finite, grads, opt_state, params))
    else:
        finite, opt_state, params = jax.lax.optimization_barrier((finite, opt_state, params))
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = _where_tree(finite, optax.apply_updates(params, updates), params)
    return new_params, _where_tree(finite, new_opt_state, opt_state), jnp.where(finite, ratio, 0.0), finite


def make_update(graphdef: nnx.GraphDef, impl: Any, loss_cfg: LossConfig, optimizer: optax.GradientTransformation,
                temperature: float, micro_batches: int, compute_dtype: Any = None, full_kl: Optional[FullKLTerm] = None,
                router_coef: Optional[float] = None):
    """A jitted `update(params, opt_state, batch, frozen=None) -> (params, opt_state, metrics)`;
    the forward and backward run in `compute_dtype` (None: the params' own dtype). `frozen`:
    a LoRA run's base state (params are then its adapters; see grpo_runner_gsm8k.assembly.adapters).
    A batch with teacher states adds `full_kl.coef` * the exact KL of `full_kl.divergence` (grpo_losses.full_kl).
    `router_coef` (a mixture-of-experts model; None for a dense one): router/* metrics, and that
    coefficient * the load-balancing loss's gradient added (training.router_term)."""

    def loss_terms(hidden, lm_head, mb: UpdateBatch):
        out = grpo_loss(impl, hidden, lm_head, mb.targets, mb.loss_mask, mb.advantages, mb.old_logp,
                        mb.ref_logp, loss_cfg, temperature=temperature, sampler_logp=mb.sampler_logp)
        if mb.teacher_hidden is None:
            return out.numerator, (out.denominator, out.metrics)
        kl_numerator, kl_sum = full_kl_numerator(impl, hidden, lm_head, mb.teacher_hidden, mb.teacher_head,
                                                 mb.loss_mask, token_weights(mb.loss_mask.astype(jnp.float32), loss_cfg),
                                                 temperature, full_kl.divergence)
        metrics = out.metrics._replace(distill_kl_sum=kl_sum)
        return out.numerator + full_kl.coef * kl_numerator, (out.denominator, metrics)

    accumulate = functools.partial(_accumulate, graphdef, loss_terms, compute_dtype, micro_batches)
    with_router_terms = router_update_terms(graphdef, compute_dtype, router_coef)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def update(params, opt_state, batch: UpdateBatch, frozen=None):
        grads, numerator, denominator, metrics = accumulate(params, batch, frozen)
        grads = jax.tree.map(lambda g: g / jnp.maximum(denominator, 1.0), grads)
        grads, router = with_router_terms(grads, params, batch, frozen)
        loss = finalize_loss(numerator, denominator)
        grad_norm = optax.tree.norm(grads)
        new_params, new_opt_state, ratio, applied = apply_finite_update(
            optimizer, grads, opt_state, params, jnp.isfinite(loss) & jnp.isfinite(grad_norm), micro_batches > 1)
        out = {"loss": loss, "grad_norm": grad_norm, "skipped": (~applied).astype(jnp.float32),
               "update_ratio": ratio, **metrics.summary(), **router}
        return new_params, new_opt_state, out

    return update
