"""The `gsm8k` task: grade-school math word problems with numeric answers.

Rows have the GSM8K fields `question` and `answer`, where `answer` is a worked
solution ending in `#### <final answer>`. Data comes from a local directory or
file pattern (jsonl or parquet) or, when `path` is empty, from the HF Hub.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_core.config import setting
from grpo_core.contracts import Example
from grpo_core.errors import UserError

from grpo_runner_gsm8k.tasks.base import EpochOrder, check_process, check_template, shard_of

DEFAULT_INSTRUCTION = ("Solve the problem step by step. On the last line, write only the final "
                       "answer as a number in the form: #### <number>")


@dataclass(frozen=True)
class Gsm8kOptions:
    """Options of the `gsm8k` task."""

    path: str = setting(
        "", "Local data: a directory holding <split>.jsonl / <split>.parquet (or <split>-*.parquet "
        "shards), or a file pattern with {split}, e.g. data/gsm8k/{split}.jsonl. Empty loads the Hub dataset.")
    hub_dataset: str = setting("openai/gsm8k", "HF Hub dataset id, used when `path` is empty.")
    hub_config: str = setting("main", "HF Hub dataset config, used when `path` is empty.")
    train_split: str = setting("train", "Split used for training.")
    test_split: str = setting("test", "Split used for evaluation.")
    instruction: str = setting(
        DEFAULT_INSTRUCTION, "Appended to each question (after a blank line) to ask for the answer "
        "format the rewards read; empty for none.")
    use_chat_template: bool = setting(
        True, "Render prompts with the tokenizer's chat template (false: the raw question).")

    def __post_init__(self):
        check_template("path", self.path, ("split",))


NUMBER = re.compile(r"-?(?:\d+\.?\d*|\.\d+)")  # "72", "-3", "0.5", "1200" (commas removed)


def final_answer(solution: str) -> str:
    """The reference answer of a GSM8K solution: the text after `####`, without
    thousands commas ("#### 1,200" -> "1200")."""
    if "####" not in solution:
        raise ValueError(f"GSM8K answer has no '####' marker: {solution[-120:]!r}; every answer must end "
                         f"in '#### <number>' (check that the data has the GSM8K 'answer' field)")
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not NUMBER.fullmatch(answer):
        raise ValueError(f"GSM8K answer {answer!r} after '####' is not a number: {solution[-120:]!r}; every answer "
                         "must end in '#### <number>'")
    return answer


# ---------------------------------------------------------------- loading rows


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file; a line that is not UTF-8 or not JSON is a UserError
    naming the file, the line and the byte offset in the file."""
    rows, offset = [], 0
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            row = _parse_jsonl_line(path, number, offset, raw)
            if row is not _BLANK:
                rows.append(row)
            offset += len(raw)
    return rows


_BLANK = object()


def _parse_jsonl_line(path: Path, number: int, offset: int, raw: bytes) -> Any:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}:{number}: byte {offset + exc.start} (0x{raw[exc.start]:02x}) is not UTF-8 text; "
                        "save the file as UTF-8 or remove the line") from None
    if not line.strip():
        return _BLANK
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        byte = offset + len(line[:exc.pos].encode("utf-8"))
        raise UserError(f"{path}:{number} is not valid JSON ({exc.msg} at byte {byte} of the file); fix or remove "
                        "the line") from None
    except RecursionError:
        raise UserError(f"{path}:{number} (byte {offset}) nests JSON too deeply; fix or remove the line") from None


def _read_parquet(paths: list[Path]) -> list[dict[str, Any]]:
    import datasets

    table = datasets.load_dataset("parquet", data_files=[str(p) for p in paths], split="train")
    return table.to_list()


def _split_files(path: str, split: str) -> list[Path]:
    path = os.path.expanduser(path)
    if "{split}" in path:
        return [Path(path.format(split=split))]
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"gsm8k path {path!r} is not a directory; give a directory with {split}.jsonl "
                         f"or a pattern such as 'data/{{split}}.jsonl'")
    for pattern in (f"{split}.jsonl", f"{split}.parquet", f"{split}-*.parquet"):
        found = sorted(folder.glob(pattern))
        if found:
            return found
    present = sorted(p.name for p in folder.iterdir())
    raise ValueError(f"no {split}.jsonl, {split}.parquet or {split}-*.parquet in {folder} "
                     f"(found: {present}); point task.options.path at the GSM8K files")


def _read_local(path: str, split: str) -> list[dict[str, Any]]:
    files = _split_files(path, split)
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"gsm8k {split} file {missing[0]} does not exist; check task.options.path")
    if all(f.suffix == ".jsonl" for f in files):
        return [row for f in files for row in read_jsonl(f)]
    if all(f.suffix == ".parquet" for f in files):
        return _read_parquet(files)
    raise ValueError(f"gsm8k files must be .jsonl or .parquet, got {[f.name for f in files]}")


def _read_hub(dataset: str, config: str, split: str) -> list[dict[str, Any]]:
    import datasets

    return datasets.load_dataset(dataset, config, split=split).to_list()


def _check_row(row: Any, split: str, i: int) -> None:
    if not isinstance(row, dict):
        raise ValueError(f"gsm8k {split} row {i} is a {type(row).__name__}, not an object with 'question' and "
                         "'answer'; fix or remove the row")
    if "question" not in row or "answer" not in row:
        raise ValueError(f"gsm8k {split} row {i} lacks 'question' or 'answer' (fields: {sorted(row)})")
    for name in ("question", "answer"):
        if not isinstance(row[name], str):
            raise ValueError(f"gsm8k {split} row {i}: '{name}' is {type(row[name]).__name__} {row[name]!r:.60}, "
                             "not a string; fix or remove the row")


def _examples(rows: list[Any], split: str, instruction: str) -> list[Example]:
    examples = []
    for i, row in enumerate(rows):
        _check_row(row, split, i)
        try:
            answer = final_answer(row["answer"])
        except ValueError as exc:
            raise ValueError(f"gsm8k {split} row {i}: {exc}") from None
        question = f"{row['question'].strip()}\n\n{instruction}" if instruction else row["question"].strip()
        examples.append(Example(question, answer, f"gsm8k/{split}/{i}"))
    return examples


# ---------------------------------------------------------------- the task


class Gsm8kTask:
    """GSM8K with real epochs over the train split and a fixed test split (see `Task`)."""

    def __init__(self, options: Gsm8kOptions, *, seed: int = 0, process_index: int = 0,
                 process_count: int = 1):
        check_process(process_index, process_count)
        self.options = options
        self.use_chat_template = options.use_chat_template
        self.process_index, self.process_count = process_index, process_count
        self.train = self._load(options.train_split)
        self.order = EpochOrder(len(self.train), seed, process_index, process_count)
        self._test: list[Example] | None = None

    def _load(self, split: str) -> list[Example]:
        options = self.options
        if options.path:
            rows = _read_local(options.path, split)
        else:
            rows = _read_hub(options.hub_dataset, options.hub_config, split)
        if not rows:
            raise ValueError(f"gsm8k {split} split is empty (path={options.path!r}); check the data files")
        return _examples(rows, split, options.instruction)

    def train_batch(self, n: int) -> list[Example]:
        return [self.train[i] for i in self.order.take(n)]

    def train_examples(self) -> list[Example]:
        """The whole train split (so the runner checks every prompt before training)."""
        return list(self.train)

    def test_examples(self, limit: int | None = None) -> list[Example]:
        if self._test is None:
            self._test = self._load(self.options.test_split)
        count = len(self._test) if limit is None else min(limit, len(self._test))
        return [self._test[i] for i in shard_of(count, self.process_index, self.process_count)]

    def state(self) -> dict[str, Any]:
        return self.order.state()

    def restore(self, state: dict[str, Any]) -> None:
        self.order.restore(state)
