"""The `python` tool: runs model-written code in the sandbox of `grpo_tools.sandbox` and
answers with what it printed (stdout and stderr, as the code wrote them)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from grpo_core.multi_turn import ToolError
from grpo_core.errors import UserError
from grpo_tools.sandbox import SandboxLimits, run_python, sandbox_problem
from grpo_tools.sandbox_cgroup import limits_mode


@dataclass(frozen=True)
class PythonOptions:
    """The sandbox's limits for each call (see `grpo_tools.sandbox.SandboxLimits`) and the
    longest code accepted. Defaults fit short computations: a second of CPU is plenty for
    arithmetic, and a call that needs more is usually a loop that does not end."""

    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_mib: int = 512
    processes: int = 16
    output_kib: int = 16
    disk_mib: int = 16
    max_code_chars: int = 20_000

    def limits(self) -> SandboxLimits:
        return SandboxLimits(wall_seconds=self.wall_seconds, cpu_seconds=self.cpu_seconds,
                             memory_bytes=self.memory_mib * 2**20, processes=self.processes,
                             output_bytes=self.output_kib * 2**10, disk_bytes=self.disk_mib * 2**20)


_REPORTED: set[str] = set()


def report_limits_mode(limits: SandboxLimits) -> None:
    """Print which memory bound holds, once per process for each distinct line."""
    line = limits_mode(limits.memory_bytes, limits.processes)
    if line not in _REPORTED:
        _REPORTED.add(line)
        print(line, file=sys.stderr, flush=True)


class PythonTool:
    """A `grpo_core.contracts.Tool`; refuses to be built where the sandbox cannot start. Its first
    call in a process says in one line (stderr) whether the memory and process bounds hold per call
    or per process: at the first call, not when built, so config checks and refusals print only
    their own line."""

    name = "python"
    description = ("Run a Python 3 program in a sandbox (no network, no files but its own, limited time and "
                   "memory) and return what it prints; use print() to see a value.")
    parameters = {"type": "object", "additionalProperties": False, "required": ["code"],
                  "properties": {"code": {"type": "string", "description": "the program, e.g. print(12 * 34)"}}}

    def __init__(self, options: PythonOptions = PythonOptions()):
        self.options, self.sandbox_limits = options, options.limits()
        problem = sandbox_problem(self.sandbox_limits)
        if problem:
            raise UserError(problem)

    def __call__(self, arguments) -> str:
        code = arguments["code"]
        if len(code) > self.options.max_code_chars:
            raise ToolError(f"the code is too long ({len(code)} characters; at most {self.options.max_code_chars})")
        report_limits_mode(self.sandbox_limits)
        result = run_python(code, self.sandbox_limits)
        if result.setup_failed:
            raise RuntimeError(result.output.strip() or "the sandbox did not start")
        notes = []
        if result.stopped_by:
            notes.append(f"stopped: {result.stopped_by}")
        elif result.exit_code:
            notes.append(f"exit status {result.exit_code}")
        text = result.output if result.output.strip() else "(no output)\n"
        if notes and not text.endswith("\n"):
            text += "\n"  # each note on its own line: the ToolRunner keeps such closing notes through its cut
        return text + "".join(f"[{note}]\n" for note in notes)
