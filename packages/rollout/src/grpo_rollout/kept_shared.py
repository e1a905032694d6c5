"""Kept-cache rounds with each live group's prompt stored once (grpo_rollout.cascade.TableCache).

The slots of partial rollouts hold rows of different groups at different depths. Each group
whose rows are in the slots has one slot g of a prompt table [L, G, Tp, KV, D]: its prompt but
the last token, prefilled once (one forward of the prompt, not n) when the group first enters.
Each slot's own cache holds the rest of its row: the prompt's last token and the completion
tokens so far but the last (the layout of grpo_rollout.kept_cache, compacted the same way). A
group's table slot is freed when none of its rows is in the slots any more; the pool
(grpo_rollout.partial, `prompt_table`) keeps at most G groups in the slots, a row of a further
group waiting for a free table slot.

A round:
    table:    groups gone from the slots are freed, new ones get a free slot and their prompts
              run once into it (with no slot cached, e.g. a step's first round under new
              weights, or after a resume, the table starts empty: every prompt is run again)
    compact:  as grpo_rollout.kept_cache, on the slots' own caches
    admit:    a row admitted with tokens (resumed, or re-run under new weights) runs them into its
              own cache in one forward whose attention reads its prompt from the table
              (cascade.table_prefill_forward): the prompt is not run again
    decode:   the usual loop on the TableCache, each step reading each live prompt once
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Hashable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_rollout.cascade import TableCache, table_prefill_forward
from grpo_rollout.decode import PHASE_STATIC_ARGS, constrain_cache, place, rollout_weights
from grpo_rollout.kept_cache import admission_batch, compact, kept_width
from grpo_rollout.prompts import bucket_length


@dataclass(frozen=True)
class SlotGroups:
    """Which group each slot's row belongs to: ids[i] (None: slot i is empty this round),
    prompt_lengths[i] its prompt's tokens (a prefix of the slot's); `members` rows per group (n),
    `table` group slots in the prompt table (G)."""

    ids: Sequence[Optional[Hashable]]
    prompt_lengths: Sequence[int]
    members: int
    table: int


def table_size(slots: int, members: int) -> int:
    """G: twice the groups the slots hold when each group's rows sit side by side. The rows of a
    group finish at different rounds, so the slots hold parts of more groups than slots // n."""
    return 2 * -(-slots // members)


class PromptTable:
    """Host-side: which table slot each live group holds."""

    def __init__(self, size: int):
        self.size, self.slot_of = size, {}

    def assign(self, ids: Sequence[Optional[Hashable]]) -> list:
        """Frees the groups not in ids, gives new ones a free slot; returns [(group id, table slot)]
        of the new ones."""
        live = {g for g in ids if g is not None}
        if len(live) > self.size:
            raise ValueError(f"a round's slots hold rows of {len(live)} groups, more than the prompt table's "
                             f"{self.size}; the pool must keep at most that many groups in its slots")
        self.slot_of = {g: s for g, s in self.slot_of.items() if g in live}
        free = sorted(set(range(self.size)) - set(self.slot_of.values()))
        new = [g for g in dict.fromkeys(ids) if g is not None and g not in self.slot_of]
        self.slot_of.update(zip(new, free))
        return [(g, self.slot_of[g]) for g in new]

    def rows(self, ids: Sequence[Optional[Hashable]]) -> tuple[np.ndarray, np.ndarray]:
        """(table slot [N] (size for an empty slot), member [N]: the row's rank among its group's)."""
        seen: dict = {}
        group, member = np.full(len(ids), self.size, np.int32), np.zeros(len(ids), np.int32)
        for row, g in enumerate(ids):
            if g is not None:
                group[row], member[row] = self.slot_of[g], seen.get(g, 0)
                seen[g] = member[row] + 1
        return group, member


@functools.partial(jax.jit, static_argnames=("width",))
def widen_table(table, width: int):
    """The table left-padded to `width` slots (positions count visible slots: unchanged)."""
    pad = width - table.max_len
    k, v = (jax.tree.map(lambda a: jnp.pad(a, ((0, 0), (0, 0), (pad, 0), (0, 0), (0, 0))), part)
            for part in (table.k, table.v))  # tree.map: an 8-bit cache's values and scales alike
    return table.replace(k=k, v=v, mask=jnp.pad(table.mask, ((0, 0), (pad, 0))), index=jnp.asarray(width, jnp.int32))


@functools.partial(jax.jit, static_argnames=PHASE_STATIC_ARGS, donate_argnames=("table",))
def fill_table(weights, table, ids, mask, targets, *, graphdef, params, pad_id, cache_dtype=None, batch_sharding=None,
               block=None, top_p_candidates=None, attention="rollout", gather_weights=False, model_parallel=False):
    """The prompts ids/mask [A, Tp] run once each into table slots targets [A] (G: dropped)."""
    del params, pad_id, block, top_p_candidates, attention, model_parallel  # shared static signature
    model = nnx.merge(graphdef, rollout_weights(weights, batch_sharding, gather_weights))
    _, new = model(ids, attention_mask=mask, cache=model.init_cache(ids.shape[0], ids.shape[1], cache_dtype))
    k, v = (jax.tree.map(lambda a, b: a.at[:, targets].set(b.astype(a.dtype), mode="drop"), old, part)
            for old, part in ((table.k, new.k), (table.v, new.v)))
    return table.replace(k=k, v=v, mask=table.mask.at[targets].set(new.mask, mode="drop"))


@functools.partial(jax.jit, static_argnames=PHASE_STATIC_ARGS, donate_argnames=("cache",))
def admit_table(weights, cache, ids, mask, *, graphdef, params, pad_id, cache_dtype=None, batch_sharding=None,
                block=None, top_p_candidates=None, attention="rollout", gather_weights=False, model_parallel=False):
    """Rows' own tokens ids/mask [N, A] (masked where a row admits none) into their own caches at
    [index, index + A), attending over their prompts in the table (cascade.table_prefill_forward)."""
    del params, pad_id, cache_dtype, block, top_p_candidates, attention, model_parallel
    model = nnx.merge(graphdef, rollout_weights(weights, batch_sharding, gather_weights))
    cache = table_prefill_forward(model, ids, mask, cache)
    return cache.replace(completion=constrain_cache(cache.completion, batch_sharding))


def own_counts(prefixes: Sequence[Sequence[int]], groups: SlotGroups) -> list[int]:
    """Tokens of each slot's own part: its prompt's last token and its completion but the last."""
    return [len(p) - length if g is not None else 0
            for p, g, length in zip(prefixes, groups.ids, groups.prompt_lengths)]


def table_prompts(new: list, prompts: dict, pad_id: int, width: int, size: int):
    """(ids, mask [A, width], targets [A]) of the new groups' prompts but the last token; A rounded
    up to a power of two (extra rows target slot `size`: dropped), so few shapes compile."""
    rows = 1 << max(len(new) - 1, 0).bit_length()
    ids, mask = np.full((rows, width), pad_id, np.int32), np.zeros((rows, width), np.int32)
    targets = np.full(rows, size, np.int32)
    for row, (g, slot) in enumerate(new):
        head = prompts[g][:-1]
        if head:
            ids[row, width - len(head):], mask[row, width - len(head):] = head, 1
        targets[row] = slot
    return ids, mask, targets


def group_prompts(prefixes, groups: SlotGroups) -> dict[Any, list]:
    """Each group's prompt, read from the prefix of one of its slots."""
    return {g: list(p[:length]) for p, g, length in zip(prefixes, groups.ids, groups.prompt_lengths)
            if g is not None}


class SharedRounds:
    """The prompt table kept between `generate_round`s (the slots' own caches are the backend's)."""

    def __init__(self):
        self.slots: Optional[PromptTable] = None
        self.table: Any = None  # KVCache [L, G, Tp, KV, D]

    def round_cache(self, model, weights, own, options, slots, budget: int, static):
        """The TableCache of a round: the table updated, the own caches compacted, admitted rows' own
        parts written, room for `budget` tokens. slots: (prefixes, cached, SlotGroups) of the round."""
        prefixes, cached, groups = slots
        pad_id, buckets, batch_sharding = static["pad_id"], options.prompt_buckets, static["batch_sharding"]
        self.update_table(model, weights, slots, buckets, static["cache_dtype"], static)
        counts = own_counts(prefixes, groups)
        base = kept_width([c if kept else 0 for c, kept in zip(counts, cached)], buckets)
        # An admitted row's own tokens (its prompt's last and its completion but the last) go in on the table.
        heads = [len(p) - 1 - c if not kept else len(p) - 1 for p, c, kept in zip(prefixes, counts, cached)]
        ids, mask = admission_batch(prefixes, heads, pad_id, buckets)
        own = own if own is not None else model.init_cache(len(prefixes), 0, static["cache_dtype"])
        own = compact(own, place(np.asarray(cached, bool), batch_sharding), base=base,
                      width=base + ids.shape[1] + budget, batch_sharding=batch_sharding)
        group, member = self.slots.rows(groups.ids)
        cache = TableCache(prompt=self.table, completion=own, group=place(group, batch_sharding),
                           member=place(member, batch_sharding), members=groups.members)
        if ids.shape[1]:
            cache = admit_table(weights, cache, place(ids, batch_sharding), place(mask, batch_sharding), **static)
        return cache

    def update_table(self, model, weights, slots, buckets, cache_dtype, static) -> None:
        """Frees the groups gone, runs the new ones' prompts once each into the table (all of them
        when no slot is cached: the table then starts empty)."""
        prefixes, cached, groups = slots
        if self.slots is None or self.slots.size != groups.table or not any(cached):
            self.slots, self.table = PromptTable(groups.table), None
        new = self.slots.assign(groups.ids)
        prompts = group_prompts(prefixes, groups)
        width = bucket_length(max(max((len(p) for p in prompts.values()), default=2) - 1, 1), buckets)
        if self.table is None:
            self.table = model.init_cache(groups.table, width, cache_dtype)
        elif self.table.max_len < width:
            self.table = widen_table(self.table, width)
        if new:
            ids, mask, targets = table_prompts(new, prompts, static["pad_id"], self.table.max_len, groups.table)
            self.table = fill_table(weights, self.table, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(targets),
                                    **{**static, "batch_sharding": None})

    def release(self) -> None:
        self.slots = self.table = None
