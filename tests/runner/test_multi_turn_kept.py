"""Multi-turn rows on kept KV caches (grpo_runner_gsm8k.samplers.multi_turn_kept) against the re-prefill
loop, with a tiny random model on the real backend. Greedy, both give the same tokens and
log-probs; and a row whose tool has not returned holds up no other row.

A random model writes no real call, so the test's tokenizer reads any turn that ends on the
chosen `call_end` token (one the model often picks) as a call, and a tool turn appends fixed
tokens: the turn loops, the tool runner and the caches run as in a run."""

import collections
import threading

import jax
import numpy as np
import pytest

from grpo_core.contracts import Policy, SamplingParams
from grpo_core.models import QwenConfig, init_from_config
from grpo_core.tool_calls import ToolRunner
from grpo_rollout import JaxRollout, JaxRolloutOptions
from grpo_runner_gsm8k.samplers.multi_turn_rollout import MultiTurnRollout, turn_sampling

TOOL_TURN = [40, 41, 42, 43]  # the tokens every tool turn appends
# One shared ending, so that greedy continuations share tokens and several rows "call".
PROMPTS = [head + [30, 31, 32] for head in ([5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18], [19, 20, 21],
                                            [22, 23], [24], [25, 26, 27, 28])]


class Echo:
    """A tool whose first call waits for `release` (at most 60 s); the others return at once."""

    name, description = "echo", "Returns ok."
    parameters = {"type": "object", "properties": {}}

    def __init__(self, hold_first: bool):
        self.release, self.released, self.hold_first, self.lock, self.count = threading.Event(), None, hold_first, \
            threading.Lock(), 0

    def __call__(self, arguments):
        with self.lock:
            first, self.count = self.count == 0, self.count + 1
        if first and self.hold_first:
            self.released = self.release.wait(60)
        return "ok"


class CallsOn:
    """Decodes a turn ending on `end` as a call of `echo` (the loop decodes only such turns)."""

    def __init__(self, end: int):
        self.end = end

    def decode(self, ids, skip_special_tokens=False):
        assert ids[-1] == self.end
        return '<tool_call>{"name": "echo", "arguments": {}}</tool_call>'


class FixedToolTurn(MultiTurnRollout):
    def append_tool_turn(self, row, outcomes):
        if not row.add_tool_turn(TOOL_TURN, outcomes, self.budget):
            row.stop(finished=False)


class RecordedRounds:
    """The backend, recording which rows each kept-cache round decodes; from the round in which
    a row decodes its second turn on, it releases the held tool."""

    def __init__(self, backend, tool):
        self.backend, self.tool, self.live = backend, tool, []

    def generate_round(self, prefixes, cached, key, sampling, **kwargs):
        self.live.append(list(kwargs["live"]))
        if len(self.live) >= 2:
            self.tool.release.set()
        return self.backend.generate_round(prefixes, cached, key, sampling, **kwargs)

    def release_kept_cache(self):
        self.backend.release_kept_cache()


@pytest.fixture(scope="module")
def backend():
    model = init_from_config(QwenConfig.tiny("qwen2"), seed=1)
    rollout = JaxRollout(JaxRolloutOptions(prompt_buckets=(8, 16, 32, 64)))
    rollout.load_weights(Policy.of(model))
    return rollout


@pytest.fixture(scope="module")
def call_end(backend):
    """The token that the most rows' first 6 greedy tokens hold."""
    result = backend.generate(PROMPTS, jax.random.key(0), SamplingParams(max_new_tokens=6, n=1, greedy=True))
    counts = collections.Counter(t for row in np.asarray(result.completion_ids).tolist() for t in set(row))
    return counts.most_common(1)[0][0]


def rollout(backend, call_end, *, kv_cache, tool):
    runner = ToolRunner([tool], timeout_seconds=90)
    sampling = turn_sampling(SamplingParams(max_new_tokens=6, n=1, greedy=True), call_end)
    turns = FixedToolTurn(backend=backend, tokenizer=CallsOn(call_end), runner=runner, sampling=sampling,
                          call_end_id=call_end, max_turns=3, budget=40, kv_cache=kv_cache)
    try:
        return turns, turns.rollout(PROMPTS, 1, jax.random.key(3))[0]
    finally:
        runner.close()


def test_greedy_rows_on_kept_caches_equal_the_reprefilled_ones(backend, call_end):
    _, reprefilled = rollout(backend, call_end, kv_cache=False, tool=Echo(hold_first=False))
    _, kept = rollout(backend, call_end, kv_cache=True, tool=Echo(hold_first=False))
    assert sum(row.tool_calls > 0 for row in kept) >= 2 and max(row.turns for row in kept) >= 2
    for again, row in zip(kept, reprefilled):
        assert (again.ids, again.trained, again.turns, again.finished) == (row.ids, row.trained, row.turns, row.finished)
        np.testing.assert_allclose(again.logps, row.logps, atol=1e-5)  # f32: cached decode vs fresh prefill


def test_a_row_waiting_on_its_tool_holds_up_no_other_row(backend, call_end):
    tool = Echo(hold_first=True)
    recorder = RecordedRounds(backend, tool)
    turns, rows = rollout(recorder, call_end, kv_cache=True, tool=tool)
    assert tool.released  # a round ran while the first call was still held
    held = [i for i, row in enumerate(rows) if row.tool_calls]
    assert len(held) >= 2
    waiting = [live for live in recorder.live[1:] if any(live[i] for i in held)]
    assert any(not all(live[i] for i in held) for live in waiting)  # some calling row sat a round out
    assert all(row.turns >= 2 for row in rows if row.tool_calls)  # the held row continued afterwards
