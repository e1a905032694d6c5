"""The `jax` rollout backend: bucketed prompts, jitted prefill + while-loop decode."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from grpo_rollout.decode import (check_batch_divisible, decode, lay_out,
                                 group_sharding, place, prefill, prefill_shared, rollout_graphdef)
from grpo_rollout.decode_plan import compile_decode
from grpo_rollout.kept_cache import admission_batch, admit, compact, kept_counts, kept_width, round_start
from grpo_rollout.kept_plan import compile_round as compile_kept_round, kept_cache as kept_round_cache
from grpo_rollout.kept_shared import SharedRounds, SlotGroups
from grpo_rollout.gather import SPLIT_LAYOUTS, AutoDecoders, layout_static
from grpo_rollout.results import abstract_outputs, finish
from grpo_rollout.segments import run_segments, segment_count
from grpo_rollout.quantize import (KV_CACHE_DTYPES, QUANTIZE_MODES, abstract_quantized, compile_quantize, kv_cache_refusal,
                                   quantize_weights)
from grpo_rollout.prompts import DEFAULT_PROMPT_BUCKETS, bucket_length, fit_to_bucket, left_pad, repeat_samples
from grpo_core.rollout_records import DEFAULT_TRIM_BUCKET, RolloutResult, TrainBatch, trim_batch, trimmed_widths
from grpo_core.contracts import PhaseCompiler, Policy, RolloutShapes, RolloutWidths, SamplingParams
from grpo_rollout.sampling import DEFAULT_TOP_P_CANDIDATES

CACHE_DTYPES = (None, "float32", "bfloat16")
DECODE_ATTENTION = ("rollout", "model")


@dataclass(frozen=True)
class JaxRolloutOptions:
    """`rollout.options` of the `jax` backend.

    prompt_buckets:   allowed prompt widths (tokens); a batch is left-padded to the
                      smallest one that fits its longest prompt.
    trim_bucket:      training sequences are cut to the real max length rounded up to this.
    cache_dtype:      KV-cache dtype; null uses the model's dtype.
    cdf_block:        vocabulary block width of the two-level inverse-CDF sampler;
                      0 picks a divisor near sqrt(vocab).
    top_p_candidates: top-p first searches the nucleus among this many tokens and falls
                      back to an exact full-vocabulary threshold search when it is larger.
    decode_attention: "rollout" = the single-query decode attention of this package
                      (grpo_rollout.attention); "model" = the model's cached forward.
    gather_weights:   replicate the weights on every device for the decode loop (one
                      all-gather per rollout instead of per-token collectives when
                      they are FSDP-sharded; needs a full weight copy per device).
                      "auto": gather when the gathered decode, compiled for the batch,
                      fits in the free memory of every device (see grpo_rollout.gather).
                      "model_parallel": reshard them once per rollout by heads, MLP
                      columns and vocabulary over the batch devices, so each device
                      reads ~1/D of them per token and only activations move
                      (grpo_rollout.model_parallel).
                      "head_parallel": the attention where its KV heads are, the
                      MLP and vocabulary split over all devices: 2 collectives per
                      layer and token (grpo_rollout.head_parallel).
                      "expert_parallel": as model_parallel, with a mixture-of-experts
                      model's experts whole on each device (E / D each): the tokens
                      go to the experts, their outputs are all-reduced.
    shared_prompt:    prefill each prompt once for its n samples and keep its KV cache once
                      per group, the decode attending over it once per group (cascade
                      attention, grpo_rollout.cascade): n times fewer prefill FLOPs and
                      prompt-cache bytes, the same tokens. false repeats each prompt n
                      times. Used with decode_attention=rollout and n > 1 by `generate`, and
                      by `generate_round` given the slots' groups (a prompt table,
                      grpo_rollout.kept_shared).
    decode_segments:  K: `generate` decodes as K jitted loops over consecutive step ranges, each
                      attending over the completion cache only as far as its last step fills it
                      (grpo_rollout.segments; decode_attention=rollout). "auto": one per 128 new
                      tokens, at most 8 (1 below 256 new tokens: no extra compile).
    """

    prompt_buckets: list | tuple = DEFAULT_PROMPT_BUCKETS  # YAML gives a list; stored as a tuple
    trim_bucket: int = DEFAULT_TRIM_BUCKET
    cache_dtype: str | None = None
    cdf_block: int = 0
    top_p_candidates: int = DEFAULT_TOP_P_CANDIDATES
    decode_attention: str = "rollout"
    gather_weights: bool | str = "auto"
    shared_prompt: bool = True
    decode_segments: int | str = "auto"

    def __post_init__(self) -> None:
        buckets = tuple(sorted(int(b) for b in self.prompt_buckets))
        object.__setattr__(self, "prompt_buckets", buckets)
        if not buckets or buckets[0] < 1:
            raise ValueError(f"prompt_buckets={list(buckets)} must be non-empty positive token counts.")
        if self.trim_bucket < 1:
            raise ValueError(f"trim_bucket={self.trim_bucket} must be >= 1.")
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"cache_dtype={self.cache_dtype!r} is not supported; use null, float32 or bfloat16.")
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention={self.decode_attention!r} is not supported; use one of "
                             f"{', '.join(DECODE_ATTENTION)}.")
        if not (isinstance(self.gather_weights, bool) or self.gather_weights in ("auto", *SPLIT_LAYOUTS)):
            raise ValueError(f"gather_weights={self.gather_weights!r} must be true, false, auto, model_parallel, "
                             "head_parallel or expert_parallel.")
        if self.gather_weights in SPLIT_LAYOUTS and self.decode_attention != "rollout":
            raise ValueError(f"gather_weights={self.gather_weights} runs the rollout's own decode step; set "
                             "decode_attention=rollout")
        if self.decode_segments != "auto" and (isinstance(self.decode_segments, bool)
                                               or not isinstance(self.decode_segments, int) or self.decode_segments < 1):
            raise ValueError(f"decode_segments={self.decode_segments!r} must be auto or a whole number >= 1.")
        if self.cdf_block < 0 or self.top_p_candidates < 1:
            raise ValueError(f"cdf_block={self.cdf_block} must be >= 0 and "
                             f"top_p_candidates={self.top_p_candidates} >= 1.")


class JaxRollout:
    """Samples `sampling.n` completions per prompt with the KV-cached jitted decoder
    (implements `grpo_core.contracts.RolloutBackend`).

    Example::

        rollout = JaxRollout(JaxRolloutOptions())
        rollout.load_weights(Policy.of(model))
        sampling = SamplingParams(max_new_tokens=64, n=8, temperature=1.0,
                                  stop_token_ids=(tokenizer.eos_token_id,))
        result = rollout.generate(token_lists, jax.random.key(0), sampling,
                                  pad_token_id=tokenizer.pad_token_id)
        batch = rollout.trim(result)
    """

    def __init__(self, options: JaxRolloutOptions | None = None):
        self.options = options or JaxRolloutOptions()
        self._graphdef: Any = None
        self._weights: Any = None
        self._auto_decoders = AutoDecoders()
        # memory_check(phase name, compiled) runs before a batch shape's first prefill and decode
        # (the run sets it to refuse what does not fit; the jit calls then reuse those compiles).
        self.memory_check: Callable[[str, Any], None] | None = None
        self._checked: set[Any] = set()
        self._kept: Any = None  # the KV cache of `generate_round`'s slots, kept between rounds
        self._shared = SharedRounds()  # their groups' prompt table (grpo_rollout.kept_shared)
        self.quantize = "none"  # rollout.quantize (grpo_rollout.quantize); see `quantize_with`
        self.kv_cache_dtype = "auto"  # rollout.kv_cache_dtype; see `kv_cache_with`

    def project_decodes_with(self, projector: Any) -> None:
        """`projector(compiled decode, steps)` -> projected seconds: `gather_weights: auto` then
        takes the fastest projected decode layout that fits (grpo_rollout.gather)."""
        self._auto_decoders.projector = projector

    def quantize_with(self, mode: str) -> None:
        """Sample from `mode`-quantized weights (grpo_rollout.quantize), made on device at each
        `load_weights`, in every decode layout (the split layouts split the 8-bit values and their scales alike)."""
        if mode not in QUANTIZE_MODES:
            raise ValueError(f"rollout.quantize={mode!r} is not supported; use one of {', '.join(QUANTIZE_MODES)}.")
        self.quantize = mode

    def kv_cache_with(self, dtype: str) -> None:
        """Store the decode's KV cache as `dtype`: auto, the options' cache_dtype; int8 | fp8, 8-bit values with
        one f32 scale per token and KV head (grpo_core.models.kv_quant), read back in the model's dtype.
        Those serve `generate` in every decode layout; the rest is refused (`kv_cache_refusal`, and `generate_round`)."""
        if dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"rollout.kv_cache_dtype={dtype!r} is not supported; use one of "
                             f"{', '.join(KV_CACHE_DTYPES)}.")
        refusal = kv_cache_refusal(self.options, dtype) if dtype != "auto" else None
        if refusal:
            raise ValueError(refusal)
        self.kv_cache_dtype = dtype

    def load_weights(self, policy: Policy) -> None:
        """Sample from the policy's weights until the next call (no copy: the arrays are shared;
        quantized, a copy made from them now)."""
        self._graphdef, self._weights = policy.graphdef, quantize_weights(policy.graphdef, policy.weights,
                                                                          self.quantize)

    def release_weights(self) -> None:
        self._graphdef = self._weights = None

    def generate(self, prompts: Sequence[Sequence[int]], key: jax.Array, sampling: SamplingParams, *,
                 pad_token_id: int = 0, batch_sharding: NamedSharding | None = None) -> RolloutResult:
        """Token lists (unpadded) -> RolloutResult; see `generate_padded`."""
        ids, mask = left_pad(prompts, pad_token_id, self.options.prompt_buckets)
        return self.generate_padded(ids, mask, key, sampling, pad_token_id=pad_token_id,
                                    batch_sharding=batch_sharding)

    def generate_padded(self, prompt_ids: Any, prompt_mask: Any, key: jax.Array, sampling: SamplingParams, *,
                        pad_token_id: int = 0, batch_sharding: NamedSharding | None = None) -> RolloutResult:
        """Sample `sampling.n` completions for each left-padded prompt row.

        prompt_ids, prompt_mask: [P, T] host arrays, left-padded; re-padded to a bucket.
                        With several processes every process passes the same global batch.
        key:            a jax PRNG key; the same key, prompts and params give the same rollout.
        batch_sharding: NamedSharding of the [P * n, ...] rollout batch (dimension 0 over
                        the data axes of the mesh), or None for the default device.
        """
        if self._weights is None:
            raise RuntimeError("JaxRollout.generate without weights: call load_weights(policy) first.")
        prompts, prompt_mask = fit_to_bucket(prompt_ids, prompt_mask, pad_token_id, self.options.prompt_buckets)
        ids, mask = repeat_samples(prompts, sampling.n), repeat_samples(prompt_mask, sampling.n)
        check_batch_divisible(ids.shape[0], sampling.n, batch_sharding)
        ids, mask = place(ids, batch_sharding), place(mask, batch_sharding)
        static = self.static_args(self._graphdef, self._weights, sampling, pad_token_id, batch_sharding)
        first = self.prefill_phase(sampling)
        if first is prefill_shared:
            prompts = place(prompts, group_sharding(batch_sharding, len(prompts)))
            prompt_mask = place(prompt_mask, group_sharding(batch_sharding, len(prompts)))
        else:
            prompts, prompt_mask = ids, mask
        self._check_memory(prompts, prompt_mask, key, static)
        cache, state = first(self._weights, prompts, prompt_mask, key, **static)
        _, state = self._segmented_decode(cache, state, key, static)
        return finish(ids, mask, state, sampling)

    def decode_segments(self, sampling: SamplingParams) -> int:
        """Segments `generate` decodes in (grpo_rollout.segments): the rollout's own attention only."""
        if self.options.decode_attention != "rollout":
            return 1
        return segment_count(self.options.decode_segments, sampling.max_new_tokens)

    def _segmented_decode(self, cache, state, key, static: dict[str, Any]):
        """The decode as `decode_segments` loops, all in the layout `auto` chose for the last one
        (whose view is the whole cache), the weights and cache moved into it once."""
        segments = self.decode_segments(static["params"])
        last = self.decoder(self._weights, cache, state, key, static, segments)
        if segments == 1:
            return last(self._weights, cache, state, key)
        layout = self._auto_decoders.layout(cache, state, static) if self.options.gather_weights == "auto" else None
        chosen = static if layout is None else layout_static(static, layout)
        weights, cache = lay_out(self._weights, cache, chosen)  # once: no segment gathers or reshards them
        return run_segments(lambda until: functools.partial(decode, **chosen, until=until),
                            weights, cache, state, key, static["params"].max_new_tokens, segments)

    def prefill_phase(self, sampling: SamplingParams) -> Callable[..., Any]:
        """`prefill_shared` (the prompts [P, Tp] once each) where `shared_prompt` applies, else
        `prefill` (the prompts repeated n times, [P * n, Tp])."""
        shared = self.options.shared_prompt and self.options.decode_attention == "rollout" and sampling.n > 1
        return prefill_shared if shared else prefill

    def generate_round(self, prefixes: Sequence[Sequence[int]], cached: Sequence[bool], key: jax.Array,
                       sampling: SamplingParams, *, pad_token_id: int = 0,
                       batch_sharding: NamedSharding | None = None, kept_tokens: Sequence[int] | None = None,
                       live: Sequence[bool] | None = None, groups: SlotGroups | None = None) -> RolloutResult:
        """One round of at most `sampling.max_new_tokens` tokens per slot on the KV cache kept from the
        previous round (grpo_rollout.kept_cache). prefixes: each slot's prompt plus tokens so far; cached[i]:
        slot i continues on its cache, which holds kept_tokens[i] of them (default all but the last; the others
        but the last are run in first), else the prefix is admitted. live[i] False: slot i samples nothing and
        keeps its cache. key: one key, or one per slot. The slots' cache is kept for the next round. groups:
        the slots' groups, whose prompts are then kept once each (grpo_rollout.kept_shared) where
        `shares_round_prompts`; an empty slot (group None) samples nothing."""
        self._check_round(len(prefixes), sum(cached))
        check_batch_divisible(len(prefixes), 1, batch_sharding)
        static = self.static_args(self._graphdef, self._weights, dataclasses.replace(sampling, n=1), pad_token_id,
                                  batch_sharding)
        shared = groups is not None and self.shares_round_prompts
        if shared:
            if kept_tokens is not None:
                raise ValueError("generate_round: tokens appended to kept rows (kept_tokens) need groups=None")
            live = [g is not None and (live is None or live[i]) for i, g in enumerate(groups.ids)]
            cache = self._shared.round_cache(nnx.merge(self._graphdef, self._weights), self._weights, self._kept,
                                             self.options, (prefixes, cached, groups), sampling.max_new_tokens, static)
        else:
            cache = self._round_cache(prefixes, cached, kept_counts(prefixes, cached, kept_tokens),
                                      sampling.max_new_tokens, pad_token_id, batch_sharding, static)
        last = np.array([[p[-1]] for p in prefixes], np.int32)  # [N, 1]: each slot's next token to feed
        rows_live = None if live is None else place(np.asarray(live, bool), batch_sharding)
        state = round_start(place(last[:, 0], batch_sharding), sampling.max_new_tokens, pad_token_id, batch_sharding,
                            rows_live)
        self._check_round_memory(cache, state, key, static)
        cache, state = self.decoder(self._weights, cache, state, key, static)(self._weights, cache, state, key)
        self._kept, self._shared.table = (cache.completion, cache.prompt) if shared else (cache, None)
        return finish(last, np.ones_like(last), state, static["params"])

    def _check_round(self, slots: int, cached: int) -> None:
        """`generate_round` refuses to run without weights or on a kept cache that is not there."""
        if self._weights is None:
            raise RuntimeError("JaxRollout.generate_round without weights: call load_weights(policy) first.")
        if cached and (self._kept is None or self._kept.mask.shape[0] != slots):
            raise ValueError(f"generate_round: {cached} slots continue from a kept cache, but none is kept "
                             f"for {slots} slots; mark them uncached (their prefixes are then admitted).")

    def _round_cache(self, prefixes, cached, counts, budget: int, pad_token_id: int, batch_sharding, static) -> Any:
        """The slots' cache compacted and with the admitted and appended tokens written, room for
        `budget` tokens."""
        buckets = self.options.prompt_buckets
        ids, mask = admission_batch(prefixes, counts, pad_token_id, buckets, follow=cached)
        base = kept_width(counts, buckets)
        cache = self._kept
        if cache is None:
            model = nnx.merge(self._graphdef, self._weights)
            cache = model.init_cache(len(prefixes), 0, self.cache_dtype)
        cache = compact(cache, place(np.asarray(cached, bool), batch_sharding), base=base,
                        width=base + ids.shape[1] + budget, batch_sharding=batch_sharding)
        if ids.shape[1]:
            cache = admit(self._weights, cache, place(ids, batch_sharding), place(mask, batch_sharding), **static)
        return cache

    def release_kept_cache(self) -> None:
        """Frees the slots' kept cache (the next `generate_round` then admits every slot)."""
        self._kept = None
        self._shared.release()

    @property
    def shares_round_prompts(self) -> bool:
        """`generate_round` keeps each group's prompt once when given the slots' groups."""
        return self.options.shared_prompt and self.options.decode_attention == "rollout"

    def _check_round_memory(self, cache, state, key: jax.Array, static: dict[str, Any]) -> None:
        """Hands a round's decode, compiled for a new cache width, to `memory_check` before it runs."""
        signature = ("round", tuple(a.shape for a in jax.tree.leaves(cache)), state.tokens.shape,
                     tuple(sorted(static.items(), key=lambda kv: kv[0])))
        if self.memory_check is None or signature in self._checked:
            return
        self.memory_check("rollout decode", decode.lower(self._weights, cache, state, key, **static).compile())
        self._checked.add(signature)

    def _check_memory(self, ids: jax.Array, mask: jax.Array, key: jax.Array, static: dict[str, Any]) -> None:
        """Compiles prefill and decode for this batch and hands them to `memory_check` before either runs."""
        signature = (ids.shape, tuple(sorted(static.items(), key=lambda kv: kv[0])))
        if self.memory_check is None or signature in self._checked:
            return
        weights = self._weights
        prefill_compiled = self.prefill_phase(static["params"]).lower(weights, ids, mask, key, **static).compile()
        self.memory_check("rollout prefill", prefill_compiled)
        cache, state = abstract_outputs(prefill_compiled)
        decoder = self.decoder(weights, cache, state, key, static, self.decode_segments(static["params"]))
        if isinstance(decoder, functools.partial):  # the jitted decode, not a compiled gathered one
            decoder = decode.lower(weights, cache, state, key, **static).compile()
        self.memory_check("rollout decode", decoder)
        self._checked.add(signature)

    def decoder(self, weights, cache, state, key, static: dict[str, Any], segments: int = 1) -> Callable[..., Any]:
        """`decode` for these arguments; with gather_weights=auto, the gathered decode when it
        fits in device memory (decided once per batch shape, see grpo_rollout.gather)."""
        if self.options.gather_weights == "auto":
            gathered = self._auto_decoders.get(weights, cache, state, key, static, segments)
            if gathered is not None:
                return gathered
        return functools.partial(decode, **static)

    def static_args(self, graphdef, weights, sampling: SamplingParams, pad_token_id: int,
                    batch_sharding: NamedSharding | None) -> dict[str, Any]:
        """The static (compile-time) arguments shared by `prefill` and `decode`; the model
        structure carries the rollout's activation sharding (set here, outside jit)."""
        return dict(graphdef=rollout_graphdef(graphdef, weights, batch_sharding), params=sampling, pad_id=int(pad_token_id),
                    cache_dtype=self.cache_dtype, batch_sharding=batch_sharding,
                    block=self.options.cdf_block or None, top_p_candidates=self.options.top_p_candidates,
                    attention=self.options.decode_attention, gather_weights=self.options.gather_weights is True,
                    model_parallel=SPLIT_LAYOUTS.get(self.options.gather_weights, False))

    @property
    def cache_dtype(self) -> str | None:
        """The decode's cache dtype (`QwenModel.init_cache`): int8 | fp8, or the options' (None: the model's)."""
        return self.options.cache_dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def trim(self, result: RolloutResult) -> TrainBatch:
        return trim_batch(result, self.options.trim_bucket)

    # ---- grpo-run --plan (grpo_core.contracts.PlannableRollout) ----------------------------
    def widths(self, max_prompt_length: int, max_new_tokens: int) -> RolloutWidths:
        """Prompts padded to their bucket; training batches trimmed as `trim` trims them."""
        prompt = bucket_length(max_prompt_length, self.options.prompt_buckets)
        train = trimmed_widths(max_prompt_length, max_new_tokens, prompt, max_new_tokens, self.options.trim_bucket)
        return RolloutWidths(prompt, *train)

    def compile_phases(self, shapes: RolloutShapes, compiler: PhaseCompiler) -> None:
        """Prefill, then the decode loop as `generate` runs it (gathered or not: see `decoder`);
        with `shapes.kept_prefix`, the widest round of `generate_round` instead."""
        compile_quantize(compiler, shapes.policy.graphdef, shapes.policy.weights, self.quantize)
        weights, key = self.abstract_weights(shapes.policy), shapes.key
        static = self.static_args(shapes.policy.graphdef, weights, shapes.sampling, shapes.pad_token_id,
                                  shapes.batch_sharding)
        if shapes.kept_prefix:
            compile_kept_round(self, shapes, compiler, static)
            return
        width = self.widths(shapes.max_prompt_length, shapes.sampling.max_new_tokens).prompt
        phase = self.prefill_phase(shapes.sampling)
        rows = shapes.prompts * (1 if phase is prefill_shared else shapes.sampling.n)
        sharding = group_sharding(shapes.batch_sharding, rows) if phase is prefill_shared else shapes.batch_sharding
        prompts = jax.ShapeDtypeStruct((rows, width), jnp.int32, sharding=sharding)
        args = (weights, prompts, prompts, key)
        first = compiler.compile("rollout prefill", lambda: phase.lower(*args, **static).compile(), args)
        if first is not None:  # decode's inputs are prefill's outputs
            cache, state = abstract_outputs(first)
            compile_decode(compiler, (weights, cache, state, key), static, self.options.gather_weights,
                           self.decode_segments(shapes.sampling))

    def abstract_weights(self, policy: Policy) -> Any:  # the shapes `load_weights(policy)` would decode from
        return abstract_quantized(policy.graphdef, policy.weights, self.quantize)

    def kept_cache(self, shapes: RolloutShapes) -> Any:
        """The abstract KV cache of `generate_round`'s widest round (grpo_rollout.kept_plan)."""
        return kept_round_cache(self, shapes)

    def compile_decode(self, compiler: PhaseCompiler, args: tuple, static: dict[str, Any]) -> None:
        """A partial round's decode for `--plan` (grpo_rollout.decode_plan): one loop, not segmented."""
        compile_decode(compiler, args, static, self.options.gather_weights, 1)
