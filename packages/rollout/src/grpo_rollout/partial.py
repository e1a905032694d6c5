"""Partial rollouts: a fixed number of decode slots that never wait for the longest row.

Each round decodes every slot for at most `budget` steps (or, with `budget_quantile` q, the
q-quantile of the lengths of the last `slots` trained rows rounded up to a power of two, at most
`budget`: a handful of compiled decode lengths). A row that stops (or reaches
max_new_tokens) frees its slot, which the next round gives to a pending row of a new
prompt; a row still running keeps its slot and continues next round from its prompt plus
the tokens it has so far. By default those are re-prefilled under the weights of that
round (the pool is plain token lists: it keeps any batch sharding, the newest weights apply
at once, and it checkpoints as JSON). With `kv_cache` the slot's KV cache is kept from the
previous round instead (grpo_rollout.kept_cache): `within_step` between the rounds of one
step (the same weights), `across_steps` also across updates. The pool tells `generate`
which slots continue (`cached`); a new, restarted or resumed row is admitted from its tokens.
In a multi-host run every process holds the same pool: the draws are gathered and the
round results read whole on every process.
A group (the K rows of one prompt) is complete when all its rows are done; only complete
groups leave the pool, oldest first. With `prompt_table` G (the backend runs each group's
prompt once, grpo_rollout.kept_shared) at most G groups have rows in the slots: a row of a
further group waits, its slot empty for the round (`RoundStats.waited`).
With more slots than a step's rows, more groups complete per round than a step takes: a free
slot draws no new prompt while a step's groups are complete already, and a step that finds
them complete with no row running decodes nothing (every running row still decodes once per
step, so `max_staleness` keeps its meaning).

Every token keeps the sampler's log-prob and the policy version that drew it, so the loss
can correct the carried tokens (truncated or masked importance sampling). A running row
whose first token is more than `max_staleness` versions old is restarted from its prompt.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np

from grpo_core.rollout_records import DecodeTally, RolloutResult
from grpo_rollout.kept_shared import SlotGroups
from grpo_rollout.prompts import left_pad

PENDING, RUNNING, DONE = "pending", "running", "done"
KV_CACHE_MODES = ("reprefill", "within_step", "across_steps")

# generate(prefixes, key, budget, cached[, groups]) -> RolloutResult of one row per prefix, at most `budget`
# new tokens; cached[i]: slot i continues its row of the previous round from a kept KV cache; groups (passed
# when the pool has a prompt table): a kept_shared.SlotGroups, each slot's group (None: the slot is empty).
Generate = Callable[[Sequence[Sequence[int]], Any, int, Sequence[bool]], RolloutResult]
# draw() -> the next prompts: (a JSON-able record of its example, its token ids) each; one per
# process in a multi-host run, so every process's pool adds the same groups.
Draw = Callable[[], list[tuple[dict, list[int]]]]


@dataclass
class CarriedRow:
    """One completion in the pool: its tokens so far with their log-probs and versions."""

    tokens: list = field(default_factory=list)
    logps: list = field(default_factory=list)
    versions: list = field(default_factory=list)
    state: str = PENDING
    finished: bool = False  # ended on a stop token (False when cut at max_new_tokens)
    restarts: int = 0


@dataclass
class CarriedGroup:
    """The K rows of one prompt; `example` is the task's record of it."""

    example: dict
    prompt: list
    rows: list

    @property
    def complete(self) -> bool:
        return all(row.state == DONE for row in self.rows)


@dataclass(frozen=True)
class RoundStats:
    """What one `PartialPool.step` did: rows restarted, rounds run and their decode work."""

    restarted: int = 0
    rounds: int = 0
    decode: DecodeTally = field(default_factory=DecodeTally)
    waited: int = 0  # slot-rounds left empty: a new group's row waited for a prompt-table slot


class PartialPool:
    """The carried rows of a run: `slots` decode slots, groups of `n` rows."""

    def __init__(self, slots: int, n: int, budget: int, max_new_tokens: int, max_staleness: Optional[int] = None,
                 budget_quantile: Optional[float] = None, kv_cache: str = "reprefill",
                 prompt_table: Optional[int] = None):
        if kv_cache not in KV_CACHE_MODES:
            raise ValueError(f"kv_cache={kv_cache!r} must be one of {', '.join(KV_CACHE_MODES)}")
        self.n, self.budget, self.max_new_tokens, self.max_staleness = n, budget, max_new_tokens, max_staleness
        self.budget_quantile, self.kv_cache = budget_quantile, kv_cache
        # At most this many groups in the slots (their prompts run once each: grpo_rollout.kept_shared).
        self.prompt_table = prompt_table
        self.waited = 0  # slots left empty for a round: a new group's row waited for a table slot
        self.cached = [False] * slots  # slot continues its row from the cache of the last round
        self.recent_lengths: collections.deque[int] = collections.deque(maxlen=slots)
        self.groups: dict[int, CarriedGroup] = {}
        self.slots: list[Optional[tuple[int, int]]] = [None] * slots
        self.pending: list[tuple[int, int]] = []
        self.next_group = 0

    # ---- one training step ------------------------------------------------------------
    def step(self, generate: Generate, draw: Draw, key: Any, version: int,
             max_groups: int) -> tuple[list[CarriedGroup], RoundStats]:
        """Rounds of at most `budget` decode steps until `max_groups` groups are complete (none when
        they are and no row is running); returns those groups (oldest first), which leave the pool.
        Every step trains as many groups as a synchronous step would; rows still running when they
        are complete are carried."""
        restarted, decode, waited = 0, DecodeTally(), self.waited
        if self.kv_cache == "within_step":  # new weights: every carried row is prefilled under them
            self.cached = [False] * len(self.slots)
        rounds = 0
        # A running row decodes in every step, so it ages one version per round at most.
        while rounds == 0 and self.running or self.complete_groups < max_groups:
            self.fill(draw, max_groups)
            restarted += self.restart_stale(version)
            decode += self.decode_round(generate, jax.random.fold_in(key, rounds), version)
            rounds += 1
        return self.take_complete(max_groups), RoundStats(restarted, rounds, decode, self.waited - waited)

    @property
    def complete_groups(self) -> int:
        return sum(group.complete for group in self.groups.values())

    @property
    def running(self) -> bool:
        return any(owner is not None and self.row(owner).state == RUNNING for owner in self.slots)

    def fill(self, draw: Draw, max_groups: int) -> None:
        """Every free slot gets a pending row; a new prompt is drawn when none is pending, unless
        `max_groups` groups are complete already (more slots than a step's rows would pile them up)."""
        enough = self.complete_groups >= max_groups
        for slot, owner in enumerate(self.slots):
            if owner is not None and self.row(owner).state != DONE:
                continue
            self.slots[slot], self.cached[slot] = None, False
            if not self.pending and enough:
                continue
            if not self.pending:
                for example, prompt in draw():
                    self.add_group(example, prompt)
            if not self.table_admits(self.pending[0][0]):
                self.waited += 1
                continue
            owner = self.pending.pop(0)
            self.row(owner).state = RUNNING
            self.slots[slot], self.cached[slot] = owner, False

    def table_admits(self, gid: int) -> bool:
        """A row of group gid may take a slot: its group is in the slots, or fewer than
        `prompt_table` groups are."""
        if self.prompt_table is None:
            return True
        live = {o[0] for o in self.slots if o is not None and self.row(o).state != DONE}
        return gid in live or len(live) < self.prompt_table

    def add_group(self, example: dict, prompt: list[int]) -> None:
        gid, self.next_group = self.next_group, self.next_group + 1
        self.groups[gid] = CarriedGroup(example, list(prompt), [CarriedRow() for _ in range(self.n)])
        self.pending.extend((gid, k) for k in range(self.n))

    def restart_stale(self, version: int) -> int:
        """Running rows whose first token is older than max_staleness versions start over."""
        if self.max_staleness is None:
            return 0
        stale = [slot for slot, o in enumerate(self.slots) if o and self.row(o).versions
                 and version - self.row(o).versions[0] > self.max_staleness]
        for slot in stale:
            row = self.row(self.slots[slot])
            row.tokens, row.logps, row.versions, row.restarts = [], [], [], row.restarts + 1
            self.cached[slot] = False
        return len(stale)

    def round_budget(self) -> int:
        """`budget`, or the budget_quantile of the recent trained rows' lengths rounded up to a
        power of two (at most `budget`; `budget` until a group has been trained)."""
        if self.budget_quantile is None or not self.recent_lengths:
            return self.budget
        length = float(np.quantile(np.asarray(self.recent_lengths), self.budget_quantile))
        return min(self.budget, 1 << max(0, math.ceil(math.log2(max(length, 1.0)))))

    def decode_round(self, generate: Generate, key: Any, version: int) -> DecodeTally:
        """Every slot decodes up to `round_budget()` tokens from its prompt + tokens so far;
        returns the round's decode work."""
        owners = list(self.slots)
        prefixes = [self.groups[o[0]].prompt + self.row(o).tokens if o else [0] for o in owners]
        if self.prompt_table is None:
            result = generate(prefixes, key, self.round_budget(), list(self.cached))
        else:
            groups = SlotGroups([o and o[0] for o in owners], [len(self.groups[o[0]].prompt) if o else 1
                                                                 for o in owners], self.n, self.prompt_table)
            result = generate(prefixes, key, self.round_budget(), list(self.cached), groups)
        self.cached = [self.kv_cache != "reprefill" and o is not None for o in owners]  # a done row's slot is refilled
        lengths, finished = np.asarray(result.lengths), np.asarray(result.finished)
        tokens, logps = np.asarray(result.completion_ids), np.asarray(result.sampler_logps)
        kept = [self.extend(self.row(o), tokens[i, :lengths[i]], logps[i, :lengths[i]], bool(finished[i]), version)
                for i, o in enumerate(owners) if o]
        work = DecodeTally()
        work.add(len(owners), int(lengths.max(initial=0)), sum(kept))
        return work

    def extend(self, row: CarriedRow, tokens: np.ndarray, logps: np.ndarray, stopped: bool, version: int) -> int:
        """Appends a round's tokens (no more than max_new_tokens in all); returns how many."""
        take = min(len(tokens), self.max_new_tokens - len(row.tokens))
        row.tokens += tokens[:take].tolist()
        row.logps += logps[:take].tolist()
        row.versions += [version] * take
        row.finished = stopped and take == len(tokens)
        if row.finished or len(row.tokens) >= self.max_new_tokens:
            row.state = DONE
        return take

    def take_complete(self, max_groups: int) -> list[CarriedGroup]:
        ids = sorted(g for g, group in self.groups.items() if group.complete)[:max_groups]
        for slot, owner in enumerate(self.slots):
            if owner is not None and owner[0] in ids:
                self.slots[slot] = None
        taken = [self.groups.pop(g) for g in ids]
        self.recent_lengths.extend(len(row.tokens) for group in taken for row in group.rows)
        return taken

    def row(self, owner: tuple[int, int]) -> CarriedRow:
        return self.groups[owner[0]].rows[owner[1]]

    @property
    def carried_rows(self) -> int:
        """Rows with tokens that wait in the pool (running or done in an incomplete group)."""
        return sum(1 for g in self.groups.values() for r in g.rows if r.tokens)

    # ---- checkpoint -------------------------------------------------------------------
    def state(self) -> dict:
        """A JSON-able copy (Python floats hold float32 log-probs exactly)."""
        return {"groups": {str(g): dataclasses.asdict(group) for g, group in self.groups.items()},
                "slots": [list(o) if o else None for o in self.slots],
                "pending": [list(o) for o in self.pending], "next_group": self.next_group,
                "recent_lengths": list(self.recent_lengths)}

    def restore(self, state: dict) -> None:
        if len(state["slots"]) != len(self.slots):
            raise ValueError(f"the carried rollout pool has {len(state['slots'])} slots, this run {len(self.slots)}; "
                             f"resume with rollout.partial.slots={len(state['slots'])} and the original "
                             "rollout.prompts_per_step and rollout.n")
        self.groups = {int(g): CarriedGroup(d["example"], d["prompt"], [CarriedRow(**r) for r in d["rows"]])
                       for g, d in state["groups"].items()}
        self.slots = [tuple(o) if o else None for o in state["slots"]]
        self.pending = [tuple(o) for o in state["pending"]]
        self.next_group = int(state["next_group"])
        self.cached = [False] * len(self.slots)  # no cache is saved: a resumed run admits its rows anew
        self.recent_lengths.clear()
        self.recent_lengths.extend(state.get("recent_lengths", []))  # absent in pools saved before budget_quantile


def groups_result(groups: Sequence[CarriedGroup], max_new_tokens: int, pad_id: int) -> tuple[RolloutResult, np.ndarray]:
    """Complete groups -> (a host RolloutResult, rows p*K .. p*K+K-1 from group p;
    policy versions [N, Tn], -1 where no token)."""
    rows = [row for group in groups for row in group.rows]
    n = len(groups[0].rows)
    prompt_ids, prompt_mask = left_pad([group.prompt for group in groups for _ in range(n)], pad_id)
    ids = np.full((len(rows), max_new_tokens), pad_id, np.int32)
    logps = np.zeros((len(rows), max_new_tokens), np.float32)
    versions = np.full((len(rows), max_new_tokens), -1, np.int64)
    for i, row in enumerate(rows):
        ids[i, :len(row.tokens)], logps[i, :len(row.tokens)], versions[i, :len(row.tokens)] = (
            row.tokens, row.logps, row.versions)
    lengths = np.array([len(row.tokens) for row in rows], np.int32)
    mask = (np.arange(max_new_tokens)[None, :] < lengths[:, None]).astype(np.int32)
    result = RolloutResult(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=ids, completion_mask=mask,
                           lengths=lengths, sampler_logps=logps, finished=np.array([r.finished for r in rows]),
                           num_prompts=len(groups), n=n)
    return result, versions
