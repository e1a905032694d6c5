"""Causal attention over left-padded rows without a [B, N, T, S] score tensor.

`model.attention` picks the implementation of multi-token attention (training forward
and backward, and the prompt pass of the rollout):

    xla      dense scores and softmax (grouped_query_attention): the reference
    chunked  query blocks x key blocks with an online softmax and a blockwise backward
             (custom VJP keeping only the output and the row log-sum-exp): memory
             O(T x block) on any backend; key blocks above the diagonal are skipped
    splash   the Pallas TPU splash-attention kernel (segment ids for the padding, one
             kernel call per KV head shared by its G query heads)
    cudnn    cuDNN flash attention via jax.nn.dot_product_attention (bf16/fp16 only)
    auto     splash on TPU, cudnn on GPU with a 16-bit dtype, chunked otherwise

Visibility is always "key slot s is real and s <= query slot": `CausalMask` holds the
[B, S] real-slot mask and the slot of query 0 (None when queries are slots 0..T-1). A
sliding-window layer (`window`) also needs query slot - s < window; xla and chunked honour
it, and splash / cudnn hand such a mask to chunked.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from grpo_core.sharding import divides, logical_to_spec

ATTENTION_CHOICES = ("auto", "xla", "chunked", "splash", "cudnn")
MEMORY_EFFICIENT = ("chunked", "splash", "cudnn")
CUDNN_DTYPES = ("bfloat16", "float16")
CHUNK = 128  # query and key block of the chunked path

# Finite "minus infinity", as in grouped_query_attention.
_MASKED = float(jnp.finfo(jnp.float32).min)


def check_attention(name: str) -> str:
    if name not in ATTENTION_CHOICES:
        raise ValueError(f"attention={name!r} is not supported; use one of {', '.join(ATTENTION_CHOICES)}.")
    return name


def resolve_attention(name: str, dtype: Any, backend: str | None = None) -> str:
    """The implementation `name` stands for on `backend` (default: JAX's) with `dtype`."""
    check_attention(name)
    sixteen_bit = jnp.dtype(dtype).name in CUDNN_DTYPES
    if name == "cudnn" and not sixteen_bit:
        raise ValueError(f"attention='cudnn' needs a bfloat16 or float16 model, not {jnp.dtype(dtype).name}; "
                         "use attention 'chunked' or 'auto'.")
    if name != "auto":
        return name
    backend = backend or jax.default_backend()
    if backend == "tpu":
        return "splash"
    return "cudnn" if backend in ("gpu", "cuda", "rocm") and sixteen_bit else "chunked"


@struct.dataclass
class CausalMask:
    """Key slot s is visible to query t iff real[b, s] and s <= offset + t."""

    real: jax.Array  # [B, S] bool
    offset: jax.Array | None = None  # slot of query 0; None: 0 and S == T (no cache)
    impl: str = struct.field(pytree_node=False, default="xla")
    sharding: Any = struct.field(pytree_node=False, default=None)  # (mesh, activation rules) or None
    window: jax.Array | None = None  # [] int32 sliding window of this layer; None: no window

    def dense(self, num_queries: int) -> jax.Array:
        """[B, T, S] bool."""
        query_slot = jnp.arange(num_queries) + (0 if self.offset is None else self.offset)
        causal = within_window(jnp.arange(self.real.shape[1])[None, :], query_slot[:, None], self.window)
        return self.real[:, None, :].astype(jnp.bool_) & causal[None]


def within_window(key_slot: jax.Array, query_slot: jax.Array, window: jax.Array | None) -> jax.Array:
    """Causal (key <= query) and, with a window, query - key < window (HF's sliding mask)."""
    causal = key_slot <= query_slot
    return causal if window is None else causal & (key_slot > query_slot - window)


def memory_efficient_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: CausalMask) -> jax.Array:
    """q [B, T, N, D], k/v [B, S, KV, D] -> [B, T, N, D] with mask.impl in MEMORY_EFFICIENT.
    The prompt pass with a cache (traced offset, no gradient) always runs chunked."""
    real = mask.real.astype(jnp.bool_)
    if mask.offset is not None or mask.impl == "chunked" or mask.window is not None:
        offset = jnp.zeros((), jnp.int32) if mask.offset is None else jnp.asarray(mask.offset, jnp.int32)
        return chunked_attention(q, k, v, real, offset, mask.window)
    if mask.impl == "splash":
        splash = functools.partial(splash_attention, platform=_platform(mask.sharding))
        return _over_mesh(splash, mask.sharding, q, k, v, real)
    if mask.impl == "cudnn":
        return _over_mesh(cudnn_attention, mask.sharding, q, k, v, real)
    raise ValueError(f"attention implementation {mask.impl!r} is not one of {', '.join(MEMORY_EFFICIENT)}.")


# ---- chunked: online softmax over key blocks, blockwise backward ------------------


def _pad_to(x: jax.Array, axis: int, size: int) -> jax.Array:
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def _num_key_blocks(offset, q_block, num_blocks: int):
    """Key blocks holding a slot <= the last query slot of block `q_block`."""
    last_slot = offset + (q_block + 1) * CHUNK - 1
    return jnp.minimum(num_blocks, last_slot // CHUNK + 1)


def _block_scores(qi, kj, rj, q_block, k_block, offset, window):
    """Scaled f32 scores [B, KV, G, bq, bk] of a query block vs a key block, and visibility."""
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qi, kj, preferred_element_type=jnp.float32)
    q_slot = offset + q_block * CHUNK + jnp.arange(CHUNK)
    k_slot = k_block * CHUNK + jnp.arange(CHUNK)
    visible = rj[:, None, None, None, :] & within_window(k_slot[None, :], q_slot[:, None], window)[None, None, None]
    return scores * qi.shape[-1] ** -0.5, visible


def _key_block(x: jax.Array, j) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, j * CHUNK, CHUNK, axis=1)


def _forward_q_block(qi, i, k, v, real, offset, window):
    """Output [B, KV, G, bq, D] (f32) and row log-sum-exp [B, KV, G, bq] of query block i."""

    def step(j, carry):
        m, l, acc = carry
        scores, visible = _block_scores(qi, _key_block(k, j), _key_block(real, j), i, j, offset, window)
        m_new = jnp.maximum(m, jnp.max(jnp.where(visible, scores, _MASKED), axis=-1))
        p = jnp.where(visible, jnp.exp(scores - m_new[..., None]), 0.0)
        rescale = jnp.exp(m - m_new)
        pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), _key_block(v, j),
                        preferred_element_type=jnp.float32)
        return m_new, l * rescale + jnp.sum(p, axis=-1), acc * rescale[..., None] + pv

    b, bq, kv, g, d = qi.shape
    init = (jnp.full((b, kv, g, bq), _MASKED), jnp.zeros((b, kv, g, bq)), jnp.zeros((b, kv, g, bq, d)))
    m, l, acc = jax.lax.fori_loop(0, _num_key_blocks(offset, i, k.shape[1] // CHUNK), step, init)
    seen = l > 0  # a left-pad query sees no key: output 0, never used
    out = acc / jnp.where(seen, l, 1.0)[..., None]
    return out, jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)


def _round_up(size: int) -> int:
    return -(-size // CHUNK) * CHUNK


def _query_blocks(x: jax.Array, kv_heads: int) -> jax.Array:
    """[B, T, N, D] -> [nq, B, bq, KV, G, D], T zero-padded to a CHUNK multiple."""
    b, t, n, d = x.shape
    t_pad = _round_up(t)
    return _pad_to(x, 1, t_pad).reshape(b, t_pad // CHUNK, CHUNK, kv_heads, n // kv_heads, d).swapaxes(0, 1)


def _padded_keys(k, v, real):
    s_pad = _round_up(k.shape[1])
    return _pad_to(k, 1, s_pad), _pad_to(v, 1, s_pad), _pad_to(real, 1, s_pad)


def _unblocked(x: jax.Array, t: int) -> jax.Array:
    """[nq, B, KV, G, bq, D] -> [B, T, N, D]."""
    nq, b, kv, g, bq, d = x.shape
    return x.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * bq, kv * g, d)[:, :t]


@jax.custom_vjp
def chunked_attention(q, k, v, real, offset, window=None):
    """q [B, T, N, D], k/v [B, S, KV, D], real [B, S] bool, offset [] int32, window [] int32 or
    None (a sliding-window layer) -> [B, T, N, D]."""
    return _chunked_forward(q, k, v, real, offset, window)[0]


def _chunked_forward(q, k, v, real, offset, window):
    q_blocks = _query_blocks(q, k.shape[2])
    k, v, real = _padded_keys(k, v, real)
    forward = lambda xs: _forward_q_block(xs[0], xs[1], k, v, real, offset, window)  # noqa: E731
    out, lse = jax.lax.map(forward, (q_blocks, jnp.arange(q_blocks.shape[0])))
    return _unblocked(out, q.shape[1]).astype(q.dtype), lse


def _chunked_fwd(q, k, v, real, offset, window):
    out, lse = _chunked_forward(q, k, v, real, offset, window)
    return out, (q, k, v, real, offset, window, out, lse)


def _add_key_block(acc: jax.Array, block: jax.Array, j) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(acc, _key_block(acc, j) + block, j * CHUNK, axis=1)


def _backward_q_block(carry, xs, k, v, real, offset, window):
    """Adds query block i's share to dk, dv [B, S, KV, D] (f32); returns its dq."""
    qi, doi, lse_i, delta_i, i = xs

    def step(j, inner):
        dqi, dk, dv = inner
        kj, vj = _key_block(k, j), _key_block(v, j)
        scores, visible = _block_scores(qi, kj, _key_block(real, j), i, j, offset, window)
        p = jnp.where(visible, jnp.exp(scores - lse_i[..., None]), 0.0)
        dp = jnp.einsum("bqkgd,bskd->bkgqs", doi, vj, preferred_element_type=jnp.float32)
        ds = (p * (dp - delta_i[..., None]) * qi.shape[-1] ** -0.5).astype(qi.dtype)
        dqi = dqi + jnp.einsum("bkgqs,bskd->bqkgd", ds, kj, preferred_element_type=jnp.float32)
        dk_j = jnp.einsum("bkgqs,bqkgd->bskd", ds, qi, preferred_element_type=jnp.float32)
        dv_j = jnp.einsum("bkgqs,bqkgd->bskd", p.astype(doi.dtype), doi, preferred_element_type=jnp.float32)
        return dqi, _add_key_block(dk, dk_j, j), _add_key_block(dv, dv_j, j)

    dqi, dk, dv = jax.lax.fori_loop(0, _num_key_blocks(offset, i, k.shape[1] // CHUNK), step,
                                    (jnp.zeros(qi.shape, jnp.float32), *carry))
    return (dk, dv), dqi


def _chunked_bwd(residuals, dout):
    q, k_in, v_in, real_in, offset, window, out, lse = residuals
    t, s = q.shape[1], k_in.shape[1]
    q_blocks, do_blocks, out_blocks = (_query_blocks(x, k_in.shape[2]) for x in (q, dout, out))
    k, v, real = _padded_keys(k_in, v_in, real_in)
    delta = jnp.einsum("nbqkgd,nbqkgd->nbkgq", do_blocks.astype(jnp.float32), out_blocks.astype(jnp.float32))
    zeros = jnp.zeros(k.shape, jnp.float32)
    body = functools.partial(_backward_q_block, k=k, v=v, real=real, offset=offset, window=window)
    (dk, dv), dq = jax.lax.scan(body, (zeros, zeros), (q_blocks, do_blocks, lse, delta,
                                                        jnp.arange(q_blocks.shape[0])))
    dq = dq.transpose(1, 0, 2, 3, 4, 5).reshape(q.shape[0], -1, *q.shape[2:])[:, :t]
    return dq.astype(q.dtype), dk[:, :s].astype(k_in.dtype), dv[:, :s].astype(v_in.dtype), None, None, None


chunked_attention.defvjp(_chunked_fwd, _chunked_bwd)


# ---- splash (Pallas TPU) ----------------------------------------------------------


def _splash_block(length: int) -> int:
    return next(size for size in (512, 256, 128) if length % size == 0)


def _splash_kernel(length: int, group: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    block = _splash_block(length)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    mask = splash.MultiHeadMask([splash.CausalMask((length, length))] * group)
    return splash.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret)


def splash_attention(q, k, v, real, platform: str | None = None):
    """Splash kernel per (row, KV head) over its G query heads; T padded to 128s.
    Segment ids: real tokens 1, padding 0, so a real query sees only real keys.
    Off TPU (`platform`, default JAX's backend) the kernel runs in Pallas interpret mode."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    b, t, n, d = q.shape
    kv = k.shape[2]
    length = -(-t // 128) * 128
    kernel = _splash_kernel(length, n // kv, (platform or jax.default_backend()) != "tpu")
    qh = _pad_to(q * d**-0.5, 1, length).reshape(b, length, kv, n // kv, d).transpose(0, 2, 3, 1, 4)
    kh, vh = (_pad_to(x, 1, length).transpose(0, 2, 1, 3) for x in (k, v))  # [B, KV, T, D]
    segments = _pad_to(real.astype(jnp.int32), 1, length)

    def one_row(q_row, k_row, v_row, seg):
        ids = SegmentIds(q=seg, kv=seg)
        return jax.vmap(lambda qg, kg, vg: kernel(qg, kg, vg, segment_ids=ids))(q_row, k_row, v_row)

    out = jax.vmap(one_row)(qh, kh, vh, segments)  # [B, KV, G, T, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, length, n, d)[:, :t]


# ---- cuDNN (GPU) -------------------------------------------------------------------


def _roll_rows(x: jax.Array, shift: jax.Array) -> jax.Array:
    """x [B, T, ...] with row b rotated left by shift[b]."""
    index = (jnp.arange(x.shape[1])[None, :] + shift[:, None]) % x.shape[1]
    return jnp.take_along_axis(x, index.reshape(*index.shape, *([1] * (x.ndim - 2))), axis=1)


def cudnn_attention(q, k, v, real, implementation: str | None = "cudnn"):
    """Left padding turned into right padding (rows rotated), so per-row sequence
    lengths plus is_causal express the mask; GQA is native to the call."""
    lengths = jnp.sum(real, axis=1, dtype=jnp.int32)
    pad = q.shape[1] - lengths
    q, k, v = (_roll_rows(x, pad) for x in (q, k, v))
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lengths,
                                       key_value_seq_lengths=lengths, implementation=implementation)
    return _roll_rows(out, -pad)


# ---- sharding ----------------------------------------------------------------------


def _over_mesh(fn, sharding, q, k, v, real):
    """Run a kernel per device (shard_map) on the batch and head shards the activation
    rules give; heads stay whole unless both N and KV divide their mesh axes."""
    if sharding is None:
        return fn(q, k, v, real)
    mesh, rules = sharding
    batch = _dividing(logical_to_spec(("batch",), rules)[0], q.shape[0], mesh)
    heads = logical_to_spec(("heads",), rules)[0]
    both = _dividing(heads, q.shape[2], mesh) is not None and _dividing(heads, k.shape[2], mesh) is not None
    spec = jax.sharding.PartitionSpec(batch, None, heads if both else None, None)
    real_spec = jax.sharding.PartitionSpec(batch, None)
    return jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec, spec, real_spec), out_specs=spec,
                         check_vma=False)(q, k, v, real)


def _platform(sharding) -> str:
    """Where the attention runs: the mesh's devices (maybe a compile-only target), else JAX's backend."""
    return jax.default_backend() if sharding is None else sharding[0].devices.flat[0].platform


def _dividing(axes, size: int, mesh):
    return axes if axes is not None and divides((size,), jax.sharding.PartitionSpec(axes), mesh) else None

