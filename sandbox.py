"""
Untrusted code in a worker process: a downloaded folder's chat template (chat.py) and a user's
--tools function (tools.py) run here, never in the run's own process.

A timer inside a process cannot stop one long C-level operation (a list membership test, `sum` of
a huge range, a regex), and a size check after a value is built comes too late. So each kind of
untrusted code gets one long-lived worker: a fresh Python interpreter that imports only the
module named for it (chat or tools, never torch), under limits on its address space (RLIMIT_AS)
and CPU time (RLIMIT_CPU, set for each request: a worker whose run has died stops by itself).
The run gives each request a deadline; past it the worker is killed, and the next request starts
a new one that first replays what the old one had set up (a compiled template, an imported tool).
Requests and replies are one JSON line each on two pipes of their own; the worker's stdin,
stdout and stderr go nowhere, so a tool that prints cannot write into the run's log, nor one that
reads take a request. Whatever the code does (raise SystemExit, end its process, loop, allocate
past the limit), the run gets the value, or Failed (the code's error, as text), or Timeout, or
Died, never its own end.

    worker = sandbox.worker("chat", 2 ** 30)
    worker.setup("compile", {"key": k, "source": s, ...}, seconds=5)   # replayed after a restart
    worker.request("render", {"key": k, ...}, seconds=5)    # the value, or Failed / Timeout / Died

The worker side: `python sandbox.py MODULE MEMORY REQUEST_FD REPLY_FD` serves MODULE.WORKER_OPS
({name: function}); a function's keyword arguments are a request's "args".
"""
import atexit
import contextlib
import ctypes
import importlib
import json
import os
import resource
import select
import signal
import subprocess
import sys
import time

MAX_REPLY_BYTES = 64 * 2 ** 20     # a reply longer than this kills the worker
STOP_GRACE = 1.0                   # CPU seconds a request gets past its deadline (RLIMIT_CPU)


class Failed(Exception):
    """The untrusted code raised (any BaseException): its type and message, one line."""


class Timeout(Exception):
    """The request ran past its deadline; the worker was killed."""


class Died(Exception):
    """The worker ended during the request (the code exited, or crashed the interpreter)."""


def describe(e):
    """'Type: first line of the message' for any exception, even one whose str() raises."""
    try:
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    except BaseException:                  # a hostile __str__
        why = "(its message cannot be shown)"
    if isinstance(e, MemoryError) and not why:
        why = "past the worker's memory limit"
    return f"{type(e).__name__}: {why}" if why else type(e).__name__


# -----------------------------------------------------------------------------
# The run's side

class Worker:
    """One worker process for `module`'s WORKER_OPS, started on the first request (and again after
    a kill), with `memory` bytes of address space."""

    def __init__(self, module, memory):
        self.module, self.memory = module, memory
        self.proc, self.owner, self.setups = None, None, {}

    def setup(self, op, args, seconds):
        """request(op, args), remembered under args["key"] and replayed, in order, by every new
        worker before its first request."""
        value = self.request(op, args, seconds)
        self.setups[args["key"]] = (op, args, seconds)
        return value

    def request(self, op, args, seconds):
        """The value op(**args) returns in the worker. Failed, Timeout or Died otherwise; on
        Timeout and Died (and on anything that interrupts the wait, a signal's exception) the
        worker is gone, and the next request starts another."""
        if self.proc is None or self.owner != os.getpid() or self.proc.poll() is not None:
            self._start()
        return self._ask(op, args, seconds)

    def _start(self):
        if self.proc is not None and self.owner == os.getpid():
            self.stop()
        request_r, request_w = os.pipe()
        reply_r, reply_w = os.pipe()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        try:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), self.module, str(self.memory),
                 str(request_r), str(reply_w)], pass_fds=(request_r, reply_w),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env=env)
        finally:
            os.close(request_r)
            os.close(reply_w)
        self.owner, self.write_fd, self.read_fd, self.pending = os.getpid(), request_w, reply_r, b""
        for op, args, seconds in list(self.setups.values()):
            self._ask(op, args, seconds)

    def _ask(self, op, args, seconds):
        line = json.dumps({"op": op, "args": args, "seconds": seconds}).encode() + b"\n"
        deadline = time.monotonic() + seconds
        try:
            while line:                    # a long request: written as the worker reads it
                if not select.select([], [self.write_fd], [], self._left(deadline))[1]:
                    raise Timeout
                line = line[os.write(self.write_fd, line[:65536]):]
            chunks = [self.pending]
            while b"\n" not in chunks[-1]:
                if not select.select([self.read_fd], [], [], self._left(deadline))[0]:
                    raise Timeout
                chunk = os.read(self.read_fd, 2 ** 20)
                if not chunk:
                    raise Died(self._ended())
                chunks.append(chunk)
                if sum(map(len, chunks)) > MAX_REPLY_BYTES:
                    raise Died(f"a reply past {MAX_REPLY_BYTES >> 20} MB")
            reply, _, self.pending = b"".join(chunks).partition(b"\n")
            reply = json.loads(reply)
        except BrokenPipeError:
            ended = self._ended()
            self.stop()
            raise Died(ended) from None
        except (Timeout, Died, ValueError, RecursionError) as e:
            ended = self._ended() if isinstance(e, Died) else None
            self.stop()
            if ended and "SIGXCPU" in ended:
                raise Timeout from None    # its CPU limit: the deadline, counted in CPU time
            if isinstance(e, (ValueError, RecursionError)):
                raise Died("a reply that is not JSON") from None
            raise
        except BaseException:              # a signal's exception mid-request: no stale reply
            self.stop()
            raise
        if not isinstance(reply, dict) or not ("ok" in reply or isinstance(reply.get("error"),
                                                                           str)):
            self.stop()
            raise Died("a reply of the wrong form")
        if "error" in reply:
            raise Failed(reply["error"])
        return reply["ok"]

    def _left(self, deadline):
        left = deadline - time.monotonic()
        if left <= 0:
            raise Timeout
        return left

    def _ended(self):
        """How the worker ended: 'exit code N' or 'killed by SIGNAL'."""
        try:
            code = self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return "no reply"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    def stop(self):
        """Kill the worker (at once: it may be in the middle of anything) and close its pipes."""
        if self.proc is None or self.owner != os.getpid():
            self.proc = None
            return
        with contextlib.suppress(OSError):
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5.0)
        for fd in (self.write_fd, self.read_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.proc = None


_WORKERS = {}


def worker(module, memory):
    """This process's worker for `module` (one each, started on its first request)."""
    if module not in _WORKERS:
        _WORKERS[module] = Worker(module, memory)
    return _WORKERS[module]


@atexit.register
def _stop_all():
    for w in _WORKERS.values():
        w.stop()


# -----------------------------------------------------------------------------
# The worker's side

def _die_with_parent():
    """Linux: the kernel kills this worker when the process that started it ends."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)    # PR_SET_PDEATHSIG


def serve(module, memory, request_fd, reply_fd):
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C is the run's to handle
    _die_with_parent()
    parent = os.getppid()
    ops = importlib.import_module(module).WORKER_OPS
    with contextlib.suppress(ValueError, OSError):       # where the system has no such limit
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    requests, replies = os.fdopen(request_fd, "rb"), os.fdopen(reply_fd, "wb")
    for line in requests:
        if os.getppid() != parent:
            break
        try:
            request = json.loads(line)
            used = resource.getrusage(resource.RUSAGE_SELF)
            used = used.ru_utime + used.ru_stime
            soft = int(used + float(request["seconds"]) + STOP_GRACE) + 1
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.RLIM_INFINITY))
            reply = {"ok": ops[request["op"]](**request["args"])}
        except Failed as e:                           # the op's own words
            reply = {"error": str(e)}
        except BaseException as e:                    # SystemExit too: a reply
            reply = {"error": describe(e)}
        try:
            data = json.dumps(reply).encode()
        except BaseException as e:
            data = json.dumps({"error": f"its value cannot be sent ({describe(e)})"}).encode()
        replies.write(data + b"\n")
        replies.flush()
    os._exit(0)                                       # threads a tool started do not hold it


if __name__ == "__main__":
    sys.modules["sandbox"] = sys.modules[__name__]    # chat's and tools' `import sandbox`: this
    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
