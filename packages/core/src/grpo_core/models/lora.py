"""LoRA adapters on the stacked decoder projections: y = x . W + scale * (x . A) . B.

The adapters live inside the existing `Projection` modules of the stacked decoder layer
(attribute `lora`, an `Adapter`), so they are stacked over layers like the base, sliced
by the same layer scan, sharded by the same logical axes and rematerialised with the
layer. Flax NNX's `nnx.LoRA` / `nnx.LoRALinear` assume 2-D [in, out] kernels of one
unstacked layer; our kernels keep head axes ([H, N, D], [N, D, H]) and carry a leading
`layers` axis, so only its variable type `nnx.LoRAParam` is reused (it splits the
trainable adapters from the frozen base).

Per target, with the leading layer axis L:
    a  [L, in..., r]    float32, uniform(+-1/sqrt(fan_in)) (as PEFT's default init)
    b  [L, r, out...]   float32, zeros: step 0 is the base model exactly
scale = alpha / r, or alpha / sqrt(r) with rsLoRA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_core.config import LORA_TARGETS

# Target module name -> its path inside the stacked decoder layer (the order of LORA_TARGETS).
TARGET_PATHS = {
    "q_proj": ("self_attn", "q_proj"), "k_proj": ("self_attn", "k_proj"), "v_proj": ("self_attn", "v_proj"),
    "o_proj": ("self_attn", "o_proj"), "gate_proj": ("mlp", "gate_proj"), "up_proj": ("mlp", "up_proj"),
    "down_proj": ("mlp", "down_proj"),
}
ALL_LINEAR = LORA_TARGETS[-1]
assert tuple(TARGET_PATHS) == LORA_TARGETS[:-1]


def resolve_targets(names: Sequence[str]) -> tuple[str, ...]:
    """Target module names in TARGET_PATHS order; `all-linear` stands for every one."""
    unknown = [n for n in names if n != ALL_LINEAR and n not in TARGET_PATHS]
    if unknown:
        raise ValueError(f"unknown LoRA target module {unknown[0]!r}; use {', '.join(TARGET_PATHS)} or {ALL_LINEAR}")
    if not names:
        raise ValueError(f"no LoRA target module; name some of {', '.join(TARGET_PATHS)} or {ALL_LINEAR}")
    return tuple(n for n in TARGET_PATHS if ALL_LINEAR in names or n in names)


@dataclass(frozen=True)
class LoRASpec:
    """What the adapters are: rank, alpha, targets (resolved), rsLoRA scaling."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    rslora: bool = False

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


class Adapter(nnx.Module):
    """The low-rank update of one projection: (x . a) . b * scale, in float32."""

    def __init__(self, a: nnx.LoRAParam, b: nnx.LoRAParam, scale: float, n_in: int):
        self.a, self.b, self.scale, self.n_in = a, b, scale, n_in

    def __call__(self, x: jax.Array) -> jax.Array:
        contract = (tuple(range(x.ndim - self.n_in, x.ndim)), tuple(range(self.n_in)))
        low = jax.lax.dot_general(x, self.a[...], (contract, ((), ())), preferred_element_type=jnp.float32)
        low = low.astype(x.dtype)  # [..., r] in the compute dtype, as the base matmul's input
        b = self.b[...]
        out = jax.lax.dot_general(low, b, (((low.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return out * self.scale


def projection_at(layers: nnx.Module, target: str) -> nnx.Module:
    module = layers
    for name in TARGET_PATHS[target]:
        module = getattr(module, name)
    return module


def target_shapes(kernel_shape: tuple[int, ...], n_in: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(in shape, out shape) of a stacked kernel [L, in..., out...]."""
    return tuple(kernel_shape[1 : 1 + n_in]), tuple(kernel_shape[1 + n_in :])


def _init_a(key: jax.Array, layers: int, in_shape: tuple[int, ...], rank: int) -> jax.Array:
    bound = 1.0 / math.sqrt(math.prod(in_shape))
    return jax.random.uniform(key, (layers, *in_shape, rank), jnp.float32, -bound, bound)


def add_adapters(model: nnx.Module, spec: LoRASpec, key: jax.Array) -> None:
    """Attaches float32 adapters (b = 0) to the targeted projections of `model.layers`, in
    place; logical axis names follow the kernel's (the rank axis is never sharded)."""
    check_targets(spec, model.config)
    for target, target_key in zip(spec.targets, jax.random.split(key, len(spec.targets))):
        proj = projection_at(model.layers, target)
        names = proj.kernel.get_metadata()["out_sharding"]
        in_shape, out_shape = target_shapes(proj.kernel.shape, proj.n_in)
        layers = proj.kernel.shape[0]
        a = _init_a(target_key, layers, in_shape, spec.rank)
        b = jnp.zeros((layers, spec.rank, *out_shape), jnp.float32)
        a_names = (names[0], *names[1 : 1 + proj.n_in], None)
        b_names = (names[0], None, *names[1 + proj.n_in :])
        proj.lora = Adapter(nnx.LoRAParam(a, out_sharding=a_names, eager_sharding=False),
                            nnx.LoRAParam(b, out_sharding=b_names, eager_sharding=False), spec.scale, proj.n_in)


def split_adapters(state: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(adapters, everything else) of a model state with adapters."""
    return nnx.split_state(state, nnx.LoRAParam, ...)


def kernel_path(target: str) -> tuple[str, ...]:
    return ("layers", *TARGET_PATHS[target])


def delta(a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """scale * a . b per layer in float32: [L, in..., r] x [L, r, out...] -> [L, in..., out...]."""
    flat = jnp.einsum("lir,lro->lio", a.reshape(a.shape[0], -1, a.shape[-1]).astype(jnp.float32),
                      b.reshape(b.shape[0], b.shape[1], -1).astype(jnp.float32))
    return (flat * scale).reshape(*a.shape[:-1], *b.shape[2:])


def merged_state(base: nnx.State, adapters: nnx.State, spec: LoRASpec) -> nnx.State:
    """The base state (no adapters) with every targeted kernel replaced by W + scale * A . B,
    summed in float32 and stored in W's dtype."""
    flat = dict(nnx.to_flat_state(base))
    adapter_flat = dict(nnx.to_flat_state(adapters))
    for target in spec.targets:
        path = kernel_path(target)
        kernel = flat[(*path, "kernel")]
        a, b = adapter_flat[(*path, "lora", "a")], adapter_flat[(*path, "lora", "b")]
        w = kernel.get_value()
        merged = (w.astype(jnp.float32) + delta(a.get_value(), b.get_value(), spec.scale)).astype(w.dtype)
        flat[(*path, "kernel")] = kernel.replace(merged)
    return nnx.from_flat_state(list(flat.items()))


def adapter_arrays(adapters: nnx.State, spec: LoRASpec) -> dict[str, tuple[jax.Array, jax.Array]]:
    """target -> (a [L, in..., r], b [L, r, out...])."""
    flat = dict(nnx.to_flat_state(adapters))
    return {t: (flat[(*kernel_path(t), "lora", "a")].get_value(), flat[(*kernel_path(t), "lora", "b")].get_value())
            for t in spec.targets}


def with_adapter_arrays(adapters: nnx.State, arrays: dict[str, tuple[Any, Any]]) -> nnx.State:
    """`adapters` with the arrays of `arrays` (target -> (a, b)) in place of its own."""
    flat = dict(nnx.to_flat_state(adapters))
    for target, pair in arrays.items():
        for name, value in zip(("a", "b"), pair):
            where = (*kernel_path(target), "lora", name)
            flat[where] = flat[where].replace(jnp.asarray(value, flat[where].get_value().dtype))
    return nnx.from_flat_state(list(flat.items()))


def check_targets(spec: LoRASpec, cfg: Any) -> None:
    """A target the model has no dense projection for (a MoE model's MLP is routed experts, which
    take no adapter yet) is refused, naming the targets it has."""
    shapes = layer_shapes(cfg)
    missing = [t for t in spec.targets if t not in shapes]
    if missing:
        raise ValueError(f"LoRA target {missing[0]!r} is not a dense projection of a {cfg.model_type} model (its "
                         f"MLP is routed experts, which LoRA does not adapt yet); target some of {', '.join(shapes)}")


def check_rank_fits(spec: LoRASpec, shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
    """A rank above a target's fan-in or fan-out adds nothing a full update would not (and
    wastes memory): refused. `shapes`: target -> (in shape, out shape) of one layer."""
    for target in spec.targets:
        fan_in, fan_out = (math.prod(s) for s in shapes[target])
        if spec.rank > min(fan_in, fan_out):
            raise ValueError(f"rank {spec.rank} is larger than {target}'s dims ({fan_in} in, {fan_out} out)")


def layer_shapes(cfg: Any) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """target -> (in shape, out shape) of one layer's kernel, from a QwenConfig (attention only when
    the family's MLP is routed experts)."""
    h, n, kv, d, i = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                      cfg.intermediate_size)
    attention = {"q_proj": ((h,), (n, d)), "k_proj": ((h,), (kv, d)), "v_proj": ((h,), (kv, d)), "o_proj": ((n, d), (h,))}
    if cfg.family.sparse_mlp:
        return attention
    return {**attention, "gate_proj": ((h,), (i,)), "up_proj": ((h,), (i,)), "down_proj": ((i,), (h,))}
