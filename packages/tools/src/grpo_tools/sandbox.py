"""Runs model-written Python in a sandbox (standard library only, Linux).

Each call starts `sandbox_init.py` in a new session (its own process group) with an empty
environment; that process joins the call's cgroups (when they can be made here, see
`grpo_tools.sandbox_cgroup`) and a new empty session keyring, drops to `nobody` when the
trainer is root, enters new user, mount, network, pid and IPC namespaces, chroots into a
read-only tree of the system directories and the Python installation with a fresh
size-limited tmpfs at /sandbox (cwd and HOME), sets the rlimits, drops every capability and
runs the code in its own process group behind a seccomp filter. The output (stdout and stderr together) goes
to a file the trainer opened, so RLIMIT_FSIZE bounds it. At the wall-clock limit the sandbox
kills its code itself; the trainer kills the whole process group a little later as a backstop.
See docs/tools.md for each guarantee and how it is tested.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path

from grpo_tools.sandbox_cgroup import CallCgroups, usable_layout
from grpo_tools.sandbox_init import rlimit_problem

INIT_SCRIPT = Path(__file__).with_name("sandbox_init.py")
SIGNAL_EXIT = {128 + signal.SIGXFSZ: "output limit", 128 + signal.SIGXCPU: "CPU time limit",
               128 + signal.SIGKILL: "killed", 128 + signal.SIGSYS: "system call of another architecture"}
BACKSTOP_SECONDS = 2.0  # the sandbox enforces the wall clock itself; the trainer waits this much longer
SYSTEM_DIRECTORIES = ("/usr", "/bin", "/lib", "/lib64", "/sbin")


@dataclass(frozen=True)
class SandboxLimits:
    """What one run of code may use. wall_seconds: elapsed time; cpu_seconds: CPU time per
    process; memory_bytes: memory of the whole call (a cgroup, the /sandbox tmpfs included)
    and address space of each process (RLIMIT_AS); processes: tasks the code may have alive
    at once, its interpreter and threads included (per call with a cgroup, and per user
    namespace by RLIMIT_NPROC); output_bytes: stdout and stderr together, and any one file;
    disk_bytes: the /sandbox tmpfs."""

    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_bytes: int = 512 * 2**20
    processes: int = 16
    output_bytes: int = 16 * 2**10
    disk_bytes: int = 16 * 2**20

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"SandboxLimits.{name}={value!r} is invalid: use a positive number.")


@dataclass(frozen=True)
class SandboxResult:
    """output: stdout and stderr as the code wrote them (at most output_bytes, decoded with
    replacement); exit_code: the code's exit status (128 + N when killed by signal N);
    timed_out: stopped at the wall-clock limit; setup_failed: the sandbox never started (the
    reason is the output); truncated: the output reached its limit; seconds: wall clock;
    out_of_memory: the kernel killed a process of the call at its memory bound (cgroup)."""

    output: str
    exit_code: int
    timed_out: bool
    setup_failed: bool
    truncated: bool
    seconds: float
    out_of_memory: bool = False

    @property
    def stopped_by(self) -> str | None:
        """Which limit ended the code, if one did."""
        if self.timed_out:
            return "wall-clock limit"
        if self.truncated:
            return "output limit"
        if self.out_of_memory and self.exit_code == 128 + signal.SIGKILL:
            return "memory limit"
        return SIGNAL_EXIT.get(self.exit_code)


def _python_installation() -> tuple[str, str]:
    """(interpreter, installation directory) of this Python, symlinks (a venv's) resolved."""
    interpreter = os.path.realpath(sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    if not interpreter.startswith(prefix + os.sep):
        interpreter = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    return interpreter, prefix


def sandbox_settings(limits: SandboxLimits) -> dict:
    """What sandbox_init.py is given: directories to bind read-only, links, interpreter, limits."""
    interpreter, prefix = _python_installation()
    binds, links = [], {}
    for path in SYSTEM_DIRECTORIES:
        if os.path.islink(path):
            links[path] = os.readlink(path)
        elif os.path.isdir(path):
            binds.append(path)
    if not any(prefix == bound or prefix.startswith(bound + os.sep) for bound in binds):
        binds.append(prefix)
    return {"binds": binds, "links": links, "python": interpreter, "limits": asdict(limits)}


def _wait(process: subprocess.Popen, code: str, limits: SandboxLimits) -> bool:
    """Feeds the code and waits; True when the backstop had to kill the sandbox."""
    try:
        process.communicate(code.encode(), timeout=limits.wall_seconds + BACKSTOP_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the session's group: every process the code started
        process.wait()
        return True
    except BrokenPipeError:  # the sandbox failed before reading the code; its output says why
        process.wait()
    return False


def _read_output(path: Path, limit: int) -> tuple[str, bool]:
    data = path.read_bytes()[:limit]
    return data.decode("utf-8", errors="replace"), len(data) >= limit


def _start(interpreter: str, settings: dict, output, scratch: str) -> subprocess.Popen:
    return subprocess.Popen([interpreter, "-I", "-S", str(INIT_SCRIPT), json.dumps(settings)], stdin=subprocess.PIPE,
                            stdout=output, stderr=subprocess.STDOUT, env={}, cwd=scratch, start_new_session=True,
                            pass_fds=(settings["status_fd"],))


def _result(status: str, killed: bool, text: str, truncated: bool, seconds: float) -> SandboxResult:
    """From the sandbox's status line ("exit N", "timeout" or "setup"); none at all when the
    backstop killed it, or when it failed before it could say (a setup failure too)."""
    exit_code = int(status.split()[1]) if status.startswith("exit ") else 128 + signal.SIGKILL
    timed_out = status == "timeout" or (killed and not status)
    truncated = truncated or exit_code == 128 + signal.SIGXFSZ
    return SandboxResult(text, exit_code, timed_out, status == "setup" or not (status or killed), truncated, seconds)


def _call_cgroups(limits: SandboxLimits) -> CallCgroups | None:
    """The call's cgroups, where this machine lets the trainer make them (see `limits_mode`)."""
    layout, _ = usable_layout()
    return None if layout is None else CallCgroups(layout, limits.memory_bytes, limits.processes + 2)


def _run(code: str, limits: SandboxLimits, settings: dict) -> tuple:
    """Starts the sandbox and waits for it: (killed by the backstop, output, truncated, seconds)."""
    with tempfile.TemporaryDirectory(prefix="grpo-sandbox-") as scratch:
        output_path = Path(scratch) / "output"
        with open(output_path, "wb") as output:
            start = time.monotonic()
            try:
                process = _start(settings["python"], settings, output, scratch)
            finally:
                os.close(settings["status_fd"])  # the sandbox holds it now: its end alone closes the pipe
            killed = _wait(process, code, limits)
            seconds = time.monotonic() - start
        return (killed, *_read_output(output_path, limits.output_bytes), seconds)


def _run_in(cgroups: CallCgroups | None, code: str, limits: SandboxLimits) -> SandboxResult:
    status_read, status_write = os.pipe()  # the sandbox's own report: the code's exit status cannot fake it
    settings = {**sandbox_settings(limits), "status_fd": status_write,
                "cgroup_procs": cgroups.procs_files if cgroups else []}
    try:
        killed, text, truncated, seconds = _run(code, limits, settings)
        status = os.read(status_read, 64).decode(errors="replace").strip()
    finally:
        os.close(status_read)
    result = _result(status, killed, text, truncated, seconds)
    return dataclasses.replace(result, out_of_memory=bool(cgroups and cgroups.oom_kills()))


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Runs `code` in a fresh sandbox and waits for it (at most about limits.wall_seconds)."""
    cgroups = _call_cgroups(limits)
    try:
        return _run_in(cgroups, code, limits)
    finally:
        if cgroups:
            cgroups.remove()


def sandbox_problem(limits: SandboxLimits = SandboxLimits()) -> str | None:
    """Why the sandbox cannot run with `limits` on this machine (one line with the fix), or None."""
    if not sys.platform.startswith("linux"):
        return f"the python tool's sandbox needs Linux namespaces; this is {sys.platform}"
    problem = rlimit_problem(asdict(limits))
    if problem:
        return problem
    result = run_python("print(6 * 7)", dataclasses.replace(limits, wall_seconds=30.0))
    if result.output.strip() == "42" and result.exit_code == 0 and not result.setup_failed:
        return None
    detail = result.output.strip().splitlines()[-1:] or [f"exit status {result.exit_code}"]
    return (f"the python tool's sandbox does not start here ({detail[0]}); it needs unprivileged user "
            "namespaces (sysctl user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1, no "
            "AppArmor userns restriction) and libseccomp2: enable them or do not offer the python tool")
