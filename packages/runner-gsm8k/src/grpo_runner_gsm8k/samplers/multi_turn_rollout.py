"""Multi-turn, tool-using rollouts (rollout.multi_turn): the turn rules, and the turn loop by
re-prefill (the loop on kept KV caches is grpo_runner_gsm8k.samplers.multi_turn_kept).

Each turn, every row still running decodes through the backend's `generate` from its whole
token list (prompt, sampled turns, tool turns) until a stop token, `</tool_call>` (one token
in the Qwen format, added to the stop tokens) or the turn's `rollout.max_new_tokens`. A row
that ended on `</tool_call>` has its calls parsed from the turn's text and run by the
ToolRunner (every row's calls at once, each call with its timeout); the chat template's
tokens of the `tool` turn (`append_turn_ids`: the rendered difference, never a
re-tokenisation of sampled text) are appended and the row goes on at the next turn, up to
`max_turns` assistant turns and `max_total_tokens` completion tokens. Rows that finished
stop; the others continue together.

By re-prefill, the prefix is prefilled again at every turn and a turn starts once every call
of the previous one has returned (rollout.multi_turn.kv_cache: reprefill; the backend needs
only `generate`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
from grpo_core.chat_turns import append_turn_ids
from grpo_core.contracts import SamplingParams
from grpo_core.rollout_records import DecodeTally
from grpo_core.tool_calls import ToolRunner, parse_tool_calls, response_messages

from grpo_runner_gsm8k.multihost import host_array
from grpo_runner_gsm8k.samplers.multi_turn_kept import KeptCacheTurns
from grpo_runner_gsm8k.samplers.shared_environments import share, step_all
from grpo_runner_gsm8k.samplers.shared_tools import all_returned, submit
from grpo_runner_gsm8k.samplers.trajectory import Trajectory

CALL_END = "</tool_call>"


def single_token_id(tokenizer: Any, token: str) -> int | None:
    """The id of `token` when the tokenizer encodes it as exactly one token, else None."""
    ids = tokenizer.encode(token, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


def data_shards(batch_sharding: Any) -> int:
    """How many parts the rollout batch's first dimension is split into (1 without sharding)."""
    if batch_sharding is None or not len(batch_sharding.spec) or batch_sharding.spec[0] is None:
        return 1
    axes = batch_sharding.spec[0]
    axes = axes if isinstance(axes, tuple) else (axes,)
    return math.prod(batch_sharding.mesh.shape[axis] for axis in axes)


@dataclasses.dataclass
class MultiTurnRollout:
    """The turn loop over one batch of rows (weights already loaded into `backend`).

    sampling: the turn's sampling (n=1, max_new_tokens a turn's budget, stop tokens with
    `call_end_id`); budget: completion tokens per row over all turns."""

    backend: Any
    tokenizer: Any
    runner: ToolRunner
    sampling: SamplingParams
    call_end_id: int
    max_turns: int
    budget: int
    pad_token_id: int = 0
    batch_sharding: Any = None
    template_kwargs: dict = dataclasses.field(default_factory=dict)
    kv_cache: bool = False  # continue on the backend's kept caches (grpo_runner_gsm8k.samplers.multi_turn_kept)
    environment_due: list = dataclasses.field(default_factory=list)  # (row, turn ids, last) to answer

    def rollout(self, prompts: Sequence[Sequence[int]], n: int, key: jax.Array,
                environments: Sequence[Any] | None = None) -> tuple[list[Trajectory], DecodeTally]:
        """n rows per prompt (rows p*n .. p*n+n-1 share prompt p), each run to its end, and the
        decode work they took; environments: one per row, already reset (their opening messages
        are the prompts)."""
        rows = [Trajectory(list(prompt)) for prompt in prompts for _ in range(n)]
        for row, environment in zip(rows, share(environments or ())):
            row.environment = environment
        if self.kv_cache:
            try:
                work = KeptCacheTurns(self, rows, len(rows) + -len(rows) % data_shards(self.batch_sharding)).run(key)
            finally:
                self.backend.release_kept_cache()
            return rows, work
        work = DecodeTally()
        for turn in range(self.max_turns):
            active = [row for row in rows if not row.done]
            if not active:
                break
            calling, turn_work = self.decode_turn(active, jax.random.fold_in(key, turn), last=turn == self.max_turns - 1)
            work += turn_work
            self.tool_turn(calling)
        return rows, work

    def decode_turn(self, active: list[Trajectory], key: jax.Array, *, last: bool) -> tuple[list, DecodeTally]:
        """One assistant turn of every active row; returns (row, calls) of the rows that go on, and
        the turn's decode work."""
        prefixes = [row.prompt + row.ids for row in active]
        shards = data_shards(self.batch_sharding)
        prefixes += [prefixes[0]] * (-len(prefixes) % shards)  # filler rows, discarded
        result = self.backend.generate(prefixes, key, self.sampling, pad_token_id=self.pad_token_id,
                                       batch_sharding=self.batch_sharding)
        ids, logps = host_array(result.completion_ids), host_array(result.sampler_logps)
        lengths, finished = host_array(result.lengths), host_array(result.finished)
        work = DecodeTally()
        work.add(len(prefixes), int(lengths.max(initial=0)), int(lengths.sum()))
        calling = []
        for i, row in enumerate(active):
            calls = self.end_turn(row, ids[i, :lengths[i]].tolist(), logps[i, :lengths[i]], bool(finished[i]), last)
            if calls:
                calling.append((row, calls))
        self.answer_environments()
        return calling, work

    def end_turn(self, row: Trajectory, turn_ids: list, turn_logps: Any, stopped: bool, last: bool) -> list:
        """Appends a row's sampled turn; returns the calls it goes on with ([] when the row stops)."""
        if not row.add_sampled(turn_ids, turn_logps, self.budget):
            row.stop(finished=False)  # out of completion tokens
        elif not (stopped and turn_ids and turn_ids[-1] == self.call_end_id):
            if stopped and row.environment is not None:
                self.environment_due.append((row, turn_ids, last))  # answered by answer_environments
            else:
                row.stop(finished=stopped)
        else:
            calls = parse_tool_calls(self.tokenizer.decode(turn_ids, skip_special_tokens=False))
            if not calls:  # a closing tag without a call: the model ended its turn
                row.stop(finished=True)
            elif last:  # a call it has no turn left to read the answer of
                row.stop(finished=False)
            else:
                return calls
        return []

    def tool_turn(self, calling: list) -> None:
        """Runs every calling row's calls at once (on process 0, see
        grpo_runner_gsm8k.samplers.shared_tools) and appends each row's tool turn."""
        outcomes = all_returned([submit(self.runner, calls) for _, calls in calling])
        for (row, _), row_outcomes in zip(calling, outcomes):
            self.append_tool_turn(row, row_outcomes)

    def answer_environments(self) -> None:
        """Each row that ended a turn without a call since the last answers gets its environment's
        answer; the environments are stepped together, on process 0 (see
        grpo_runner_gsm8k.samplers.shared_environments)."""
        due, self.environment_due = self.environment_due, []
        texts = [self.tokenizer.decode(turn_ids, skip_special_tokens=True) for _, turn_ids, _ in due]
        answers = step_all([row.environment for row, _, _ in due], texts)
        for (row, _, last), answer in zip(due, answers):
            self.environment_turn(row, answer, last)

    def environment_turn(self, row: Trajectory, answer: Any, last: bool) -> None:
        """The row's environment's `answer` to the turn the model ended: the episode ends, or its
        messages are appended and the row goes on (while it has turns left)."""
        if answer.done or row.environment.done or not answer.messages or last:
            row.stop(finished=answer.done or row.environment.done)
            return
        appended = append_turn_ids(self.tokenizer, row.prompt + row.ids, list(answer.messages),
                                   tools=self.runner.offered(), template_kwargs=self.template_kwargs)
        if not row.add_tool_turn(appended, [], self.budget):
            row.stop(finished=False)

    def append_tool_turn(self, row: Trajectory, outcomes: list) -> None:
        """The template's tokens of the tool turn answering `outcomes`, appended to the row."""
        appended = append_turn_ids(self.tokenizer, row.prompt + row.ids, response_messages(outcomes),
                                   tools=self.runner.offered(), template_kwargs=self.template_kwargs)
        if not row.add_tool_turn(appended, outcomes, self.budget):
            row.stop(finished=False)  # the tool turn does not fit the row's budget


def turn_sampling(sampling: SamplingParams, call_end_id: int) -> SamplingParams:
    """The run's sampling for one turn of a row: one sample, also stopping at `</tool_call>`."""
    stops = tuple(dict.fromkeys((*sampling.stop_token_ids, call_end_id)))
    return dataclasses.replace(sampling, n=1, stop_token_ids=stops)
