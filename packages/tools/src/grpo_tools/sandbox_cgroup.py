"""Memory and process bounds for a python-tool call as a whole: a cgroup made for each call
(cgroup v2 with its memory and pids controllers, else cgroup v1's memory and pids
hierarchies), joined by the sandbox's first process before anything else, so every process
of the call counts in it; removed after the call. Where no cgroup can be made here, the bounds
are per process only (RLIMIT_AS and RLIMIT_NPROC), and `limits_mode` says so in one line.
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import time
import uuid
from dataclasses import dataclass

PROC_CGROUP, MOUNTINFO = "/proc/self/cgroup", "/proc/self/mountinfo"
SWAP_FILES = ("memory.swap.max", "memory.memsw.limit_in_bytes")  # no swap beyond the memory bound
REMOVE_TRIES, REMOVE_PAUSE_SECONDS = 40, 0.05  # the kernel reaps a killed pid namespace shortly after pid 1 exits


@dataclass(frozen=True)
class CgroupLayout:
    """Where this process's cgroups are: one directory for both controllers (v2), or one per
    controller (v1). A call's cgroups are made under them."""

    version: int
    memory_parent: str
    pids_parent: str

    def limit_files(self, memory_bytes: int, tasks: int) -> dict[str, dict[str, str]]:
        """{parent: {file: value}}, in the order they must be written."""
        if self.version == 2:
            return {self.memory_parent: {"memory.max": str(memory_bytes), "memory.swap.max": "0",
                                         "pids.max": str(tasks)}}
        return {self.memory_parent: {"memory.limit_in_bytes": str(memory_bytes),
                                     "memory.memsw.limit_in_bytes": str(memory_bytes)},
                self.pids_parent: {"pids.max": str(tasks)}}


def _cgroup_mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """(mount point, root inside the hierarchy, filesystem type, super options) of each cgroup mount."""
    mounts = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line:
            continue
        after = line.split(" - ", 1)[1].split()
        if len(after) >= 3 and after[0] in ("cgroup", "cgroup2"):
            mounts.append((fields[4], fields[3], after[0], set(after[2].split(","))))
    return mounts


def _directory(mount_point: str, mount_root: str, path: str) -> str | None:
    """This process's cgroup `path` as a directory under the mount, if the mount shows it."""
    if mount_root != "/" and not (path == mount_root or path.startswith(mount_root + "/")):
        return None
    relative = path[len(mount_root):] if mount_root != "/" else path
    return os.path.join(mount_point, relative.lstrip("/"))


def find_layouts(proc_cgroup: str, mountinfo: str) -> list[CgroupLayout]:
    """The layouts worth trying, cgroup v2 first, from /proc/self/cgroup and /proc/self/mountinfo."""
    paths = {}  # controller ("" for v2's unified hierarchy) -> this process's cgroup path
    for line in proc_cgroup.splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if hierarchy != "0" else [""]:
            paths[controller] = path
    found = {}
    for mount_point, root, kind, options in _cgroup_mounts(mountinfo):
        for controller in ([""] if kind == "cgroup2" else sorted({"memory", "pids"} & options)):
            if controller in paths and controller not in found:
                found[controller] = _directory(mount_point, root, paths[controller])
    layouts = []
    if found.get(""):
        layouts.append(CgroupLayout(2, found[""], found[""]))
    if found.get("memory") and found.get("pids"):
        layouts.append(CgroupLayout(1, found["memory"], found["pids"]))
    return layouts


def _read(path: str) -> str:
    try:
        with open(path) as file:
            return file.read()
    except OSError:
        return ""


def _write(path: str, text: str) -> None:
    with open(path, "w") as file:
        file.write(text)


def _enable_v2_controllers(layout: CgroupLayout) -> None:
    """v2 needs memory and pids in the parent's cgroup.subtree_control (EBUSY when the parent
    itself holds processes and is not the root: then this layout cannot be used)."""
    with open(os.path.join(layout.memory_parent, "cgroup.subtree_control")) as file:
        enabled = set(file.read().split())
    if not {"memory", "pids"} <= enabled:
        _write(os.path.join(layout.memory_parent, "cgroup.subtree_control"), "+memory +pids")


class CallCgroups:
    """The cgroups of one call, with its limits written; `procs_files` for the sandbox to join."""

    def __init__(self, layout: CgroupLayout, memory_bytes: int, tasks: int):
        if layout.version == 2:
            _enable_v2_controllers(layout)
        name = f"grpo-sandbox-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.directories = []
        try:
            for parent, files in layout.limit_files(memory_bytes, tasks).items():
                directory = os.path.join(parent, name)
                os.mkdir(directory)
                self.directories.append(directory)
                for file, value in files.items():
                    if file not in SWAP_FILES or os.path.exists(os.path.join(directory, file)):
                        _write(os.path.join(directory, file), value)  # swap files exist only with swap accounting
        except OSError:
            self.remove()
            raise
        self.procs_files = [os.path.join(directory, "cgroup.procs") for directory in self.directories]

    def _kill_left(self, directory: str) -> None:
        """Backstop: the sandbox's processes die with its pid 1; any still listed are killed."""
        with open(os.path.join(directory, "cgroup.procs")) as file:
            for pid in file.read().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def oom_kills(self) -> int:
        """Processes the kernel killed at the call's memory bound (v2 memory.events, v1 memory.oom_control)."""
        for directory in self.directories:
            for name in ("memory.events", "memory.oom_control"):
                for line in _read(os.path.join(directory, name)).splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        return 0

    def remove(self) -> None:
        for directory in self.directories:
            for attempt in range(REMOVE_TRIES):
                try:
                    os.rmdir(directory)
                    break
                except FileNotFoundError:
                    break
                except OSError as error:
                    if error.errno != errno.EBUSY or attempt == REMOVE_TRIES - 1:
                        raise
                    self._kill_left(directory)
                    time.sleep(REMOVE_PAUSE_SECONDS)
        self.directories = []


@functools.cache
def usable_layout() -> tuple[CgroupLayout | None, str]:
    """The first layout in which a call's cgroup can be made and removed here, or None and why not."""
    layouts = find_layouts(_read(PROC_CGROUP), _read(MOUNTINFO))
    reasons = []
    for layout in layouts:
        try:
            CallCgroups(layout, 2**30, 64).remove()
            return layout, ""
        except OSError as error:
            reasons.append(f"cgroup v{layout.version} under {layout.memory_parent}: {error.strerror}")
    return None, "; ".join(reasons) or "no cgroup v2 or v1 memory and pids hierarchy is mounted"


def limits_mode(memory_bytes: int, processes: int) -> str:
    """One line: which bound on memory and processes is in force for a call."""
    layout, reason = usable_layout()
    mib = memory_bytes // 2**20
    if layout is not None:
        return (f"python tool sandbox: {mib} MiB of memory and {processes} processes for each call as a whole "
                f"(cgroup v{layout.version} under {layout.memory_parent})")
    tasks = processes + 2
    return (f"python tool sandbox: no cgroup can be made here ({reason}); memory is bounded per process only: "
            f"{mib} MiB of address space x {tasks} processes = up to {mib * tasks} MiB per call")
