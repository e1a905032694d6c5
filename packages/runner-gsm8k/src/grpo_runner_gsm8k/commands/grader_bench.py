"""`grpo-bench grader [--data MATH500.jsonl] [--limit N] [--seed S] [--skip-plain]`: how often the
boxed-math grader accepts equivalent answers and refuses wrong ones, next to plain math-verify on
the same pairs.

For each problem, `grader_cases` writes completions: the reference boxed, equivalent rewrites
of it, and wrong answers (a changed number, another problem's answer, hedges inside and after the
box). Plain math-verify is `verify(parse("$reference$"), parse(completion))` with its default
extraction, its own 5 s timeouts (this runs on the main thread). Prints ONE JSON line: the rates
for each grader, the count per kind, and every case a grader got wrong.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Callable

from grpo_runner_gsm8k.commands.grader_cases import Case, cases
from grpo_runner_gsm8k.tasks.grading import TimedVerifier, grade_boxed

DEFAULT_DATA = "../shared/data/math500/test.jsonl"
TIMEOUT_S = 5.0  # as the boxed-math tasks' grading_timeout_s


def plain_math_verify() -> Callable[[str, str], bool]:
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)

    def grade(completion: str, reference: str) -> bool:
        try:
            gold = parse(f"${reference}$", parsing_timeout=int(TIMEOUT_S))
            guess = parse(completion, parsing_timeout=int(TIMEOUT_S))
            return bool(gold and guess and verify(gold, guess, timeout_seconds=int(TIMEOUT_S)))
        except Exception:  # noqa: BLE001 - what math-verify cannot handle counts as refused
            return False

    return grade


def score(found: list[Case], grade: Callable[[str, str], bool]) -> dict:
    """Rates of a grader on the cases: right ones accepted, wrong ones refused, and its misses."""
    start, misses = time.perf_counter(), []
    for case in found:
        if grade(case.completion, case.reference) != case.right:
            misses.append(case._asdict())
    right = sum(c.right for c in found)
    missed_right = sum(m["right"] for m in misses)
    missed_wrong = len(misses) - missed_right
    return {"equivalents_accepted": round(1 - missed_right / right, 5),
            "wrong_rejected": round(1 - missed_wrong / (len(found) - right), 5),
            "equivalents_missed": missed_right, "wrong_accepted": missed_wrong,
            "seconds": round(time.perf_counter() - start, 1), "misses": misses}


def measure(rows: list[dict], seed: int, plain: bool) -> dict:
    """The grader's (and, with `plain`, plain math-verify's) rates on the cases of `rows`."""
    found = cases(rows, seed)
    kinds: dict[str, int] = {}
    for case in found:
        kinds[case.kind] = kinds.get(case.kind, 0) + 1
    verifier = TimedVerifier(TIMEOUT_S)
    verifier.verify("1", "1")  # starts the worker outside the timed part
    result = {"bench": "grader", "problems": len(rows), "seed": seed, "equivalent_cases": sum(c.right for c in found),
              "wrong_cases": sum(not c.right for c in found), "kinds": kinds,
              "grader": score(found, lambda c, r: grade_boxed(verifier, c, r).correct)}
    result["grader"]["timeouts"] = verifier.timeouts
    verifier.close()
    if plain:
        result["math_verify"] = score(found, plain_math_verify())
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpo-bench grader", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=DEFAULT_DATA, help="MATH-style JSONL (problem, answer)")
    parser.add_argument("--limit", type=int, default=None, help="the first N problems only")
    parser.add_argument("--seed", type=int, default=0, help="seed of the case generator")
    parser.add_argument("--skip-plain", action="store_true", help="do not grade with plain math-verify")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    path = Path(args.data)
    if not path.is_file():
        print(f"grpo-bench grader: error: --data {path} is not a file; pass the MATH-500 test.jsonl", file=sys.stderr)
        return 2
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    print(json.dumps(measure(rows[: args.limit], args.seed, not args.skip_plain)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
