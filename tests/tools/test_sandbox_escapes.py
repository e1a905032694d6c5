"""The python tool's sandbox against attacks that namespaces, chroot and rlimits alone do not
stop: the kernel keyrings, sockets of other families (vsock passes a network namespace),
tracing pid 1, memory spread over several processes, signals to pid 1's process group, and
a hard rlimit the trainer inherited. Every attempt must fail."""

import json
import platform
import subprocess
import sys
import textwrap

import pytest

from grpo_tools import sandbox
from grpo_tools.sandbox import SandboxLimits, run_python
from grpo_tools.sandbox_cgroup import CgroupLayout, find_layouts, usable_layout

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")
LIMITS = SandboxLimits(wall_seconds=10.0, cpu_seconds=5, memory_bytes=256 * 2**20, processes=8,
                       output_bytes=4096, disk_bytes=2**20)
# add_key, keyctl: their numbers on the two architectures the tests run on.
KEY_SYSCALLS = {"x86_64": (248, 250), "aarch64": (217, 219)}
KEYRING_CODE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
ADD_KEY, KEYCTL = {numbers}
SESSION, USER, USER_SESSION = -3, -4, -5  # KEY_SPEC_*_KEYRING
def add(description, keyring):
    key = libc.syscall(ADD_KEY, b"user", description, b"planted", 7, keyring)
    print("add", keyring, "ok" if key >= 0 else os.strerror(ctypes.get_errno()))
def read(description, keyring):
    key = libc.syscall(KEYCTL, 10, keyring, b"user", description, 0)  # KEYCTL_SEARCH
    buffer = ctypes.create_string_buffer(64)
    size = libc.syscall(KEYCTL, 11, ctypes.c_long(key), buffer, 64) if key >= 0 else -1  # KEYCTL_READ
    print("read", keyring, buffer.raw[:size].decode() if size >= 0 else os.strerror(ctypes.get_errno()))
"""


def run(code: str, **changes):
    return run_python(textwrap.dedent(code), SandboxLimits(**{**LIMITS.__dict__, **changes}))


def _key_numbers() -> tuple[int, int]:
    if platform.machine() not in KEY_SYSCALLS:
        pytest.skip(f"no keyring system-call numbers for {platform.machine()}")
    return KEY_SYSCALLS[platform.machine()]


def _in_a_trainer_with_a_session_keyring(script: str) -> list[str]:
    """Runs `script` in a process that joined a session keyring of its own (as a trainer in a
    login session or a container has) and holds a secret key in it; returns its output lines."""
    prelude = KEYRING_CODE.format(numbers=_key_numbers()) + textwrap.dedent("""
        assert libc.syscall(KEYCTL, 1, None) >= 0  # KEYCTL_JOIN_SESSION_KEYRING: a new one
        assert libc.syscall(ADD_KEY, b"user", b"trainer-secret", b"do-not-leak", 11, SESSION) >= 0
        from grpo_tools.sandbox import SandboxLimits, run_python
    """)
    out = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(script)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_cannot_read_a_key_in_the_trainer_s_session_keyring():
    code = KEYRING_CODE.format(numbers=_key_numbers()) + "read(b'trainer-secret', SESSION)\n"
    lines = _in_a_trainer_with_a_session_keyring(f"print(run_python({code!r}).output, end='')")
    assert lines == ["read -3 Operation not permitted"]


def test_the_sandbox_s_session_keyring_is_new_and_empty():
    """The keyring the sandbox joins before its filter goes in (the filter alone would refuse
    the search above too)."""
    lines = _in_a_trainer_with_a_session_keyring("""
        from grpo_tools import sandbox_init
        sandbox_init.join_new_session_keyring(sandbox_init.load_libseccomp(sandbox_init.LIBSECCOMP))
        read(b"trainer-secret", SESSION)
    """)
    assert lines == ["read -3 Required key not available"]


def test_a_key_added_by_one_call_is_not_there_in_the_next():
    numbers = _key_numbers()
    plant = KEYRING_CODE.format(numbers=numbers) + "".join(f"add(b'carried', {k})\n" for k in (-3, -4, -5))
    look = KEYRING_CODE.format(numbers=numbers) + "".join(f"read(b'carried', {k})\n" for k in (-3, -4, -5))
    lines = _in_a_trainer_with_a_session_keyring(f"print(run_python({plant!r}).output + run_python({look!r}).output)")
    assert lines == [f"{verb} {keyring} Operation not permitted" for verb in ("add", "read")
                     for keyring in (-3, -4, -5)] + [""]


def test_only_unix_sockets_can_be_made():
    """No network namespace covers AF_VSOCK (a port bound in the sandbox is bound on the host),
    netlink, packet or crypto sockets: the filter refuses every family but AF_UNIX."""
    result = run("""
        import socket
        kinds = {"AF_INET": "SOCK_STREAM", "AF_INET6": "SOCK_STREAM", "AF_VSOCK": "SOCK_STREAM",
                 "AF_NETLINK": "SOCK_RAW", "AF_PACKET": "SOCK_RAW", "AF_ALG": "SOCK_SEQPACKET"}
        for name, kind in kinds.items():
            try:
                socket.socket(getattr(socket, name), getattr(socket, kind))
                print(name, "made")
            except OSError as error:
                print(name, error.strerror)
        for name in ("AF_INET", "AF_UNIX"):
            try:
                socket.socketpair(getattr(socket, name))
                print("pair", name, "made")
            except OSError as error:
                print("pair", name, error.strerror)
        socket.socket(socket.AF_UNIX).close()
        print("unix made")
    """)
    assert result.output.splitlines() == [
        *(f"{name} Operation not permitted" for name in ("AF_INET", "AF_INET6", "AF_VSOCK", "AF_NETLINK",
                                                         "AF_PACKET", "AF_ALG")),
        "pair AF_INET Operation not permitted", "pair AF_UNIX made", "unix made"], result.output


def test_cannot_trace_or_read_pid_1_or_its_own_child():
    """pid 1 holds the sandbox's side of its report; tracing any process, even the code's own
    child (which the kernel would allow it), is refused."""
    result = run("""
        import ctypes, os, time
        libc = ctypes.CDLL(None, use_errno=True)
        class IoVec(ctypes.Structure):
            _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]
        buffer = ctypes.create_string_buffer(8)
        local = IoVec(ctypes.cast(buffer, ctypes.c_void_p), 8)
        child = os.fork()
        if child == 0:
            time.sleep(30)
        for pid in (1, child, os.getpid()):
            attached = libc.ptrace(16, pid, None, None)  # PTRACE_ATTACH
            print("ptrace", "attached" if attached == 0 else os.strerror(ctypes.get_errno()))
            read = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(local), 1, 0)
            print("process_vm_readv", "read" if read >= 0 else os.strerror(ctypes.get_errno()))
        os.kill(child, 9)
    """)
    assert result.output.splitlines() == ["ptrace Operation not permitted",
                                          "process_vm_readv Operation not permitted"] * 3, result.output


def test_new_namespaces_and_mounts_are_refused():
    """Refused twice over: the filter, and no capability (which alone already refuses these)."""
    result = run("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        for name, call in (("unshare", lambda: libc.unshare(0x10000000)),  # CLONE_NEWUSER
                           ("mount", lambda: libc.mount(b"none", b"/sandbox", b"tmpfs", 0, None)),
                           ("chroot", lambda: libc.chroot(b"/sandbox"))):
            print(name, os.strerror(ctypes.get_errno()) if call() != 0 else "done")
    """)
    assert result.output.splitlines() == [f"{name} Operation not permitted"
                                          for name in ("unshare", "mount", "chroot")], result.output


def test_risky_kernel_interfaces_are_refused():
    """Each called with arguments the kernel itself would reject otherwise (EFAULT, EINVAL) or,
    for personality, accept: only the filter answers EPERM to all."""
    result = run("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        seccomp = ctypes.CDLL("libseccomp.so.2")  # readable in the sandbox: the numbers of this architecture
        for name, argument in (("bpf", 5), ("perf_event_open", 0), ("userfaultfd", 0), ("io_uring_setup", 1),
                               ("personality", 0x0040000)):  # ADDR_NO_RANDOMIZE
            number = seccomp.seccomp_syscall_resolve_name(name.encode())
            answer = libc.syscall(number, argument, 0, 0, 0, 0)
            print(name, os.strerror(ctypes.get_errno()) if answer == -1 else "done")
    """)
    assert result.output.splitlines() == [f"{name} Operation not permitted" for name in (
        "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "personality")], result.output


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86_64's other ABIs")
@pytest.mark.parametrize("abi", ["x32", "i386"])
def test_system_calls_of_another_abi_kill_the_process(abi):
    """The filter knows x86_64's numbers only: getpid through the x32 bit or `int 0x80` (which
    would dodge every rule above) ends the process with SIGSYS."""
    call = {"x32": "libc.syscall(0x40000000 | 39)",  # x32's getpid
            "i386": "getpid_by_int_0x80()"}[abi]
    result = run(f"""
        import ctypes, mmap
        libc = ctypes.CDLL(None)
        def getpid_by_int_0x80():
            code = bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3])  # mov eax, 20 (i386 getpid); int 0x80; ret
            page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
            page.write(code)
            return ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))()
        print("answered", {call})
    """)
    assert (result.output, result.stopped_by) == ("", "system call of another architecture"), result.output


FIVE_HOLDERS = """
    import os
    reports, report = os.pipe()
    barrier, release = os.pipe()
    children = []
    for _ in range(5):
        pid = os.fork()
        if pid == 0:
            os.close(release)
            block = b"x" * (100 * 2**20)  # written, so every page is charged
            os.write(report, b"1")
            os.close(report)
            os.read(barrier, 1)  # hold it until every process has either allocated or died
            os._exit(0)
        children.append(pid)
    os.close(report)
    while os.read(reports, 8):  # EOF: each child reported and let go, or died
        pass
    os.close(release)
    statuses = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
    print("held at once", statuses.count(0), "killed", statuses.count(-9))
"""


def test_memory_is_bounded_for_all_processes_of_a_call_together():
    """Five processes of 100 MiB each under a 256 MiB bound: with a per-process bound (RLIMIT_AS)
    alone all five hold their blocks at once; the call's cgroup lets at most two."""
    if usable_layout()[0] is None:
        pytest.skip(f"no cgroup can be made here ({usable_layout()[1]}): the bound is per process")
    result = run(FIVE_HOLDERS, memory_bytes=256 * 2**20)
    held, killed = int(result.output.split()[3]), int(result.output.split()[5])
    assert held <= 2 and held + killed == 5 and result.out_of_memory, result.output
    assert (result.exit_code, result.setup_failed) == (0, False)


def test_kill_0_and_signals_to_pid_1_leave_the_report_true():
    """The code's own process group holds only the code: kill(0, SIGKILL) kills the code, and
    the sandbox still reports that (not a failed setup). pid 1 ignores SIGINT and SIGKILL."""
    result = run("""
        import os, signal
        os.kill(1, signal.SIGINT)
        os.kill(1, signal.SIGKILL)
        print("pid 1 still there", flush=True)
        os.kill(0, signal.SIGKILL)
    """)
    assert (result.output, result.exit_code, result.setup_failed, result.timed_out, result.stopped_by) == \
        ("pid 1 still there\n", 137, False, False, "killed")


def test_without_libseccomp_the_sandbox_refuses_in_one_line(monkeypatch):
    real = sandbox.sandbox_settings
    monkeypatch.setattr(sandbox, "sandbox_settings", lambda limits: {**real(limits), "libseccomp": "libnone.so.9"})
    result = run("print('never runs')")
    assert result.setup_failed and result.output.count("\n") == 1, result.output
    assert result.output.startswith("sandbox setup failed: cannot load libnone.so.9 for the system-call filter (")


def test_a_hard_rlimit_below_the_sandbox_s_is_refused_in_one_line():
    """A trainer started with `ulimit -Hn 64`: the sandbox cannot raise it and says so, at
    the tool's start and at a call, in one line rather than a traceback."""
    script = textwrap.dedent("""
        import json, resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        from grpo_tools.sandbox import run_python, sandbox_problem
        result = run_python("print(1)")
        print(json.dumps([sandbox_problem(), result.output, result.setup_failed]))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    problem, output, setup_failed = json.loads(out.stdout)
    line = ("the trainer's hard RLIMIT_NOFILE is 64, below the 256 the python tool's sandbox sets; raise it "
            "where the trainer starts (ulimit, prlimit, systemd Limit*) or lower the python tool's limit")
    assert (problem, output, setup_failed) == (line, f"sandbox setup failed: {line}\n", True)


MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""


def test_cgroup_layouts_are_found_from_proc():
    hybrid = "8:pids:/\n4:memory:/jobs/7\n1:cpu:/\n0::/\n"
    assert find_layouts(hybrid, MOUNTINFO) == [
        CgroupLayout(2, "/sys/fs/cgroup/unified/", "/sys/fs/cgroup/unified/"),
        CgroupLayout(1, "/sys/fs/cgroup/memory/jobs/7", "/sys/fs/cgroup/pids/")]
    unified = "0::/user.slice/trainer.scope\n"
    v2_only = "24 1 0:21 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n"
    assert find_layouts(unified, v2_only) == [CgroupLayout(2, "/sys/fs/cgroup/user.slice/trainer.scope",
                                                           "/sys/fs/cgroup/user.slice/trainer.scope")]
    assert find_layouts("0::/\n", "") == []
