"""What `grpo-run eval` writes per task, and how a re-run continues from it.

`<out>/<task>/samples.jsonl`: one line per sample (question id, sample index, completion,
extracted answer, verdict, tokens, finished; a multi-turn sample also its conversation,
environment information and tool work), appended chunk by chunk; `settings.json`: what
the samples were drawn with (a re-run with other settings is refused, not mixed in);
`summary.json`: the metrics. A re-run reads samples.jsonl and skips the questions whose n
samples are all there; a line cut off by an interruption is ignored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpo_core.contracts import ConversationText
from grpo_core.errors import UserError

from grpo_runner_gsm8k.evaluation.evaluate import Sample


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
        saved = json.loads(path.read_text())
        changed = {k: (saved.get(k), v) for k, v in self.settings.items() if saved.get(k) != v}
        if changed:
            detail = ", ".join(f"{k} was {old!r}, now {new!r}" for k, (old, new) in changed.items())
            raise UserError(f"{self.directory} holds samples drawn with other settings ({detail}); pass --fresh to "
                            "start over there, or --out to write elsewhere")

    def done(self, n: int) -> dict[str, list[dict]]:
        """Question id -> its n sample records, for the questions whose samples are all written."""
        by_question: dict[str, dict[int, dict]] = {}
        if self.samples_path.is_file():
            for line in self.samples_path.read_text(encoding="utf-8").splitlines():
                record = _record(line)
                if record is not None:
                    by_question.setdefault(record["id"], {}).setdefault(record["sample"], record)
        return {qid: [samples[i] for i in range(n)] for qid, samples in by_question.items()
                if all(i in samples for i in range(n))}

    def append(self, ids: list[str], samples: list[list[Sample]]) -> list[list[dict]]:
        """Writes the samples of these questions (in order) and returns their records."""
        records = [[sample_record(qid, i, s) for i, s in enumerate(question)] for qid, question in zip(ids, samples)]
        if self.writes:
            self.directory.mkdir(parents=True, exist_ok=True)
            (self.directory / "settings.json").write_text(json.dumps(self.settings, indent=1))
            with self.samples_path.open("a", encoding="utf-8") as out:
                if out.tell() and not self.samples_path.read_bytes().endswith(b"\n"):
                    out.write("\n")  # after a line cut off by an interruption
                out.write("".join(json.dumps(r) + "\n" for question in records for r in question))
        return records

    def write_summary(self, summary: dict[str, Any]) -> Path:
        path = self.directory / "summary.json"
        if self.writes:
            self.directory.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(summary, indent=1) + "\n")
        return path

    def clear(self) -> None:
        """Forgets earlier samples (--fresh)."""
        for name in ("samples.jsonl", "settings.json", "summary.json"):
            (self.directory / name).unlink(missing_ok=True)


def sample_record(question_id: str, index: int, sample: Sample) -> dict[str, Any]:
    """One line of samples.jsonl; a multi-turn sample adds its whole conversation and its tool work."""
    completion = sample.completion
    record = {"id": question_id, "sample": index, "completion": str(completion), "answer": sample.answer,
              "correct": bool(sample.correct), "tokens": getattr(completion, "num_tokens", None),
              "finished": getattr(completion, "finished", None)}
    if isinstance(completion, ConversationText):
        record.update(conversation=completion.conversation, environment=completion.environment)
    if sample.tools is not None:
        record["tools"] = sample.tools
    return record


def _record(line: str) -> dict | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:  # the last line of an interrupted write
        return None
    if not isinstance(record, dict) or not {"id", "sample", "answer", "correct"} <= set(record):
        return None
    return record
