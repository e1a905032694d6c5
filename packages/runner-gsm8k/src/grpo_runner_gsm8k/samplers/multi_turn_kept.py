"""Multi-turn rows on KV caches kept across turns (rollout.multi_turn.kv_cache: kept).

Every row owns one slot of the backend's kept cache (`KeptCacheRollout.generate_round`) for
the whole rollout. A round decodes one assistant turn of every row that is ready; a row that
ends on `</tool_call>` has its calls submitted to the ToolRunner and sits out (`live` False:
its cache stays as it is) until they return. Its tool turn's tokens are then appended onto
its kept cache (`kept_tokens`: the cache holds all of the row's tokens but the last sampled
one, so that one and the tool turn but its last token are run into the cache) and it decodes
its next turn from there: the conversation is never prefilled again.

A round starts as soon as one row is ready, with every row that is ready then: rows that wait
on a tool hold up no other row. Which rows share a round therefore depends on how long the
tools take; each row's sampling key is its own (the step's key folded with the row and its
turn), so its tokens do not depend on which rows it shares a round with.
"""

from __future__ import annotations

import concurrent.futures as futures
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from grpo_core.rollout_records import DecodeTally

from grpo_runner_gsm8k.samplers.trajectory import Trajectory


def row_keys(key: jax.Array, turns: list[int], batch_sharding: Any = None) -> jax.Array:
    """[slots] keys: slot i's is `key` folded with i, then with its row's turn."""
    keys = jax.vmap(lambda slot, turn: jax.random.fold_in(jax.random.fold_in(key, slot), turn))(
        jnp.arange(len(turns)), jnp.asarray(turns))
    if batch_sharding is None:
        return keys
    return jax.device_put(keys, NamedSharding(batch_sharding.mesh, PartitionSpec()))


class KeptCacheTurns:
    """The turn loop of one batch of rows on kept caches; `turns` is the MultiTurnRollout whose
    backend (weights loaded), runner and turn rules apply. slots: rows plus filler slots that
    make the batch divide over the mesh's data axes."""

    def __init__(self, turns: Any, rows: list[Trajectory], slots: int):
        self.turns, self.rows = turns, rows
        self.kept = [0] * slots  # tokens of each slot's row in its kept cache
        self.cached = [False] * slots
        self.pending: dict[int, futures.Future] = {}  # slot -> its row's tool calls
        self.rounds = 0
        self.work = DecodeTally()  # summed over the rounds

    def run(self, key: jax.Array) -> DecodeTally:
        """Rounds until every row is done; returns their decode work."""
        while True:
            ready = self.ready_rows()
            if ready:
                self.decode_round(ready, key)
            elif self.pending:
                futures.wait(list(self.pending.values()), return_when=futures.FIRST_COMPLETED)
            else:
                return self.work

    def ready_rows(self) -> list[int]:
        """Appends the tool turns that have returned; the slots whose rows can decode now."""
        for slot, future in list(self.pending.items()):
            if future.done():
                del self.pending[slot]
                self.turns.append_tool_turn(self.rows[slot], future.result())
        return [slot for slot, row in enumerate(self.rows) if not row.done and slot not in self.pending]

    def prefix(self, slot: int) -> list[int]:
        """The slot's row's tokens; one pad for a slot without a row to keep (done or filler)."""
        if slot < len(self.rows) and not self.rows[slot].done:
            return self.rows[slot].prompt + self.rows[slot].ids
        return [self.turns.pad_token_id]

    def decode_round(self, ready: list[int], key: jax.Array) -> None:
        """One assistant turn of each ready row on its kept cache; calls go to the runner."""
        turns, slots = self.turns, len(self.kept)
        prefixes = [self.prefix(slot) for slot in range(slots)]
        live = np.zeros(slots, bool)
        live[ready] = True
        cached = [self.cached[slot] and len(prefixes[slot]) > 1 for slot in range(slots)]
        row_turns = [self.rows[slot].turns if slot < len(self.rows) else 0 for slot in range(slots)]
        result = turns.backend.generate_round(
            prefixes, cached, row_keys(key, row_turns, turns.batch_sharding), turns.sampling,
            pad_token_id=turns.pad_token_id, batch_sharding=turns.batch_sharding, kept_tokens=self.kept,
            live=live.tolist())
        ids, logps = np.asarray(result.completion_ids), np.asarray(result.sampler_logps)
        lengths, finished = np.asarray(result.lengths), np.asarray(result.finished)
        self.work.add(len(ready), int(lengths.max(initial=0)), int(lengths[ready].sum()))
        self.rounds += 1
        self.cached = cached
        for slot in ready:
            row, length = self.rows[slot], int(lengths[slot])
            self.kept[slot], self.cached[slot] = len(prefixes[slot]) + length - 1, True
            calls = turns.end_turn(row, ids[slot, :length].tolist(), logps[slot, :length], bool(finished[slot]),
                                   row.turns + 1 >= turns.max_turns)
            if calls:
                self.pending[slot] = turns.runner.submit(calls)
