"""`python -m grpo_runner_gsm8k.commands.grader_check MATH500.jsonl`: the boxed answer of each reference
solution graded against its `answer`, by the grader and by math-verify alone; prints one JSON
line per way (right, total, seconds, timeouts, and every miss with its id and both answers)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from grpo_runner_gsm8k.tasks.answers import last_boxed
from grpo_runner_gsm8k.tasks.grading import TimedVerifier


def check(rows: list[dict], grade, verifier: TimedVerifier, name: str) -> dict:
    start, before = time.perf_counter(), verifier.timeouts
    misses = []
    for row in rows:
        boxed = last_boxed(row["solution"])
        if boxed is None or not grade(row["answer"], boxed):
            misses.append({"id": row.get("unique_id"), "answer": row["answer"], "boxed": boxed})
    return {"grader": name, "right": len(rows) - len(misses), "total": len(rows),
            "seconds": round(time.perf_counter() - start, 2), "timeouts": verifier.timeouts - before, "misses": misses}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_file():
        print(f"usage: python -m grpo_runner_gsm8k.commands.grader_check MATH500.jsonl (got {argv})", file=sys.stderr)
        return 2
    rows = [json.loads(line) for line in Path(argv[0]).read_text(encoding="utf-8").splitlines() if line.strip()]
    verifier = TimedVerifier(timeout_s=5.0)
    verifier.verify("1", "1")  # starts the worker outside the timed part
    for name, grade in (("grader", verifier.equal), ("math-verify alone", verifier.verify)):
        print(json.dumps(check(rows, grade, verifier, name)))
    verifier.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
