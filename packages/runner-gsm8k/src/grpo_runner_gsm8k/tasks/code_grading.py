"""The `code` grader: a completion's program runs against the example's tests in the python
tool's sandbox (`grpo_tools.sandbox`), one sandbox per completion with all of its tests inside.

The program is the completion's last fenced ```python block, or the whole text when it has
none. The reference is the JSON of `code_reference`: the tests (Python snippets that call the
entry points, e.g. `assert add3(1) == 4`), the setup they need, the entry-point names, and an
optional prefix put before a program that does not define the first entry point (HumanEval's
prompt, for a completion that only writes the body). Inside the sandbox `code_harness` runs
each test with a per-test limit, under a limit for the whole program, and reports one
verdict per test on a channel the program cannot reach (see `code_harness`). Completions are
graded concurrently, one thread per usable core.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple, Sequence

from grpo_core.config import setting
from grpo_tools.sandbox import SandboxLimits, SandboxResult, run_python

HARNESS = Path(__file__).with_name("code_harness.py")
OUTCOMES = ("pass", "fail", "error", "timeout", "crash", "syntax")  # worst last wins a program's outcome
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
HARNESS_SECONDS = 2.0  # the sandbox's wall clock beyond the program's limit: the harness's own start


def code_reference(tests: Sequence[str], entry_points: Sequence[str] | str, setup: str = "",
                   prefix: str = "") -> str:
    """The reference string of a code example (what `Example.answer` holds)."""
    names = [entry_points] if isinstance(entry_points, str) else list(entry_points)
    return json.dumps({"tests": list(tests), "entry_points": names, "setup": setup, "prefix": prefix})


def read_reference(reference: str) -> dict:
    """The parsed reference; a ValueError in one line when it is not one `code_reference` wrote."""
    try:
        spec = json.loads(reference)
    except ValueError:
        spec = None
    if not isinstance(spec, dict) or not isinstance(spec.get("tests"), list) or not spec.get("entry_points"):
        raise ValueError(f"code reference {reference[:80]!r} is not JSON with 'tests' and 'entry_points'; "
                         "build it with grpo_runner_gsm8k.tasks.code_grading.code_reference")
    return {"setup": "", "prefix": "", **spec}


def program_of(completion: str, spec: dict) -> str:
    """The last fenced python block (else the whole text), after the reference's prefix when it
    does not define the first entry point itself."""
    blocks = _FENCE.findall(completion)
    program = blocks[-1] if blocks else completion
    defines = re.search(rf"^\s*(?:async\s+)?def\s+{re.escape(spec['entry_points'][0])}\s*\(", program, re.MULTILINE)
    return program if defines or not spec["prefix"] else spec["prefix"] + program


@dataclass(frozen=True)
class CodeOptions:
    """Options of the `code` grader and reward."""

    score: Literal["all", "fraction"] = setting(
        "all", "all = 1 only when every test passes; fraction = the share of tests that pass.")
    # 5 s per test: the generated and HumanEval tests take milliseconds; a slower one is a loop that does not end.
    test_seconds: float = setting(5.0, "Wall-clock limit of one test (the program's start included).", gt=0.0)
    program_seconds: float = setting(20.0, "Wall-clock limit of all of a program's tests together.", gt=0.0)
    memory_mib: int = setting(512, "Memory of one sandbox (all of its processes).", ge=64)
    workers: int = setting(0, "Sandboxes run at once; 0 = the cores this process may use.", ge=0)
    max_program_chars: int = setting(20_000, "A longer program is not run and fails (reason 'too_long').", ge=1)
    cache_size: int = setting(
        0, "Verdicts kept for programs graded before (same program and reference; timeouts and crashes are "
        "not kept): right when programs are deterministic, as the generated ones are; 0 = none.", ge=0)


class CodeVerdict(NamedTuple):
    """One program's result: tests passed of total, its outcome (the worst test verdict, or
    'too_long'), and the first failing test's detail."""

    passed: int
    total: int
    outcome: str
    detail: str
    program: str

    def reward(self, score: str) -> float:
        if score == "fraction":
            return self.passed / self.total if self.total else 0.0
        return float(self.total > 0 and self.passed == self.total)


def _harness_code(spec: dict, program: str, options: CodeOptions) -> str:
    settings = {"program": program, "tests": spec["tests"], "setup": spec["setup"],
                "entry_points": spec["entry_points"], "test_seconds": options.test_seconds,
                "program_seconds": options.program_seconds}
    return HARNESS.read_text() + f"\nrun_all(json.loads({json.dumps(settings)!r}))\n"


def verdicts_of(result: SandboxResult, count: int) -> list[tuple[str, str]]:
    """(verdict, detail) per test from the harness's lines; a test without one failed with the
    sandbox's reason (timeout when the sandbox ran out of time, else crash)."""
    found: dict[int, tuple[str, str]] = {}
    for line in result.output.splitlines():
        if line.startswith("VERDICT "):
            index, verdict, detail = json.loads(line[len("VERDICT "):])
            found.setdefault(index, (verdict, detail))
    missing = ("timeout", "program time limit") if result.timed_out else ("crash", result.stopped_by or "no verdict")
    return [found.get(i, missing) for i in range(count)]


def _worst(verdicts: list[tuple[str, str]]) -> tuple[str, str]:
    return max(verdicts, key=lambda v: OUTCOMES.index(v[0]) if v[0] in OUTCOMES else len(OUTCOMES),
               default=("fail", "no tests"))


def syntax_error(program: str) -> str | None:
    """The compile error's name, or None: compiling runs none of the program, so the trainer
    spares a sandbox for a program that cannot run."""
    try:
        compile(program, "solution.py", "exec", dont_inherit=True)
    except Exception as error:  # SyntaxError, ValueError (NUL bytes), RecursionError, MemoryError
        return type(error).__name__
    return None


class CodeGrader:
    """Grades programs in the sandbox, `workers` at once; identical (program, reference) pairs of
    a batch run once; `last_metrics` describes the last batch."""

    def __init__(self, options: CodeOptions = CodeOptions()):
        self.options = options
        self.limits = SandboxLimits(wall_seconds=options.program_seconds + HARNESS_SECONDS,
                                    cpu_seconds=max(1, int(options.program_seconds) + 1),
                                    memory_bytes=options.memory_mib * 2**20, output_bytes=256 * 2**10)
        self.workers = options.workers or len(os.sched_getaffinity(0))
        self.last_metrics: dict[str, float] = {}
        self.cache: OrderedDict[tuple[str, str], CodeVerdict] = OrderedDict()

    def grade(self, completion: str, reference: str) -> CodeVerdict:
        spec = read_reference(reference)
        return self._run(program_of(completion, spec), spec)

    def _run(self, program: str, spec: dict) -> CodeVerdict:
        total = len(spec["tests"])
        if len(program) > self.options.max_program_chars:
            return CodeVerdict(0, total, "too_long", f"{len(program)} characters", program)
        error = syntax_error(program)
        if error:
            return CodeVerdict(0, total, "syntax", error, program)
        result = run_python(_harness_code(spec, program, self.options), self.limits)
        if result.setup_failed:
            raise RuntimeError(result.output.strip() or "the sandbox did not start")
        verdicts = verdicts_of(result, total)
        passed = sum(v == "pass" for v, _ in verdicts)
        return CodeVerdict(passed, total, *_worst(verdicts), program)

    def grade_many(self, completions: Sequence[str], references: Sequence[str]) -> list[CodeVerdict]:
        start = time.monotonic()
        specs = {reference: read_reference(reference) for reference in references}
        keys = [(program_of(c, specs[r]), r) for c, r in zip(completions, references)]
        todo = [key for key in dict.fromkeys(keys) if key not in self.cache]
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            fresh = dict(zip(todo, pool.map(lambda key: self._run(key[0], specs[key[1]]), todo)))
        verdicts = [fresh[key] if key in fresh else self._cached(key) for key in keys]
        self._keep(fresh)
        self.last_metrics = grading_metrics(verdicts, time.monotonic() - start)
        return verdicts

    def _cached(self, key: tuple[str, str]) -> CodeVerdict:
        self.cache.move_to_end(key)
        return self.cache[key]

    def _keep(self, fresh: dict) -> None:
        for key, verdict in fresh.items():
            if self.options.cache_size and verdict.outcome not in ("timeout", "crash"):
                self.cache[key] = verdict
        while len(self.cache) > self.options.cache_size:
            self.cache.popitem(last=False)


def grading_metrics(verdicts: Sequence[CodeVerdict], seconds: float) -> dict[str, float]:
    """Programs by outcome (pass, fail, error, timeout, crash, syntax, too_long), tests passed
    and run, and the batch's grading seconds."""
    counts = Counter(v.outcome for v in verdicts)
    metrics = {f"programs_{outcome}": float(counts.get(outcome, 0)) for outcome in (*OUTCOMES, "too_long")}
    metrics["tests_passed"] = float(sum(v.passed for v in verdicts))
    metrics["tests_run"] = float(sum(v.total for v in verdicts))
    metrics["grading_seconds"] = seconds
    return metrics
