"""Prompt batches: left padding to a bounded set of length buckets, K copies per prompt.

Every distinct prompt width is a new compiled shape, so widths are rounded up to a
bucket. Padding is on the left so the last column of every row is its last real token
and decoding writes all rows into the same cache slot.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

# Powers of two: at most log2(max) compiled prefill shapes.
DEFAULT_PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def bucket_length(length: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= length."""
    for bucket in sorted(buckets):
        if bucket >= length:
            return bucket
    raise ValueError(
        f"prompt of {length} tokens is longer than the largest prompt bucket {max(buckets)}; "
        f"add a larger bucket to the rollout options (prompt_buckets) or shorten the prompt."
    )


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS,
             max_prompt_length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token lists -> (ids [P, W] int32, mask [P, W] int32), W the bucket of the longest."""
    lengths = [len(p) for p in prompts]
    if not prompts or min(lengths) == 0:
        raise ValueError(f"every prompt needs at least one token; got lengths {lengths[:8]}...")
    if max_prompt_length is not None and max(lengths) > max_prompt_length:
        raise ValueError(
            f"prompt {int(np.argmax(lengths))} has {max(lengths)} tokens > max_prompt_length={max_prompt_length}; "
            "raise rollout.max_prompt_length or filter long prompts.")
    width = bucket_length(max(lengths), buckets)
    ids = np.full((len(prompts), width), pad_id, np.int32)
    mask = np.zeros((len(prompts), width), np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = prompt
        mask[row, width - len(prompt):] = 1
    return ids, mask


def check_left_padded(mask: np.ndarray) -> None:
    """Raise unless every row is zeros then ones, with at least one real token."""
    if mask.ndim != 2:
        raise ValueError(f"prompt_mask must be [P, T], got shape {mask.shape}.")
    lengths = mask.sum(axis=1)
    expected = np.arange(mask.shape[1])[None, :] >= (mask.shape[1] - lengths)[:, None]
    bad = np.nonzero((mask.astype(bool) != expected).any(axis=1) | (lengths == 0))[0]
    if bad.size:
        raise ValueError(
            f"prompt rows {bad[:8].tolist()} are not left-padded with at least one real token "
            f"(mask row {mask[bad[0]].tolist()}); pad prompts on the left (grpo_rollout.left_pad).")


def fit_to_bucket(ids: np.ndarray, mask: np.ndarray, pad_id: int,
                  buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS) -> tuple[np.ndarray, np.ndarray]:
    """Re-pad a left-padded batch [P, T] to the bucket of its longest real prompt."""
    ids, mask = np.asarray(ids, np.int32), np.asarray(mask, np.int32)
    if ids.shape != mask.shape:
        raise ValueError(f"prompt_ids {ids.shape} and prompt_mask {mask.shape} must have the same shape.")
    check_left_padded(mask)
    width = bucket_length(int(mask.sum(axis=1).max()), buckets)
    keep = min(width, ids.shape[1])
    out_ids = np.full((ids.shape[0], width), pad_id, np.int32)
    out_mask = np.zeros((ids.shape[0], width), np.int32)
    out_ids[:, width - keep:] = np.where(mask[:, -keep:] > 0, ids[:, -keep:], pad_id)
    out_mask[:, width - keep:] = mask[:, -keep:]
    return out_ids, out_mask


def repeat_samples(array: np.ndarray, n: int) -> np.ndarray:
    """[P, ...] -> [P * n, ...]; rows p*n .. p*n+n-1 are copies of row p (one GRPO group)."""
    return np.repeat(array, n, axis=0)
