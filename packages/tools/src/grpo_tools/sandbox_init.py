"""The first process of a sandbox: `grpo_tools.sandbox` runs this file as a script (standard
library only) with its settings as one JSON argument and the model's code on stdin.

It builds the sandbox's root in a new mount namespace (a root trainer's process builds it
with root's rights, then becomes `nobody`; any other user builds it as uid 0 of a new user
namespace), enters new user, network, pid, IPC and UTS namespaces, chroots into that root
(the system directories and the Python installation read-only, a size-limited tmpfs at
/sandbox), sets the rlimits, drops every capability and runs the code (/sandbox/main.py)
under pid 1 of the new pid namespace. Everything there dies with pid 1, and pid 1 with this
process, so killing this process group ends every process the code started.

It reports on the file descriptor `status_fd` (which the code never holds): "setup" when the
sandbox could not be set up (with one line on stderr), "timeout" when the code ran past its
wall-clock limit, else "exit N", the code's exit status (128 + S when killed by signal S).
"""

import ctypes
import json
import os
import resource
import signal
import sys

SETUP_FAILED = 125
CANNOT_EXECUTE = 127
NOBODY = 65534
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 0x400, 0x800, 0x200000
ST_RELATIME = 0x1000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
CAPABILITY_VERSION_3 = 0x20080522
DEVICES = ("null", "zero", "random", "urandom")
STAGING = "/tmp"  # any directory every uid can reach; mounted over only inside the new namespace

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """A step of building the sandbox failed."""


def _ok(result: int, what: str) -> None:
    if result != 0:
        raise SetupError(f"{what}: {os.strerror(ctypes.get_errno())}")


def _bytes(text):
    return None if text is None else text.encode()


def _mount(source, target, fstype, flags, data=None) -> None:
    result = libc.mount(_bytes(source), _bytes(target), _bytes(fstype), ctypes.c_ulong(flags), _bytes(data))
    _ok(result, f"mount {source or ''} on {target}")


def leave_root() -> None:
    """uid 0 is not counted by RLIMIT_NPROC and owns the trainer's files: run as nobody."""
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
    libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # a uid change clears it, which locks /proc/self/uid_map


def enter_namespaces(flags: int) -> None:
    """New namespaces (`flags`, a user namespace among them) with this uid and gid as 0 inside."""
    uid, gid = os.getuid(), os.getgid()
    _ok(libc.unshare(CLONE_NEWUSER | flags), "unshare (user namespaces)")
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as file:
            file.write(text)


def prepare_root(settings: dict) -> str:
    """The sandbox's root, built in a new mount namespace. Root builds it with its own rights
    (it may bind paths nobody can reach, e.g. a Python under /root) before becoming nobody;
    another user builds it as uid 0 of its new user namespace."""
    others = CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if os.getuid() == 0:
        _ok(libc.unshare(CLONE_NEWNS), "unshare (mount namespace)")
        root = build_root(settings, owner=NOBODY)
        leave_root()
        enter_namespaces(others)
        return root
    enter_namespaces(others | CLONE_NEWNS)
    return build_root(settings, owner=0)


def _locked_flags(path: str) -> int:
    """A remount must keep the flags the original mount was locked with."""
    flags = os.statvfs(path).f_flag
    kept = flags & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)
    return kept | (MS_RELATIME if flags & ST_RELATIME else 0)


def _bind_read_only(source: str, target: str) -> None:
    _mount(source, target, None, MS_BIND | MS_REC)
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _locked_flags(target))


def build_root(settings: dict, owner: int) -> str:
    """A tmpfs root holding the bound directories (read-only), the links, a few devices and
    /sandbox (writable by `owner`, `disk_bytes` at most); the root itself is read-only at the end."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the trainer's namespace
    _mount("tmpfs", STAGING, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path in settings["binds"]:
        os.makedirs(STAGING + path, exist_ok=True)
        _bind_read_only(path, STAGING + path)
    for path, target in settings["links"].items():
        os.symlink(target, STAGING + path)
    os.makedirs(STAGING + "/dev")
    for device in DEVICES:
        open(f"{STAGING}/dev/{device}", "w").close()
        _bind_read_only(f"/dev/{device}", f"{STAGING}/dev/{device}")
    os.symlink("/sandbox", STAGING + "/dev/shm")  # POSIX shared memory (multiprocessing) inside the quota
    os.makedirs(STAGING + "/sandbox")
    disk_bytes = settings["limits"]["disk_bytes"]
    _mount("tmpfs", STAGING + "/sandbox", "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={disk_bytes},mode=0700,uid={owner},gid={owner}")
    _mount(None, STAGING, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    return STAGING


def set_limits(limits: dict) -> None:
    """Per process: CPU seconds, address space, file size (the output file too), open files;
    per sandbox: processes (counted per user namespace, so sandboxes do not share a budget)."""
    cpu = limits["cpu_seconds"]
    for limit, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)),
                         (resource.RLIMIT_AS, (limits["memory_bytes"],) * 2),
                         (resource.RLIMIT_FSIZE, (limits["output_bytes"],) * 2),
                         (resource.RLIMIT_NPROC, (limits["processes"] + 2,) * 2),  # + this process and pid 1
                         (resource.RLIMIT_NOFILE, (256, 256)),
                         (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(limit, value)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_privileges() -> None:
    """No capability now or after any exec (empty bounding set, no_new_privs): the code cannot
    mount, chroot out, change its uid or raise a limit."""
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    for capability in range(64):
        libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0)  # EINVAL past the last one: ignored
    _ok(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    header, data = _CapHeader(CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    _ok(libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset")


def _first_process(python: str) -> int:
    """pid 1 of the new namespace: runs the code as its child (pid 1 itself ignores the
    signals it has no handler for, SIGXCPU among them) and exits with its status."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    environment = {"HOME": "/sandbox", "TMPDIR": "/sandbox", "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    child = os.fork()
    if child == 0:
        try:
            os.execve(python, [python, "-I", "-u", "main.py"], environment)  # -u: stdout and stderr in order
        except OSError as error:
            print(f"sandbox setup failed: cannot run {python}: {error}", file=sys.stderr)
            os._exit(CANNOT_EXECUTE)
    _, status = os.waitpid(child, 0)
    exit_code = os.waitstatus_to_exitcode(status)
    return exit_code if exit_code >= 0 else 128 - exit_code


def run_code(python: str, wall_seconds: float) -> str:
    """/sandbox/main.py under pid 1 of the new pid namespace (everything in it dies with pid 1,
    and pid 1 with this process), killed when the wall-clock limit passes; "timeout" then,
    else "exit N" (128 + S when killed by signal S)."""
    child = os.fork()
    if child == 0:
        os._exit(_first_process(python))
    expired = []
    signal.signal(signal.SIGALRM, lambda *_: (expired.append(True), os.kill(child, signal.SIGKILL)))
    signal.setitimer(signal.ITIMER_REAL, wall_seconds)
    _, status = os.waitpid(child, 0)
    return "timeout" if expired else f"exit {os.waitstatus_to_exitcode(status) % 256}"


def main() -> int:
    settings = json.loads(sys.argv[1])
    status_fd = settings["status_fd"]
    os.set_inheritable(status_fd, False)  # the trainer's channel: closed before the code runs
    code = sys.stdin.read()
    os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
    try:
        os.chroot(prepare_root(settings))
        os.chdir("/sandbox")
        with open("main.py", "w") as file:
            file.write(code)
        set_limits(settings["limits"])
        drop_privileges()
    except (OSError, SetupError) as error:
        print(f"sandbox setup failed: {error}", file=sys.stderr)
        os.write(status_fd, b"setup")
        return SETUP_FAILED
    os.write(status_fd, run_code(settings["python"], settings["limits"]["wall_seconds"]).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
