"""Segmented decoding: the decode as K consecutive jitted loops, each reading only the filled
part of the completion cache.

One jitted loop over all Tn - 1 decode steps has static shapes, so every step's attention reads
the whole allocated completion cache (empty slots masked out). Segment k runs the steps
[s_k, s_{k+1}) and attends over a static view of the cache just long enough for its last step
(`grpo_rollout.decode.view_slots`); the cache and loop state are donated from one segment to the
next and updated in place. Empty slots contribute exp(-inf) = 0 to the softmax, so leaving them
out changes only the length of its sums: the same tokens, log-probs within rounding.

With K segments of equal length the completion cache is read (K + 1) / 2K as much on average
(9/16 for K = 8); each segment is one more compile, so `auto` takes one segment per
STEPS_PER_SEGMENT new tokens, at most MAX_AUTO_SEGMENTS (1 for short completions, no extra compile).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax.numpy as jnp

STEPS_PER_SEGMENT = 128
MAX_AUTO_SEGMENTS = 8
VIEW_ALIGNMENT = 8  # a view's slots round up to this (the TPU's sublane tile of the sequence axis)


def segment_count(option: int | str, max_new_tokens: int) -> int:
    """The segments a decode of `max_new_tokens` runs as: option K, or `auto`."""
    if option == "auto":
        return max(1, min(MAX_AUTO_SEGMENTS, max_new_tokens // STEPS_PER_SEGMENT))
    return int(option)


def segment_ends(max_new_tokens: int, segments: int) -> tuple[int, ...]:
    """The step each segment stops before: the decode runs steps 1 .. Tn - 1 (step s writes
    completion slot s - 1), split into `segments` near-equal ranges whose views are multiples of
    VIEW_ALIGNMENT when the ranges are that long; the last ends at Tn (its view the whole cache).
    Empty ranges are dropped."""
    slots = max_new_tokens - 1
    align = VIEW_ALIGNMENT if slots >= VIEW_ALIGNMENT * segments else 1
    views = {-(-math.ceil(k * slots / segments) // align) * align for k in range(1, segments)}
    return tuple(sorted(view + 1 for view in views if 0 < view < slots)) + (max_new_tokens,)


def segment_ranges(max_new_tokens: int, segments: int) -> list[tuple[int, int]]:
    """[(first step, end step)] of each segment."""
    ends = segment_ends(max_new_tokens, segments)
    return list(zip((1,) + ends[:-1], ends))


def run_segments(decoder_for: Callable[[int | None], Callable[..., Any]], weights, cache, state, key,
                 max_new_tokens: int, segments: int):
    """(cache, final LoopState) of the decode run as `segments` loops; decoder_for(until) is the
    decode of the segment stopping before step `until` (None: the last, over the whole cache).
    Stops calling segments once every row has ended."""
    ends = segment_ends(max_new_tokens, segments)
    for until in ends:
        last = until == ends[-1]
        cache, state = decoder_for(None if last else until)(weights, cache, state, key)
        if not last and bool(jnp.all(state.done)):
            break
    return cache, state


def segmented_seconds(seconds: Callable[[Any, int], float], program: Any, steps: int, segments: int) -> float:
    """`seconds(program, steps)` (one setup and the steps, e.g. gather.Projector) with the setup paid
    by each of `segments` calls: how `gather_weights: auto` ranks a segmented decode's layouts."""
    one_call = seconds(program, steps)
    return one_call if segments == 1 else one_call + (segments - 1) * seconds(program, 0)


def decode_phase_name(first: int, end: int) -> str:
    """`grpo-run --plan`'s name of a segment before the last (the last is `rollout decode`)."""
    return f"rollout decode steps {first}-{end - 1}"


def decode_phase_steps(name: str) -> tuple[int, int] | None:
    """(first step, end step) of a phase named by `decode_phase_name`; None for any other name."""
    prefix = "rollout decode steps "
    if not name.startswith(prefix):
        return None
    first, last = name[len(prefix):].split("-")
    return int(first), int(last) + 1
