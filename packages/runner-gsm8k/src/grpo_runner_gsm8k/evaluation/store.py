"""What `grpo-run eval` writes per task, and how a re-run continues from it.

`<out>/<task>/samples.jsonl`: one line per sample, enough to regrade it from the file alone
(task, question id, prompt text, reference answer, sample index, completion, extracted
answer, verdict, tokens, finished; the question's breakdown fields when the task has any; a
multi-turn sample also its conversation, environment information and tool work), appended
chunk by chunk; `settings.json`: what the samples were drawn and graded with (a re-run with
other settings is refused, not mixed in); `summary.json`: the metrics. A re-run reads
samples.jsonl and skips the questions whose n samples are all there; a line cut off by an
interruption is ignored. settings.json and summary.json are replaced atomically (a temporary
file in the same directory, flushed to disk, renamed over the old one), so a kill mid-write
leaves the old file or the new one, never half of one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpo_core.contracts import ConversationText, Example
from grpo_core.errors import UserError

from grpo_runner_gsm8k.evaluation.evaluate import Sample
from grpo_runner_gsm8k.operations.atomic import write_text_atomic

STATE_FILES = ("samples.jsonl", "settings.json", "summary.json")


def read_state(path: Path) -> dict[str, Any]:
    """An eval state file (settings.json, summary.json) as a dict; a corrupt one is a UserError
    that names it and what to do."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"eval state file {path} is corrupt ({type(exc).__name__}: {exc}); delete it (or pass "
                        "--fresh to start that task's eval over)") from None
    if not isinstance(value, dict):
        raise UserError(f"eval state file {path} holds a {type(value).__name__}, not an object; delete it (or "
                        "pass --fresh to start that task's eval over)")
    return value


class SampleStore:
    """The samples of one task's eval in `directory` (created on first write)."""

    def __init__(self, directory: Path, settings: dict[str, Any], writes: bool = True, fresh: bool = False):
        self.directory, self.settings, self.writes = directory, settings, writes
        self.samples_path = directory / "samples.jsonl"
        if fresh and writes:
            self.clear()
        self._check_settings()

    def _check_settings(self) -> None:
        path = self.directory / "settings.json"
        if not path.is_file():
            return
        saved = read_state(path)
        changed = {k: (saved.get(k), v) for k, v in self.settings.items() if saved.get(k) != v}
        if changed:
            detail = ", ".join(f"{k} was {old!r}, now {new!r}" for k, (old, new) in changed.items())
            raise UserError(f"{self.directory} holds samples drawn with other settings ({detail}); pass --fresh to "
                            "start over there, or --out to write elsewhere")

    def done(self, n: int) -> dict[str, list[dict]]:
        """Question id -> its n sample records, for the questions whose samples are all written."""
        by_question: dict[str, dict[int, dict]] = {}
        for record in read_samples(self.samples_path) if self.samples_path.is_file() else ():
            by_question.setdefault(record["id"], {}).setdefault(record["sample"], record)
        return {qid: [samples[i] for i in range(n)] for qid, samples in by_question.items()
                if all(i in samples for i in range(n))}

    def append(self, examples: list[Example], samples: list[list[Sample]],
               fields: list[dict] | None = None) -> list[list[dict]]:
        """Writes the samples of these questions (in order) and returns their records."""
        fields = fields or [{} for _ in examples]
        task = self.settings.get("task")
        records = [[sample_record(task, ex, i, s, f) for i, s in enumerate(question)]
                   for ex, question, f in zip(examples, samples, fields)]
        if self.writes:
            self.directory.mkdir(parents=True, exist_ok=True)
            if not (self.directory / "settings.json").is_file():
                write_text_atomic(self.directory / "settings.json", json.dumps(self.settings, indent=1) + "\n")
            with self.samples_path.open("a", encoding="utf-8") as out:
                if out.tell() and not self.samples_path.read_bytes().endswith(b"\n"):
                    out.write("\n")  # after a line cut off by an interruption
                out.write("".join(json.dumps(r) + "\n" for question in records for r in question))
        return records

    def write_summary(self, summary: dict[str, Any]) -> Path:
        path = self.directory / "summary.json"
        if self.writes:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, json.dumps(summary, indent=1) + "\n")
        return path

    def clear(self) -> None:
        """Forgets earlier samples (--fresh)."""
        for name in STATE_FILES:
            (self.directory / name).unlink(missing_ok=True)


def sample_record(task: str | None, example: Example, index: int, sample: Sample,
                  fields: dict | None = None) -> dict[str, Any]:
    """One line of samples.jsonl; a multi-turn sample adds its whole conversation and its tool work."""
    completion = sample.completion
    record = {"task": task, "id": example.id, "sample": index, "prompt": example.question,
              "reference": example.answer, "completion": str(completion), "answer": sample.answer,
              "correct": bool(sample.correct), "tokens": getattr(completion, "num_tokens", None),
              "max_tokens": getattr(completion, "max_tokens", None), "finished": getattr(completion, "finished", None)}
    if fields:
        record["fields"] = fields
    if isinstance(completion, ConversationText):
        record.update(conversation=completion.conversation, environment=completion.environment)
    if sample.tools is not None:
        record["tools"] = sample.tools
    return record


def read_samples(path: Path) -> list[dict]:
    """The whole records of a samples.jsonl, in file order (a line cut off by an interruption is skipped)."""
    return [record for line in path.read_text(encoding="utf-8").splitlines()
            if (record := _record(line)) is not None]


def _record(line: str) -> dict | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:  # the last line of an interrupted write
        return None
    if not isinstance(record, dict) or not {"id", "sample", "answer", "correct"} <= set(record):
        return None
    return record
