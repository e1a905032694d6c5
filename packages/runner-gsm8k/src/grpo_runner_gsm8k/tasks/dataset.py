"""The `dataset` task: any JSON/JSONL/parquet file or HF Hub dataset, a prompt template over
its fields (or a field of chat messages), a reference field and a grader by name (any
registered grader plugin, see `graders`), all from the config. Both splits are read, and
every field the options name is checked, when the task is built: before the model loads, a
missing field is one line that lists the dataset's columns.
"""

from __future__ import annotations

import json
import os
import string
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from grpo_core.config import setting
from grpo_core.contracts import Example
from grpo_core.errors import UserError

from grpo_runner_gsm8k.tasks.base import EpochOrder, check_process, shard_of
from grpo_runner_gsm8k.tasks.boxed_math import _rows_of_file
from grpo_runner_gsm8k.tasks.answers import parse_number
from grpo_runner_gsm8k.tasks.code_grading import CodeOptions, read_reference
from grpo_runner_gsm8k.tasks.grading import Graded
from grpo_runner_gsm8k.tasks.graders import make_grader


@dataclass(frozen=True)
class DatasetExample(Example):
    """An example whose prompt is a list of chat messages (`messages_field`), or one user
    message with the task's own system prompt."""

    chat: tuple = ()  # (role, content) pairs: hashable, as a frozen Example is
    system: str = ""

    def messages(self, system_prompt: str | None = None) -> list[dict[str, str]]:
        system = system_prompt or self.system
        turns = [{"role": role, "content": content} for role, content in self.chat]
        turns = turns or [{"role": "user", "content": self.question}]
        has_system = turns[0].get("role") == "system"
        return ([{"role": "system", "content": system}] if system and not has_system else []) + turns


@dataclass(frozen=True)
class DatasetOptions(CodeOptions):
    """Options of the `dataset` task (the code grader's options apply when `grader` is code)."""

    path: str = setting("", "A .json (a list of rows), .jsonl or .parquet file, or a pattern with {split} "
                        "such as data/{split}.jsonl. Empty loads `hub_dataset`.")
    hub_dataset: str = setting("", "HF Hub dataset id (through `datasets`), used when `path` is empty.")
    hub_config: str = setting("", "HF Hub dataset config; empty for the default.")
    train_split: str = setting("train", "Split used for training.")
    test_split: str = setting("test", "Split used for evaluation.")
    prompt: str = setting("{question}", "The user message: a template over the row's fields, e.g. "
                          "'{question}\\n\\nAnswer with a letter.' ({{ and }} for literal braces).")
    messages_field: str = setting("", "A field holding the prompt as chat messages ([{role, content}, ...]); "
                                  "set, it replaces `prompt`.")
    answer_field: str = setting("answer", "The field holding the reference the grader compares with "
                                "(for the code grader: a code_reference JSON string or object).")
    id_field: str = setting("", "A field holding a unique id; empty numbers the rows.")
    system_prompt: str = setting("", "System message when task.system_prompt is null; empty for none.")
    grader: str = setting(
        "exact", "How completions are graded in eval: math (\\boxed{}, math-verify), number, exact (text), "
        "choice (a letter A-J), code (tests run in the sandbox) or any registered grader plugin "
        "(`grpo-run plugins`); see docs/rewards.md.")
    grader_options: dict = setting({}, "Options of the grader, checked by its options dataclass; for code, "
                                   "empty takes the code options of this section.")
    use_chat_template: bool = setting(True, "Render prompts with the tokenizer's chat template.")


def _location(options: DatasetOptions, split: str) -> str:
    path = options.path.format(split=split) if "{split}" in options.path else options.path
    return os.path.expanduser(path)


def _json_rows(path: Path) -> list[tuple[int, Any]]:
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise UserError(f"dataset file {path} is not valid JSON ({exc}); fix it or use JSONL") from None
    if not isinstance(rows, list):
        raise UserError(f"dataset file {path} holds a {type(rows).__name__}, not a list of rows; "
                        "write it as a JSON list or as JSONL")
    return list(enumerate(rows, 1))


def read_split(options: DatasetOptions, split: str) -> tuple[str, list[tuple[int, Any]]]:
    """(where the rows came from, the numbered rows) of one split."""
    if options.path:
        path = Path(_location(options, split))
        if not path.is_file() or path.suffix not in (".json", ".jsonl", ".parquet"):
            raise UserError(f"dataset file {path} (split {split}) is not a .json/.jsonl/.parquet file that exists; "
                            "check task.options.path and the split names")
        return str(path), _json_rows(path) if path.suffix == ".json" else _rows_of_file(path)
    if not options.hub_dataset:
        raise UserError("task dataset has no data: set task.options.path to a .json/.jsonl/.parquet file "
                        "(or task.options.hub_dataset to an HF Hub dataset id)")
    from grpo_runner_gsm8k.tasks.boxed_math import _hub_rows

    return f"{options.hub_dataset} split {split}", list(enumerate(_hub_rows(options, "dataset", split), 1))


def template_fields(template: str) -> list[str]:
    """The field names a prompt template uses ('{question} ({level})' -> question, level)."""
    try:
        return [name for _, name, _, _ in string.Formatter().parse(template) if name]
    except ValueError as exc:
        raise UserError(f"task.options.prompt {template!r} is not a valid template ({exc}); "
                        "write fields as {name} and literal braces as {{ and }}") from None


def needed_fields(options: DatasetOptions) -> list[str]:
    prompt = [options.messages_field] if options.messages_field else template_fields(options.prompt)
    return [*prompt, options.answer_field, *([options.id_field] if options.id_field else [])]


def check_columns(rows: list[tuple[int, Any]], options: DatasetOptions, where: str) -> None:
    """Every field the options name is in every row; else one line listing the columns."""
    for number, row in rows:
        if not isinstance(row, dict):
            raise UserError(f"{where} row {number} is a {type(row).__name__}, not an object; fix or remove it")
        missing = [name for name in needed_fields(options) if row.get(name) is None]
        if missing:
            raise UserError(f"{where} row {number} has no field {missing[0]!r} (columns: {', '.join(sorted(row))}); "
                            f"set task.options.prompt/messages_field/answer_field/id_field to fields it has")


def _chat(row: dict, field: str, where: str) -> tuple:
    turns = row[field]
    if not (isinstance(turns, list) and turns and all(isinstance(t, dict) and {"role", "content"} <= set(t)
                                                      for t in turns)):
        raise UserError(f"{where}: field {field!r} is not a non-empty list of {{role, content}} messages; "
                        "set task.options.messages_field to one that is, or use task.options.prompt")
    return tuple((str(t["role"]), str(t["content"])) for t in turns)


def _reference(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def make_example(row: dict, number: int, split: str, options: DatasetOptions, where: str) -> DatasetExample:
    ident = f"dataset/{split}/{row[options.id_field] if options.id_field else number}"
    if options.messages_field:
        chat = _chat(row, options.messages_field, f"{where} row {number}")
        question = next((content for role, content in reversed(chat) if role == "user"), chat[-1][1])
    else:
        chat, question = (), options.prompt.format_map(row)
    return DatasetExample(question, _reference(row[options.answer_field]), ident, chat, options.system_prompt)


def check_reference(grader: str, reference: str, where: str) -> None:
    """A reference the grader cannot use is refused when the task is built, not mid-run."""
    problem = None
    if grader == "number" and parse_number(reference) is None:
        problem = "is not a number (use grader exact or math for text or LaTeX answers)"
    elif grader == "code":
        try:
            read_reference(reference)
        except ValueError:
            problem = "is not a code reference: JSON with 'tests' and 'entry_points' (see docs/rewards.md)"
    if problem:
        raise UserError(f"{where}: reference {reference[:80]!r} {problem}; fix task.options.answer_field or the data")


def grader_options(options: DatasetOptions) -> Any:
    """The grader's options: `grader_options`, or for the code grader the code options of the task's own."""
    if options.grader == "code" and not options.grader_options:
        return CodeOptions(**{field.name: getattr(options, field.name) for field in fields(CodeOptions)})
    return options.grader_options


class DatasetTask:
    """Rows of any data set graded by a named grader: real epochs over the train split, a fixed test split."""

    name = "dataset"

    def __init__(self, options: DatasetOptions, *, seed: int = 0, process_index: int = 0, process_count: int = 1):
        check_process(process_index, process_count)
        self.grade_many = make_grader(options.grader, grader_options(options))
        self.options, self.use_chat_template = options, options.use_chat_template
        self.process_index, self.process_count = process_index, process_count
        self.splits = {split: self._read(split) for split in dict.fromkeys((options.train_split, options.test_split))}
        self.order = EpochOrder(len(self.splits[options.train_split]), seed, process_index, process_count)

    def _read(self, split: str) -> list[DatasetExample]:
        where, rows = read_split(self.options, split)
        if not rows:
            raise UserError(f"{where} holds no rows; check task.options.path and the split names")
        check_columns(rows, self.options, where)
        examples = [make_example(row, number, split, self.options, where) for number, row in rows]
        for (number, _), example in zip(rows, examples):
            check_reference(self.options.grader, example.answer, f"{where} row {number}")
        return examples

    def train_examples(self) -> list[Example]:
        return list(self.splits[self.options.train_split])

    def train_batch(self, n: int) -> list[Example]:
        train = self.splits[self.options.train_split]
        return [train[i] for i in self.order.take(n)]

    def test_examples(self, limit: int | None = None) -> list[Example]:
        test = self.splits[self.options.test_split]
        count = len(test) if limit is None else min(limit, len(test))
        return [test[i] for i in shard_of(count, self.process_index, self.process_count)]

    def grade(self, completion: str, reference: str) -> Graded:
        return self.grade_many([completion], [reference])[0]

    def state(self) -> dict[str, Any]:
        return self.order.state()

    def restore(self, state: dict[str, Any]) -> None:
        self.order.restore(state)
