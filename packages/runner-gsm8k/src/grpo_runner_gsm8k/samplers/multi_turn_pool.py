"""Multi-turn rows carried across steps: the pool of rollout.multi_turn with rollout.partial.

The pool has prompts_per_step x n slots, as grpo_rollout.partial's. Each round, every slot
decodes at most `budget` tokens of its row's current assistant turn, by re-prefill of the
row's prompt and tokens so far (sampled and tool-turn tokens alike). A turn may so span
several rounds and several steps: its tokens wait in the row's open turn until it ends (a
stop token, `</tool_call>`, the turn's max_new_tokens, or the row's budget), and then the
turn rules of the synchronous loop (`MultiTurnRollout.end_turn`) apply to the whole turn,
so a carried row ends with the tokens, loss mask and log-probs it would have had within one
step. The calls of every row whose turn ended in a round are run before the next round (every
call returned, so a step never ends with a call in flight) and their tool turns appended. A
step runs rounds until prompts_per_step groups are complete and trains on them, oldest first;
rows still running are carried: in the middle of a turn, or with a tool turn (or an
environment's answer) appended and their next turn not begun.

Every sampled token keeps the policy version that drew it (tool-turn tokens: -1). The pool
is token lists and counts, saved as JSON with each checkpoint; tools are stateless, so a
resumed row needs nothing else but its environment's episode, when the run has one
(`SavedEnvironment.state()`, saved by process 0, which alone holds environments; an
environment's turn is answered in the round its turn ends, as a tool's).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import jax
import numpy as np

from grpo_core.rollout_records import DecodeTally
from grpo_rollout.partial import DONE, PENDING, RUNNING

from grpo_runner_gsm8k.samplers.trajectory import Trajectory

# Trajectory fields saved with a carried row as they are (its environment is saved by `environment_state`).
SAVED_FIELDS = tuple(f.name for f in dataclasses.fields(Trajectory) if f.name != "environment")


@dataclass
class CarriedConversation:
    """One row in the pool: its trajectory of ended turns (and their tool turns), the tokens
    of the assistant turn it is in the middle of, and the version of every sampled token."""

    trajectory: Trajectory
    versions: list = field(default_factory=list)  # one per trajectory token; -1 on tool-turn tokens
    open_ids: list = field(default_factory=list)
    open_logps: list = field(default_factory=list)
    open_versions: list = field(default_factory=list)
    state: str = PENDING

    def prefix(self) -> list[int]:
        return self.trajectory.prompt + self.trajectory.ids + self.open_ids

    def sync_versions(self, sampled: list[int]) -> None:
        """Versions for the tokens appended to the trajectory since the last sync: the first
        ones from `sampled` (a turn's kept tokens), the rest tool-turn tokens (-1)."""
        added = len(self.trajectory.ids) - len(self.versions)
        self.versions += sampled[:added] + [-1] * max(0, added - len(sampled))

    def state_dict(self) -> dict:
        saved = {name: getattr(self.trajectory, name) for name in SAVED_FIELDS}
        return {"trajectory": saved, "environment": environment_state(self.trajectory.environment),
                "versions": self.versions, "open_ids": self.open_ids, "open_logps": self.open_logps,
                "open_versions": self.open_versions, "state": self.state}

    @classmethod
    def from_state(cls, saved: dict, restore_environment: Callable[[dict], Any]) -> "CarriedConversation":
        environment = saved["environment"] and restore_environment(saved["environment"])
        fields = {name: value for name, value in saved.items() if name not in ("trajectory", "environment")}
        return cls(Trajectory(**saved["trajectory"], environment=environment), **fields)


def environment_state(shared: Any) -> Optional[dict]:
    """A row's environment (a SharedEnvironment) as JSON: its done flag and reward information as
    every process holds them, and its episode (`state()`) where it lives, on process 0."""
    if shared is None:
        return None
    episode = shared.environment.state() if shared.environment is not None else None
    return {"done": bool(shared.done), "info": dict(shared.info), "episode": episode}


@dataclass
class ConversationGroup:
    """The n rows of one example (the task's record of it)."""

    example: dict
    rows: list

    @property
    def complete(self) -> bool:
        return all(row.state == DONE for row in self.rows)


# generate(prefixes, key, budget, cached) -> RolloutResult (host arrays), as grpo_rollout.partial's Generate.
Generate = Callable[[list, Any, int, list], Any]
# draw() -> the next examples, one per process: (its record, each row's prompt ids, each row's
# environment, reset and shared, or None each).
Draw = Callable[[], list[tuple[dict, list[list[int]], list]]]


class ConversationPool:
    """The carried multi-turn rows of a run; `turns` (a MultiTurnRollout) holds the turn rules,
    the tools and the row budget."""

    def __init__(self, slots: int, n: int, budget: int, max_new_tokens: int, turns: Any,
                 restore_environment: Optional[Callable[[dict], Any]] = None):
        self.n, self.budget, self.max_new_tokens, self.turns = n, budget, max_new_tokens, turns
        self.restore_environment = restore_environment  # a saved environment (environment_state) rebuilt
        self.groups: dict[int, ConversationGroup] = {}
        self.slots: list[Optional[tuple[int, int]]] = [None] * slots
        self.pending: list[tuple[int, int]] = []
        self.next_group = 0

    def step(self, generate: Generate, draw: Draw, key: Any, version: int,
             max_groups: int) -> tuple[list[ConversationGroup], int, DecodeTally]:
        """Rounds until `max_groups` groups are complete; returns (those groups, oldest first,
        which leave the pool; the rounds run; their decode work)."""
        work = DecodeTally()
        for round_index in itertools.count():
            self.fill(draw)
            work += self.decode_round(generate, jax.random.fold_in(key, round_index), version)
            if sum(group.complete for group in self.groups.values()) >= max_groups:
                return self.take_complete(max_groups), round_index + 1, work
        raise AssertionError("unreachable")

    def fill(self, draw: Draw) -> None:
        """Every free slot gets a pending row; a new prompt is drawn when none is pending."""
        for slot, owner in enumerate(self.slots):
            if owner is not None and self.row(owner).state != DONE:
                continue
            if not self.pending:
                for example, prompts, environments in draw():
                    self.add_group(example, prompts, environments)
            owner = self.pending.pop(0)
            self.row(owner).state = RUNNING
            self.slots[slot] = owner

    def add_group(self, example: dict, prompts: list[list[int]], environments: list) -> None:
        gid, self.next_group = self.next_group, self.next_group + 1
        rows = [CarriedConversation(Trajectory(list(prompt), environment=environment))
                for prompt, environment in zip(prompts, environments, strict=True)]
        self.groups[gid] = ConversationGroup(example, rows)
        self.pending.extend((gid, k) for k in range(self.n))

    def decode_round(self, generate: Generate, key: Any, version: int) -> DecodeTally:
        """Every slot's row decodes up to `budget` tokens of its turn; the calls of the turns that
        ended are run and their tool turns appended, and the environments answer theirs. Returns
        the round's decode work."""
        rows = [self.row(owner) for owner in self.slots]
        result = generate([row.prefix() for row in rows], key, self.budget, [False] * len(rows))
        lengths, finished = np.asarray(result.lengths), np.asarray(result.finished)
        ids, logps = np.asarray(result.completion_ids), np.asarray(result.sampler_logps)
        calling, kept = [], 0
        for i, row in enumerate(rows):
            take = min(int(lengths[i]), self.max_new_tokens - len(row.open_ids))
            kept += take
            calls = self.extend(row, ids[i, :take].tolist(), logps[i, :take].tolist(),
                                bool(finished[i]) and take == int(lengths[i]), version)
            if calls:
                calling.append((row, calls))
        self.turns.tool_turn([(row.trajectory, calls) for row, calls in calling])
        self.turns.answer_environments()
        for row in rows:  # tool and environment turns appended (their versions -1), rows stopped
            self.close_row(row, [])
        work = DecodeTally()
        work.add(len(rows), int(lengths.max(initial=0)), kept)
        return work

    def extend(self, row: CarriedConversation, ids: list, logps: list, stopped: bool, version: int) -> list:
        """Appends a round's tokens to the row's open turn; when the turn is over, it ends as in
        one step (`end_turn`). Returns the calls the row goes on with ([] otherwise)."""
        row.open_ids += ids
        row.open_logps += logps
        row.open_versions += [version] * len(ids)
        # A turn at the row's budget ends now: one step would cut it there (add_sampled) all the same.
        if not (stopped or len(row.open_ids) >= min(self.max_new_tokens, row.trajectory.room(self.turns.budget))):
            return []  # the turn goes on next round
        last = row.trajectory.turns + 1 >= self.turns.max_turns
        calls = self.turns.end_turn(row.trajectory, row.open_ids, np.asarray(row.open_logps, np.float32),
                                    stopped, last)
        self.close_row(row, row.open_versions)
        row.open_ids, row.open_logps, row.open_versions = [], [], []
        return calls

    @staticmethod
    def close_row(row: CarriedConversation, sampled: list[int]) -> None:
        row.sync_versions(sampled)
        if row.trajectory.done:
            row.state = DONE

    def take_complete(self, max_groups: int) -> list[ConversationGroup]:
        ids = sorted(g for g, group in self.groups.items() if group.complete)[:max_groups]
        for slot, owner in enumerate(self.slots):
            if owner is not None and owner[0] in ids:
                self.slots[slot] = None
        return [self.groups.pop(g) for g in ids]

    def row(self, owner: tuple[int, int]) -> CarriedConversation:
        return self.groups[owner[0]].rows[owner[1]]

    @property
    def carried_rows(self) -> int:
        """Rows with tokens that wait in the pool (running, or done in an incomplete group)."""
        return sum(1 for group in self.groups.values() for row in group.rows
                   if row.trajectory.ids or row.open_ids)

    def state(self) -> dict:
        """A JSON-able copy (Python floats hold float32 log-probs exactly)."""
        groups = {str(g): {"example": group.example, "rows": [row.state_dict() for row in group.rows]}
                  for g, group in self.groups.items()}
        return {"groups": groups, "slots": [list(o) if o else None for o in self.slots],
                "pending": [list(o) for o in self.pending], "next_group": self.next_group, "multi_turn": True}

    def restore(self, state: dict) -> None:
        if len(state["slots"]) != len(self.slots):
            raise ValueError(f"the carried rollout pool has {len(state['slots'])} slots, this run {len(self.slots)}; "
                             "resume with the original rollout.prompts_per_step and rollout.n")
        if not state.get("multi_turn"):
            raise ValueError("the carried rows are single-turn, this run's are multi-turn; resume with the "
                             "original rollout.multi_turn.enabled")
        self.groups = {int(g): ConversationGroup(d["example"], [CarriedConversation.from_state(
            r, self.restore_environment) for r in d["rows"]]) for g, d in state["groups"].items()}
        self.slots = [tuple(o) if o else None for o in state["slots"]]
        self.pending = [tuple(o) for o in state["pending"]]
        self.next_group = int(state["next_group"])
