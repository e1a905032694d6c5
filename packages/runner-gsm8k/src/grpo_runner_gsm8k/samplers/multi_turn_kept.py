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
turn), so its tokens do not depend on which rows it shares a round with. With several
processes, process 0 alone runs the calls and decides which have returned
(grpo_runner_gsm8k.samplers.shared_tools), so every process starts the same rounds.
"""

from __future__ import annotations

import concurrent.futures as futures
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from grpo_core.rollout_records import DecodeTally

from grpo_runner_gsm8k.multihost import host_array
from grpo_runner_gsm8k.samplers.shared_tools import returned, submit
from grpo_runner_gsm8k.samplers.trajectory import Trajectory


def row_keys(key: jax.Array, turns: list[int], batch_sharding: Any = None) -> jax.Array:
    """[slots] keys: slot i's is `key` folded with i, then with its row's turn."""
    keys = jax.vmap(lambda slot, turn: jax.random.fold_in(jax.random.fold_in(key, slot), turn))(
        jnp.arange(len(turns)), jnp.asarray(turns))
    if batch_sharding is None:
        return keys
    # Replicated over the whole mesh, from the host's copy: with several processes a device_put
    # of this process's array cannot reach the others' devices; every process holds the same keys.
    data = jax.random.key_data(keys)
    host = np.asarray(data if data.is_fully_addressable else data.addressable_data(0))
    replicated = jax.device_put(host, NamedSharding(batch_sharding.mesh, PartitionSpec()))
    return jax.random.wrap_key_data(replicated, impl=jax.random.key_impl(keys))


class KeptCacheTurns:
    """The turn loop of one batch of rows on kept caches; `turns` is the MultiTurnRollout whose
    backend (weights loaded), runner and turn rules apply. slots: rows plus filler slots that
    make the batch divide over the mesh's data axes."""

    def __init__(self, turns: Any, rows: list[Trajectory], slots: int):
        self.turns, self.rows = turns, rows
        self.kept = [0] * slots  # tokens of each slot's row in its kept cache
        self.cached = [False] * slots
        self.pending: dict[int, futures.Future | None] = {}  # slot -> its row's tool calls (None: not process 0)
        self.rounds = 0
        self.work = DecodeTally()  # summed over the rounds

    def run(self, key: jax.Array) -> DecodeTally:
        """Rounds until every row is done; returns their decode work."""
        while True:
            self.append_returned(wait=not self.ready_rows())
            ready = self.ready_rows()
            if ready:
                self.decode_round(ready, key)
            elif not self.pending:
                return self.work

    def append_returned(self, wait: bool) -> None:
        """Appends the tool turns whose calls have returned (the same on every process: see
        grpo_runner_gsm8k.samplers.shared_tools); wait: until one has, when none is ready."""
        for slot, outcomes in sorted(returned(self.pending, wait).items()):
            del self.pending[slot]
            self.turns.append_tool_turn(self.rows[slot], outcomes)

    def ready_rows(self) -> list[int]:
        """The slots whose rows can decode now: not done, not waiting on a tool."""
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
        ids, logps = host_array(result.completion_ids), host_array(result.sampler_logps)
        lengths, finished = host_array(result.lengths), host_array(result.finished)
        self.work.add(len(ready), int(lengths.max(initial=0)), int(lengths[ready].sum()))
        self.rounds += 1
        self.cached = cached
        for slot in ready:
            row, length = self.rows[slot], int(lengths[slot])
            self.kept[slot], self.cached[slot] = len(prefixes[slot]) + length - 1, True
            calls = turns.end_turn(row, ids[slot, :length].tolist(), logps[slot, :length], bool(finished[slot]),
                                   row.turns + 1 >= turns.max_turns)
            if calls:
                self.pending[slot] = submit(turns.runner, calls)
        turns.answer_environments()
