"""The boxed-answer math family: problems whose final answer is asked for in `\\boxed{}`.

`boxed_math` reads any JSONL/parquet file or HF Hub dataset through a field mapping
(problem, answer, id, and the fields results are broken down by); the presets `math500`
(Hub `HuggingFaceH4/MATH-500`), `aime` and `amc` (by path) only change the defaults.
A completion is graded by its boxed answers (every box must agree; see `grading.grade_boxed`)
against the reference with math-verify, each answer under a time limit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_core.config import setting
from grpo_core.contracts import Example
from grpo_core.errors import UserError

from grpo_runner_gsm8k.tasks.grading import Graded, TimedVerifier, grade_boxed
from grpo_runner_gsm8k.tasks.base import EpochOrder, check_process, check_template, shard_of
from grpo_runner_gsm8k.tasks.gsm8k import _BLANK, _parse_jsonl_line, _read_parquet

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class BoxedMathOptions:
    """Options of the `boxed_math` task (and its presets)."""

    path: str = setting(
        "", "A .jsonl or .parquet file (used for every split), or a pattern with {split} such as "
        "data/{split}.jsonl. Empty loads `hub_dataset`.")
    hub_dataset: str = setting("", "HF Hub dataset id, used when `path` is empty.")
    hub_config: str = setting("", "HF Hub dataset config; empty for the default.")
    train_split: str = setting("train", "Split used for training.")
    test_split: str = setting("test", "Split used for evaluation.")
    problem_field: str = setting("problem", "Row field holding the problem text.")
    answer_field: str = setting("answer", "Row field holding the reference final answer (LaTeX or a number).")
    id_field: str = setting("unique_id", "Row field holding a unique id; empty numbers the rows.")
    breakdown_fields: list = setting(
        ["subject", "level"], "Row fields eval results are broken down by (rows without one are left out of it).")
    instruction: str = setting(BOXED_INSTRUCTION, "Appended to each problem after a blank line; empty for none.")
    use_chat_template: bool = setting(True, "Render prompts with the tokenizer's chat template.")
    # 5 s: every MATH-500 reference answer grades in well under a second; only runaway sympy work is cut.
    grading_timeout_s: float = setting(5.0, "Wall-clock limit of one math-verify comparison; past it, wrong.",
                                       gt=0.0)

    def __post_init__(self):
        check_template("path", self.path, ("split",))


@dataclass(frozen=True)
class Math500Options(BoxedMathOptions):
    """Options of the `math500` task: MATH-500 from the Hub, or its JSONL by `path`."""

    hub_dataset: str = setting("HuggingFaceH4/MATH-500", "HF Hub dataset id, used when `path` is empty.")
    train_split: str = setting("test", "MATH-500 has only a test split.")


@dataclass(frozen=True)
class CompetitionOptions(BoxedMathOptions):
    """Options of the `aime` and `amc` tasks: a JSONL/parquet file given by `path`."""

    id_field: str = setting("id", "Row field holding a unique id; empty numbers the rows.")
    breakdown_fields: list = setting([], "Row fields eval results are broken down by, e.g. [year].")


def _rows_of_file(path: Path) -> list[tuple[int, Any]]:
    """(line number, row) of a JSONL file, or (row number, row) of a parquet file."""
    if not path.is_file():
        raise UserError(f"boxed-math data file {path} does not exist; check task.options.path")
    if path.suffix == ".parquet":
        return list(enumerate(_read_parquet([path]), 1))
    if path.suffix != ".jsonl":
        raise UserError(f"boxed-math data file {path} is neither .jsonl nor .parquet; convert it or point "
                        "task.options.path at one that is")
    rows, offset = [], 0
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            row = _parse_jsonl_line(path, number, offset, raw)
            if row is not _BLANK:
                rows.append((number, row))
            offset += len(raw)
    return rows


def _read_rows(options: BoxedMathOptions, task: str, split: str) -> tuple[str, list[tuple[int, Any]]]:
    """Where the rows came from (for error messages) and the numbered rows."""
    if options.path:
        path = Path(os.path.expanduser(options.path.format(split=split) if "{split}" in options.path
                                       else options.path))
        return str(path), _rows_of_file(path)
    if not options.hub_dataset:
        raise UserError(f"task {task} has no data: set task.options.path to a .jsonl/.parquet file "
                        "(or task.options.hub_dataset to an HF Hub dataset id)")
    return f"{options.hub_dataset} split {split}", list(enumerate(_hub_rows(options, task, split), 1))


def _hub_rows(options: BoxedMathOptions, task: str, split: str) -> list[Any]:
    """The rows of a Hub dataset split; one that cannot be fetched (offline, no such dataset or
    split) is a UserError saying what to do."""
    import datasets

    try:
        return datasets.load_dataset(options.hub_dataset, options.hub_config or None, split=split).to_list()
    except (OSError, ValueError) as exc:  # ConnectionError (offline), DatasetNotFoundError, unknown split
        cause = " ".join(str(exc).split())[:300]
        offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") not in (None, "", "0") else ""
        raise UserError(f"task {task}: cannot load HF Hub dataset {options.hub_dataset} split {split}{offline} "
                        f"({type(exc).__name__}: {cause}); set task.options.path to a local .jsonl/.parquet copy, "
                        "or reach the Hub") from None


def _field(row: Any, name: str, where: str, option: str) -> Any:
    if not isinstance(row, dict):
        raise UserError(f"{where} is a {type(row).__name__}, not an object; fix or remove it")
    if name not in row or row[name] is None:
        raise UserError(f"{where} has no field {name!r} (fields: {sorted(row)}); set task.options.{option} "
                        "to the field that holds it")
    return row[name]


class BoxedMathTask:
    """Boxed-answer problems: real epochs over the train split, a fixed test split, a grader."""

    def __init__(self, options: BoxedMathOptions, *, seed: int = 0, process_index: int = 0,
                 process_count: int = 1, name: str = "boxed_math"):
        check_process(process_index, process_count)
        self.options, self.name, self.seed = options, name, seed
        self.use_chat_template = options.use_chat_template
        self.process_index, self.process_count = process_index, process_count
        self.verifier = TimedVerifier(options.grading_timeout_s)
        self._splits: dict[str, list[Example]] = {}
        self._fields: dict[str, dict[str, Any]] = {}
        self._order: EpochOrder | None = None

    def examples(self, split: str) -> list[Example]:
        """Every example of a split (read once)."""
        if split not in self._splits:
            where, rows = _read_rows(self.options, self.name, split)
            if not rows:
                raise UserError(f"{where} holds no rows; check task.options.path")
            self._splits[split] = [self._example(row, f"{where} line {number}", split, number)
                                   for number, row in rows]
            self._check_breakdown(where, [row for _, row in rows])
        return self._splits[split]

    def _example(self, row: Any, where: str, split: str, number: int) -> Example:
        o = self.options
        problem = _field(row, o.problem_field, where, "problem_field")
        answer = _field(row, o.answer_field, where, "answer_field")
        ident = str(_field(row, o.id_field, where, "id_field")) if o.id_field else str(number)
        question = f"{str(problem).strip()}\n\n{o.instruction}" if o.instruction else str(problem).strip()
        example = Example(question, str(answer).strip(), f"{self.name}/{split}/{ident}")
        self._fields[example.id] = {f: row[f] for f in o.breakdown_fields if row.get(f) is not None}
        return example

    def _check_breakdown(self, where: str, rows: list[dict]) -> None:
        """A breakdown field set away from the default that no row holds is misspelt, not sparse."""
        if self.options.breakdown_fields == type(self.options)().breakdown_fields:
            return
        for name in self.options.breakdown_fields:
            if not any(row.get(name) is not None for row in rows):
                raise UserError(f"task.options.breakdown_fields names {name!r}, which no row of {where} holds "
                                f"(fields: {sorted(rows[0])}); name fields the rows have")

    def example_fields(self, example_id: str) -> dict[str, Any]:
        """The breakdown fields of an example (e.g. MATH's subject and level)."""
        return dict(self._fields.get(example_id, {}))

    def grade(self, completion: str, reference: str) -> Graded:
        return grade_boxed(self.verifier, completion, reference)

    def _train_order(self) -> EpochOrder:
        if self._order is None:
            size = len(self.examples(self.options.train_split))
            self._order = EpochOrder(size, self.seed, self.process_index, self.process_count)
        return self._order

    def train_batch(self, n: int) -> list[Example]:
        train = self.examples(self.options.train_split)
        return [train[i] for i in self._train_order().take(n)]

    def test_examples(self, limit: int | None = None) -> list[Example]:
        test = self.examples(self.options.test_split)
        count = len(test) if limit is None else min(limit, len(test))
        return [test[i] for i in shard_of(count, self.process_index, self.process_count)]

    def state(self) -> dict[str, Any]:
        return self._train_order().state()

    def restore(self, state: dict[str, Any]) -> None:
        self._train_order().restore(state)


def preset(name: str, needs_path: bool = False):
    """The task factory of a named preset (`math500`, `aime`, `amc`)."""

    def factory(options: BoxedMathOptions, **placement: int) -> BoxedMathTask:
        if needs_path and not options.path:
            raise UserError(f"task {name} reads its problems from a file: set task.options.path to a "
                            ".jsonl/.parquet file with fields problem, answer and id (see docs/evaluation.md)")
        return BoxedMathTask(options, name=name, **placement)

    return factory
