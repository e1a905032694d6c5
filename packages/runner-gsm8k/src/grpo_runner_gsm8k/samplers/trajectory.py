"""One multi-turn row as the host builds it, and the rollout record made of the rows.

A trajectory is one completion: the tokens the model sampled, turn after turn, with the
chat template's tokens of each tool turn appended between them (token in, token out).
Sampled tokens carry loss mask 1 and their sampler log-probs; tool-turn tokens carry loss
mask 0 and log-prob 0: they are attended to but never trained on, in no denominator, no
entropy selection and no KL. The advantage estimators see each row's turns and tool calls, and
the turn of each token (`episode_arrays`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from grpo_core.rollout_records import RolloutResult
from grpo_core.tool_calls import ToolOutcome


@dataclass
class Trajectory:
    """One row: its prompt ids and everything after them, with a loss-mask entry and a
    log-prob per completion token. answer_start: where the last assistant turn begins."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    trained: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    token_turns: list[int] = field(default_factory=list)  # each token's assistant turn (0, 1, ..), -1 tool turns
    answer_start: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_seconds: float = 0.0
    done: bool = False
    finished: bool = False
    environment: Any = None  # the row's Environment, when the run has one

    def room(self, budget: int) -> int:
        return budget - len(self.ids)

    def add_sampled(self, ids: Sequence[int], logps: Sequence[float], budget: int) -> bool:
        """Appends one assistant turn's sampled tokens, cut at the row's token budget; False
        when they were cut (the row then stops, unfinished)."""
        keep = min(len(ids), self.room(budget))
        self.answer_start, self.turns = len(self.ids), self.turns + 1
        self.ids += [int(t) for t in ids[:keep]]
        self.trained += [1] * keep
        self.logps += [float(p) for p in logps[:keep]]
        self.token_turns += [self.turns - 1] * keep
        return keep == len(ids)

    def add_tool_turn(self, ids: Sequence[int], outcomes: Sequence[ToolOutcome], budget: int) -> bool:
        """Counts the turn's calls and appends its template tokens (a tool turn, or an
        environment's messages with no outcomes); False (nothing appended) when they do not
        fit the row's budget."""
        self.tool_calls += len(outcomes)
        self.tool_errors += sum(outcome.status == "error" for outcome in outcomes)
        self.tool_timeouts += sum(outcome.status == "timeout" for outcome in outcomes)
        self.tool_seconds += sum(outcome.seconds for outcome in outcomes)
        if len(ids) > self.room(budget):
            return False
        self.ids += [int(t) for t in ids]
        self.trained += [0] * len(ids)
        self.logps += [0.0] * len(ids)
        self.token_turns += [-1] * len(ids)
        return True

    def stop(self, finished: bool) -> None:
        self.done, self.finished = True, finished

    @property
    def answer_ids(self) -> list[int]:
        return self.ids[self.answer_start:]


def _left_padded(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(row) for row in rows)
    ids = np.full((len(rows), width), pad_id, np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
    return ids, mask


def trajectory_result(rows: Sequence[Trajectory], n: int, width: int, pad_id: int) -> RolloutResult:
    """The rows as one host-side RolloutResult of completion width `width` (the row budget):
    completion_mask 1 on every real token, loss_mask 1 on the sampled ones only."""
    count = len(rows)
    prompt_ids, prompt_mask = _left_padded([row.prompt for row in rows], pad_id)
    ids = np.full((count, width), pad_id, np.int32)
    real, trained = np.zeros((count, width), np.int32), np.zeros((count, width), np.int32)
    logps = np.zeros((count, width), np.float32)
    for i, row in enumerate(rows):
        length = len(row.ids)
        ids[i, :length], real[i, :length] = row.ids, 1
        trained[i, :length], logps[i, :length] = row.trained, row.logps
    return RolloutResult(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=ids, completion_mask=real,
                         lengths=real.sum(axis=1).astype(np.int32), sampler_logps=logps,
                         finished=np.array([row.finished for row in rows]), loss_mask=trained,
                         num_prompts=count // n, n=n)


def row_counts(row: Trajectory) -> dict[str, float]:
    """One row's tool work, as the tool metrics and an eval's samples record it."""
    return {"turns": row.turns, "tool_calls": row.tool_calls, "tool_errors": row.tool_errors,
            "tool_timeouts": row.tool_timeouts, "tool_seconds": row.tool_seconds,
            "masked_tokens": len(row.ids) - sum(row.trained)}


def tool_metrics(counts: Sequence[dict], prefix: str) -> dict:
    """Turns, calls, errors, timeouts, tool seconds and masked tokens over rows' `row_counts`."""
    def column(name: str) -> np.ndarray:
        return np.array([row[name] for row in counts], np.float64)

    turns, calls, masked = column("turns"), column("tool_calls"), column("masked_tokens")
    return {f"{prefix}turns_mean": float(turns.mean()), f"{prefix}turns_max": int(turns.max(initial=0)),
            f"{prefix}calls": int(calls.sum()), f"{prefix}calls_per_row": float(calls.mean()),
            f"{prefix}call_rate": float((calls > 0).mean()),
            f"{prefix}errors": int(column("tool_errors").sum()),
            f"{prefix}timeouts": int(column("tool_timeouts").sum()),
            f"{prefix}seconds": float(column("tool_seconds").sum()),
            f"{prefix}masked_tokens": int(masked.sum()), f"{prefix}masked_tokens_per_row": float(masked.mean())}


def trajectory_metrics(rows: Sequence[Trajectory], prefix: str = "train-tools/") -> dict:
    """Per-row tool metrics of a step: turns, calls, errors, timeouts, tool seconds, masked tokens."""
    return tool_metrics([row_counts(row) for row in rows], prefix)


def episode_arrays(rows: Sequence[Trajectory], width: int) -> dict[str, np.ndarray]:
    """What the advantage estimators receive of each row's episode (`StepRewards.episodes`):
    turns, tool_calls, tool_errors, tool_timeouts [N] int32; token_turn [N, width] int32, the
    assistant turn (0, 1, ...) of each completion token, -1 on tool-turn tokens and padding;
    env/<name> [N] float32, the environment's reward information (0 where a row has none)."""
    token_turn = np.full((len(rows), width), -1, np.int32)
    for i, row in enumerate(rows):
        token_turn[i, :len(row.token_turns)] = row.token_turns
    counts = {name: np.array([getattr(row, name) for row in rows], np.int32)
              for name in ("turns", "tool_calls", "tool_errors", "tool_timeouts")}
    infos = [row.environment.reward_info() if row.environment is not None else {} for row in rows]
    environment = {f"env/{name}": np.array([float(info.get(name, 0.0)) for info in infos], np.float32)
                   for name in sorted({name for info in infos for name in info})}
    return {**counts, "token_turn": token_turn, **environment}
