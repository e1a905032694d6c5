"""The python tool's sandbox, attacked from model-written code: every attempt must fail.

These run as whatever user pytest runs as (CI: root); `test_runs_as_a_non_root_user` also
checks the non-root path when the tests run as root."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from grpo_tools.sandbox import SandboxLimits, run_python, sandbox_problem

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")
LIMITS = SandboxLimits(wall_seconds=5.0, cpu_seconds=3, memory_bytes=256 * 2**20, processes=8,
                       output_bytes=4096, disk_bytes=2**20)


def run(code: str, **changes) -> "SandboxResult":  # noqa: F821 - the name documents the type
    limits = SandboxLimits(**{**LIMITS.__dict__, **changes})
    return run_python(textwrap.dedent(code), limits)


def test_the_sandbox_starts_here():
    assert sandbox_problem() is None


def test_normal_code_returns_its_output():
    result = run("print(sum(range(10)))\nimport sys; print('warn', file=sys.stderr)")
    assert (result.output, result.exit_code, result.timed_out, result.truncated) == ("45\nwarn\n", 0, False, False)


def test_threads_subprocesses_and_multiprocessing_work_inside():
    result = run("""
        import multiprocessing, subprocess, threading
        threading.Thread(target=print, args=("thread",)).start()
        print(subprocess.run(["echo", "subprocess"], capture_output=True, text=True).stdout.strip())
        with multiprocessing.Pool(2) as pool:  # its semaphores live in /dev/shm, which is /sandbox
            print(pool.map(abs, [-1, -2]))
    """, processes=8, wall_seconds=20.0)
    assert result.output == "thread\nsubprocess\n[1, 2]\n", result.output


def test_errors_come_back_as_the_traceback():
    result = run("1 / 0")
    assert result.exit_code == 1 and "ZeroDivisionError: division by zero" in result.output


def test_a_sandbox_that_cannot_be_built_says_why(monkeypatch):
    from grpo_tools import sandbox

    real = sandbox.sandbox_settings
    monkeypatch.setattr(sandbox, "sandbox_settings",
                        lambda limits: {**real(limits), "binds": [*real(limits)["binds"], "/no/such/dir"]})
    result = run("print('never runs')")
    assert result.setup_failed and not result.timed_out
    assert result.output.startswith("sandbox setup failed: mount /no/such/dir on /tmp/no/such/dir: No such file")


@pytest.mark.parametrize("status", [124, 125, 137])
def test_the_code_s_exit_status_cannot_pose_as_the_sandbox_s_report(status):
    result = run(f"import sys; sys.exit({status})")
    assert (result.exit_code, result.timed_out, result.setup_failed) == (status, False, False)


def test_environment_is_empty_and_cwd_is_a_fresh_home(monkeypatch):
    monkeypatch.setenv("GRPO_TEST_SECRET", "do-not-leak")
    result = run("""
        import os
        print(sorted(os.environ), os.getcwd(), os.path.expanduser("~"), os.listdir("."))
        open("left-behind", "w").write("x")
    """)
    assert result.output == "['HOME', 'LANG', 'PATH', 'TMPDIR'] /sandbox /sandbox ['main.py']\n"
    assert "left-behind" not in run("import os; print(os.listdir('.'))").output  # each call starts empty


def test_cannot_connect_to_a_port_on_localhost():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        result = run(f"""
            import socket
            for host in ("127.0.0.1", "localhost", "8.8.8.8"):
                try:
                    socket.create_connection((host, {port}), timeout=2)
                    print("connected", host)
                except OSError as error:
                    print("refused", host, type(error).__name__)
        """)
        listener.settimeout(0.1)
        with pytest.raises(socket.timeout):
            listener.accept()
    assert "connected" not in result.output and result.output.count("refused") == 3


def _visible(paths: list[str]) -> dict:
    """What the sandbox sees at each path: its listing, its text, or the error's name."""
    result = run(f"""
        import json, os
        seen = {{}}
        for path in {paths!r}:
            try:
                seen[path] = sorted(os.listdir(path)) if os.path.isdir(path) else open(path).read()
            except OSError as error:
                seen[path] = type(error).__name__
        print(json.dumps(seen))
    """)
    return json.loads(result.output)


def _on_the_way_to_python(directory: Path) -> set[str]:
    """The entry of `directory` the sandbox needs to reach its Python installation, if any."""
    prefix = Path(os.path.realpath(sys.base_prefix))
    return {prefix.relative_to(directory).parts[0]} if directory in prefix.parents else set()


@pytest.mark.parametrize("target", ["run_dir", "home", "repository"])
def test_cannot_read_the_run_directory_home_or_repository(tmp_path, repo_root, target):
    directory = {"run_dir": tmp_path, "home": Path.home(), "repository": repo_root}[target]
    secret = directory / f"grpo-sandbox-secret-{uuid.uuid4()}"
    secret.write_text("do-not-leak")
    try:
        seen = _visible([str(directory), str(secret), "/etc/passwd", "/proc/1/environ"])
    finally:
        secret.unlink()
    assert "do-not-leak" not in json.dumps(seen)
    assert seen[str(directory)] == "FileNotFoundError" or set(seen[str(directory)]) <= _on_the_way_to_python(directory)
    assert [seen[path] for path in list(seen)[1:]] == ["FileNotFoundError"] * 3


def test_cannot_write_outside_its_directory(tmp_path):
    outside = tmp_path / "escaped"
    result = run(f"""
        for path in ({str(outside)!r}, "/escaped", "/usr/escaped", "/dev/escaped", "/tmp/escaped"):
            try:
                open(path, "w").write("x")
                print("wrote", path)
            except OSError as error:
                print("denied", path, type(error).__name__)
        open("/sandbox/inside", "w").write("fine")
        print("inside", open("/sandbox/inside").read())
    """)
    assert "wrote" not in result.output and result.output.count("denied") == 5, result.output
    assert "inside fine" in result.output and not outside.exists()


def test_its_disk_is_bounded():
    result = run("open('big', 'wb').write(b'x' * 4 * 2**20)", output_bytes=8 * 2**20)
    assert result.exit_code != 0 and "No space left on device" in result.output


FORK_BOMB = """
    import os, time
    started = 0
    try:
        for _ in range(100):
            if os.fork() == 0:
                time.sleep(30)
                os._exit(0)
            started += 1
    except OSError as error:
        print("refused", type(error).__name__)
    print("started", started)
"""


def test_a_fork_bomb_hits_the_process_limit():
    result = run(FORK_BOMB, processes=6)
    assert "refused BlockingIOError" in result.output
    assert int(result.output.split("started")[1]) == 6 - 1  # the interpreter is one of the 6


def test_an_endless_fork_bomb_is_contained_and_killed():
    marker = f"grpo-sandbox-test-{uuid.uuid4()}"
    result = run(f"""
        import os, sys
        if len(sys.argv) == 1:  # mark every process of the bomb, for the check below
            os.execv(sys.executable, [sys.executable, "-I", "-u", "main.py", {marker!r}])
        print("bombing", flush=True)
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """, wall_seconds=4.0, cpu_seconds=60)
    assert result.timed_out and result.output == "bombing\n"
    _assert_gone(marker)


def test_concurrent_sandboxes_have_a_process_budget_each():
    """RLIMIT_NPROC counts per user namespace: sandboxes running at once (all as nobody under a
    root trainer) do not share one budget."""
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: run(FORK_BOMB, processes=6), range(3)))
    assert [int(result.output.split("started")[1]) for result in results] == [5, 5, 5]


def test_allocating_past_the_memory_limit_fails():
    result = run("""
        try:
            block = bytearray(512 * 2**20)
            print("allocated", len(block))
        except MemoryError:
            print("refused")
    """, memory_bytes=128 * 2**20)
    assert result.output == "refused\n"


def test_cpu_time_is_limited():
    result = run("while True: pass", cpu_seconds=1, wall_seconds=60.0)
    assert result.stopped_by == "CPU time limit" and not result.timed_out


def test_output_is_limited():
    result = run("print('x' * 100_000)", output_bytes=1000)
    assert result.truncated and result.stopped_by == "output limit" and len(result.output) <= 1000


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:  # exited while being read
            continue
    return found


def _assert_gone(marker: str) -> None:
    """No process whose command line holds `marker` is left (the kernel kills a pid namespace's
    processes as its pid 1 exits; reaping them may finish just after)."""
    for _ in range(50):
        if not _processes_with(marker):
            return
        time.sleep(0.1)
    assert _processes_with(marker) == []


def test_a_loop_forever_is_killed_with_every_process_it_started():
    marker = f"grpo-sandbox-test-{uuid.uuid4()}"
    result = run(f"""
        import os, sys
        if os.fork() == 0:
            os.setsid()  # leaves the process group: the pid namespace still takes it down
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", {marker!r}])
        print("looping", flush=True)
        while True:
            pass
    """, wall_seconds=4.0, cpu_seconds=60)
    assert result.timed_out and result.stopped_by == "wall-clock limit" and result.output == "looping\n"
    _assert_gone(marker)


def test_cannot_signal_the_trainer():
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: received.append(True))
    try:
        result = run(f"""
            import os, signal
            for target in ({os.getpid()}, -{os.getpgrp()}):
                try:
                    os.kill(target, signal.SIGUSR1)
                    print("sent", target)
                except OSError as error:
                    print("refused", type(error).__name__)
            print("parent", os.getppid())  # pid 1 of its own pid namespace, not the trainer
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(-1, signal.SIGKILL)  # every process it can see: its own
        """)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert received == [] and "sent" not in result.output
    assert result.output.count("refused ProcessLookupError") == 2 and "parent 1\n" in result.output


def test_runs_as_a_non_root_user(repo_root):
    """As root, the same sandbox started by `nobody` (with the system Python, which nobody can
    run) must keep the network (an AF_INET socket: its filter) and the trainer's files out too."""
    python, source = Path("/usr/bin/python3"), repo_root / "packages" / "tools" / "src"
    if os.getuid() != 0 or not shutil.which("setpriv") or not python.exists():
        pytest.skip("needs root, setpriv and /usr/bin/python3 to start a non-root trainer")
    if subprocess.run([str(python), "-c", "import sys; sys.exit(sys.version_info < (3, 9))"]).returncode != 0:
        pytest.skip(f"{python} is older than Python 3.9")
    if subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "test", "-r",
                       str(source / "grpo_tools" / "sandbox.py")]).returncode != 0:
        pytest.skip(f"nobody cannot read {source}")
    script = ("import sys; sys.path.insert(0, %r)\nfrom grpo_tools.sandbox import run_python\n"
              "r = run_python(\"import os, socket\\nprint(os.getuid(), os.listdir('/'))\\n"
              "socket.create_connection(('127.0.0.1', 22), timeout=1)\")\nprint(r.exit_code, r.output)") % str(source)
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(python), "-c", script],
                         capture_output=True, text=True, cwd="/", timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("1 0 [") and "PermissionError: [Errno 1]" in out.stdout, out.stdout
    assert "'work'" not in out.stdout and "'root'" not in out.stdout
