"""What every task gives the training loop: examples, a resumable order, prompt text."""

from __future__ import annotations

import string
from typing import Any, Callable

import numpy as np

from grpo_core.config import EvalConfig
from grpo_core.contracts import Example, ListableTask

from grpo_runner_gsm8k.tokens import render_prompt  # noqa: F401 (re-exported: the prompt text of a task)


def check_process(process_index: int, process_count: int) -> None:
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} with process_count={process_count}: "
                         f"need process_count >= 1 and 0 <= process_index < process_count")


def shard_of(count: int, process_index: int, process_count: int) -> range:
    """Positions of this process among the first `count` items, strided, equal for
    every process (the last `count % process_count` items are left out)."""
    usable = count - count % process_count
    return range(process_index, usable, process_count)


class EpochOrder:
    """Real epochs over a dataset of `size` rows, split across processes.

    Each epoch is a fresh permutation of all rows (seeded by `seed` and the epoch
    number); process `p` of `k` takes every k-th row of it starting at `p`, so the
    shards of one epoch are disjoint and, together, cover every row except at most
    `k - 1` (a different few each epoch). All processes hold the same position.
    """

    def __init__(self, size: int, seed: int, process_index: int = 0, process_count: int = 1):
        check_process(process_index, process_count)
        if size < process_count:
            raise ValueError(f"{size} rows cannot be split over {process_count} processes; "
                             f"use a larger dataset or fewer processes")
        self.size, self.seed = size, seed
        self.process_index, self.process_count = process_index, process_count
        self.epoch, self.offset = 0, 0
        self._cached: tuple[int, np.ndarray] | None = None

    @property
    def shard_size(self) -> int:
        return self.size // self.process_count

    def _epoch_rows(self, epoch: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != epoch:
            permutation = np.random.default_rng([self.seed, epoch]).permutation(self.size)
            shard = shard_of(self.size, self.process_index, self.process_count)
            self._cached = (epoch, permutation[shard.start:shard.stop:shard.step])
        return self._cached[1]

    def take(self, n: int) -> list[int]:
        """The next `n` row indices, continuing into the next epoch when this one ends."""
        if n < 1:
            raise ValueError(f"batch size must be >= 1, got {n}")
        rows: list[int] = []
        while len(rows) < n:
            epoch_rows = self._epoch_rows(self.epoch)
            taken = epoch_rows[self.offset:self.offset + n - len(rows)]
            rows += taken.tolist()
            self.offset += len(taken)
            if self.offset == self.shard_size:
                self.epoch, self.offset = self.epoch + 1, 0
        return rows

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "size": self.size,
                "process_count": self.process_count}

    def restore(self, state: dict[str, Any]) -> None:
        expected = {"seed": self.seed, "size": self.size, "process_count": self.process_count}
        changed = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
        if changed:
            detail = ", ".join(f"{k} was {old!r}, now {new!r}" for k, (old, new) in changed.items())
            raise ValueError(f"cannot resume the data order: {detail}; resume with the original "
                             f"task seed, data and process count, or start a new run directory")
        if not 0 <= state["offset"] < self.shard_size or state["epoch"] < 0:
            raise ValueError(f"data position epoch={state['epoch']} offset={state['offset']} is out of "
                             f"range for a shard of {self.shard_size} rows")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])


def check_template(option: str, template: str, fields: tuple[str, ...], required: tuple[str, ...] = ()) -> None:
    """A `str.format` text of a task option names only `fields` and each of `required`: a misspelt
    field would fail when the first problem is made, a missing one leave the question without it."""
    shown = ", ".join("{" + f + "}" for f in fields)
    try:
        named = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ValueError(f"{option} = {template!r} is not a format text ({exc}); write a literal brace as "
                         "{{ or }}") from None
    for name in named:
        if name not in fields:
            raise ValueError(f"{option} = {template!r} names the unknown field {{{name}}}; the fields are "
                             f"{shown} (write a literal brace as {{{{ or }}}})")
    for name in required:
        if name not in named:
            raise ValueError(f"{option} = {template!r} lacks {{{name}}}; the question needs it, e.g. "
                             f"add {{{name}}} to {option}")


TRAIN_STREAM, TEST_STREAM = 0, 1  # problem streams of a generated task


class GeneratedTask:
    """An endless training stream and a fixed test split of problems made on demand (see `Task`):
    problem `i` of a stream is `make_problem(options, seed, stream, i)`, so the position alone
    resumes the stream. Process p of k takes global indices p, p + k, p + 2k, ...: disjoint
    across processes."""

    name = "generated"  # the task's name, in the resume error
    make_problem: Callable[[Any, int, int, int], Example]  # set by each task, as a staticmethod

    def __init__(self, options: Any, *, seed: int = 0, process_index: int = 0, process_count: int = 1):
        check_process(process_index, process_count)
        self.options, self.seed = options, seed
        self.use_chat_template = options.use_chat_template
        self.process_index, self.process_count = process_index, process_count
        self.position = 0  # training problems this process has taken (the same on every process)

    def train_batch(self, n: int) -> list[Example]:
        if n < 1:
            raise ValueError(f"batch size must be >= 1, got {n}")
        start, self.position = self.position, self.position + n
        return [self.make_problem(self.options, self.seed, TRAIN_STREAM, step * self.process_count + self.process_index)
                for step in range(start, start + n)]

    def test_examples(self, limit: int | None = None) -> list[Example]:
        count = self.options.test_size if limit is None else min(limit, self.options.test_size)
        return [self.make_problem(self.options, self.seed, TEST_STREAM, i)
                for i in shard_of(count, self.process_index, self.process_count)]

    def state(self) -> dict[str, Any]:
        return {"position": self.position, "seed": self.seed, "process_count": self.process_count}

    def restore(self, state: dict[str, Any]) -> None:
        expected = {"seed": self.seed, "process_count": self.process_count}
        changed = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
        if changed or state.get("position", -1) < 0:
            raise ValueError(f"cannot resume the {self.name} stream from {state!r} with seed={self.seed}, "
                             f"process_count={self.process_count}; resume with the original settings")
        self.position = int(state["position"])


def prompts_to_check(eval_cfg: EvalConfig, task: Any, prompts_per_process: int) -> list:
    """The whole train split when the task can list it (`train_examples()`, a finite data set),
    else the first train batch (the task's position is left unchanged); plus the eval questions."""
    if isinstance(task, ListableTask):
        examples = list(task.train_examples())
    else:
        position = task.state()
        examples = task.train_batch(prompts_per_process)
        task.restore(position)
    if eval_cfg.every_steps:
        examples += task.test_examples(eval_cfg.num_questions)
    return examples
