"""The trusted side of the `code` grader: this file's text runs as the sandbox's main program
(standard library only), followed by one call `run_all(<settings>)`.

Why a program cannot forge its verdicts: the verdict lines are written only by this process
(the harness) to its stdout, the sandbox's output file. The model's program never runs here:
for each test the harness forks a child that first points its descriptors 0, 1 and 2 at
/dev/null and closes every other descriptor except its two pipes to the harness, and only
then runs the program. The sandbox has no /proc and no /dev/fd, and its seccomp filter denies
ptrace and process_vm_writev, so the child cannot reopen the output file or write into this
process. The test code (the task's own, trusted) runs here, in the harness, with each entry
point bound to a stand-in that sends the call's arguments to the child and reads back the
`repr` of the result, which the harness accepts only as a Python literal (numbers, strings,
bytes, tuples, lists, dicts, sets, None, booleans, inf and nan): no object of the program's
reaches the test, so an `__eq__` that always says yes cannot pass an assertion either.
A child that kills or stops the harness only loses its remaining tests (no verdict line
is a failure).
"""

import ast
import builtins
import json
import os
import select
import signal
import sys
import time

MAX_REPLY_BYTES = 1 << 20  # a longer reply is not an answer any test expects
PROGRAM_NAME = "solution"  # the program's __name__: its `if __name__ == "__main__":` block does not run


class TestTimeout(BaseException):
    """The test ran past its limit (a BaseException: test code's `except Exception` cannot swallow it)."""


class ProgramDied(BaseException):
    """The child running the program exited or broke its pipe."""


class Unreadable(Exception):
    """A result that is not a Python literal."""


class _Constants(ast.NodeTransformer):
    """inf, nan and set() as literals, any other name or call refused."""

    def visit_Name(self, node):
        if node.id in ("inf", "nan"):
            return ast.Constant(float(node.id))
        raise Unreadable(node.id)

    def visit_Call(self, node):
        if isinstance(node.func, ast.Name) and node.func.id == "set" and not node.args and not node.keywords:
            return ast.Set(elts=[])
        raise Unreadable("a call")


def literal(text):
    """The value of a literal's text (what `repr` writes for plain data)."""
    try:
        return ast.literal_eval(_Constants().visit(ast.parse(text, mode="eval")))
    except Unreadable:
        raise
    except Exception as error:  # SyntaxError, ValueError, RecursionError, MemoryError
        raise Unreadable(type(error).__name__) from None


def _send(stream, message):
    stream.write(json.dumps(message) + "\n")
    stream.flush()


def _serve(program, calls_fd, replies_fd):
    """The child: runs the program, then answers calls of its functions until the pipe closes."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    for fd in range(3, 256):  # RLIMIT_NOFILE is 256 in the sandbox
        if fd not in (calls_fd, replies_fd):
            try:
                os.close(fd)
            except OSError:
                pass
    replies, calls = os.fdopen(replies_fd, "w"), os.fdopen(calls_fd, "r")
    namespace = {"__name__": PROGRAM_NAME}
    try:
        exec(compile(program, "solution.py", "exec"), namespace)
    except BaseException as error:
        _send(replies, {"load_error": type(error).__name__})
        return
    _send(replies, {"ready": True})
    for line in calls:
        _send(replies, _answer(namespace, json.loads(line)))


def _answer(namespace, request):
    function = namespace.get(request["name"])
    if not callable(function):
        return {"missing": request["name"]}
    try:
        value = function(*literal(request["args"]))
        return {"value": repr(value)}
    except BaseException as error:
        return {"raised": type(error).__name__}


class Child:
    """A forked process running the program, called through two pipes."""

    def __init__(self, program):
        calls_r, calls_w = os.pipe()
        replies_r, replies_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(calls_w)
                os.close(replies_r)
                _serve(program, calls_r, replies_w)
            finally:
                os._exit(0)
        os.close(calls_r)
        os.close(replies_w)
        self.pid, self.calls, self.replies, self.pending = pid, calls_w, replies_r, b""

    def reply(self, deadline):
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TestTimeout()
            ready, _, _ = select.select([self.replies], [], [], left)
            if ready:
                chunk = os.read(self.replies, 65536)
                if not chunk or len(self.pending) > MAX_REPLY_BYTES:
                    raise ProgramDied()
                self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            raise ProgramDied() from None

    def call(self, name, args, deadline):
        try:
            os.write(self.calls, (json.dumps({"name": name, "args": repr(args)}) + "\n").encode())
        except OSError:
            raise ProgramDied() from None
        return self.reply(deadline)

    def kill(self):
        for fd in (self.calls, self.replies):
            os.close(fd)
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass
        os.waitpid(self.pid, 0)


def _raised(name):
    """The builtin exception class of that name (so a test may expect a ValueError), else RuntimeError."""
    kind = getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        return kind("raised by the program")
    return RuntimeError(f"the program raised {name}")


def stand_in(child, name, deadline):
    """What the test calls in place of the program's function `name`."""

    def call(*args):
        reply = child.call(name, args, deadline)
        if "value" in reply:
            return literal(reply["value"])
        if "raised" in reply:
            raise _raised(str(reply["raised"]))
        raise NameError(f"the program defines no function {name}")

    return call


def run_test(settings, test, deadline):
    """(verdict, detail) of one test in a fresh child."""
    child = Child(settings["program"])
    try:
        first = child.reply(deadline)
        if "load_error" in first:
            return "error", f"the program raised {first['load_error']} when run"
        namespace = {"__name__": "tests"}
        exec(settings["setup"], namespace)
        for name in settings["entry_points"]:
            namespace[name] = stand_in(child, name, deadline)
        exec(test, namespace)
        return "pass", ""
    except TestTimeout:
        return "timeout", "test time limit"
    except ProgramDied:
        return "crash", "the program's process died"
    except AssertionError:
        return "fail", "assertion failed"
    except Unreadable as error:
        return "error", f"a result is not a plain value ({error})"
    except BaseException as error:
        return "error", f"{type(error).__name__}: {error}"[:200]
    finally:
        child.kill()


def _verdict(index, verdict, detail):
    sys.stdout.write("VERDICT " + json.dumps([index, verdict, detail]) + "\n")
    sys.stdout.flush()


def run_all(settings):
    """One verdict line per test, in order; the program's syntax is checked here (compiling runs nothing)."""
    start = time.monotonic()
    try:
        compile(settings["program"], "solution.py", "exec")
    except BaseException as error:
        for index in range(len(settings["tests"])):
            _verdict(index, "syntax", type(error).__name__)
        return
    for index, test in enumerate(settings["tests"]):
        program_deadline = start + settings["program_seconds"]
        if time.monotonic() >= program_deadline:
            _verdict(index, "timeout", "program time limit")
            continue
        deadline = min(time.monotonic() + settings["test_seconds"], program_deadline)
        _verdict(index, *run_test(settings, test, deadline))
