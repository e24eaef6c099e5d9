"""
Untrusted code in a worker process: a downloaded folder's chat template (hf/chat.py) and a user's
--tools function (hf/tools.py) run here, never in the run's own process.

A timer inside a process cannot stop one long C-level operation (a list membership test, `sum` of
a huge range, a regex), and a size check after a value is built comes too late. So each kind of
untrusted code gets one long-lived worker: a fresh Python interpreter that imports only the
module named for it (chat or tools, never torch), under limits on its address space (RLIMIT_AS)
and CPU time (RLIMIT_CPU: a soft limit for each request, a finite hard one for its life). The run
gives each request a deadline; past it the worker is killed with everything it started, and a new
one is started at once, replaying what the old one had set up (a compiled template, an imported
tool) while the run goes on; a request that finds the replay unfinished waits for it within its
own deadline. Requests and replies are one JSON line each, with an id, on two pipes of their own
(a line the code writes itself is dropped); the worker's stdin, stdout and stderr go nowhere.

The worker is three processes, two of them ours:
    the run -> keeper (its own session: a signal to the run's process group never reaches it)
               -> init (pid 1 of new user, PID, mount and network namespaces)
                  -> server (the code: it sees no process of the run and no network, its /proc
                     is its own, every file read-only but its working directory, an empty
                     folder of its own)
When the keeper ends, however it ends, init ends and the kernel kills every process in the
namespaces: nothing the code started outlives its worker, nor the call that started it (after
each call the server kills every process there but init and itself). Where the system allows no
namespaces (or with SANDBOX_NAMESPACES=0), the keeper is the server's parent and a child
subreaper, and the same kills reach every process below it, those that left its session too; the
code can then see and signal the run, and write files (the run says so).
Whatever the code does (raise SystemExit, end its process, loop, allocate past the limit, fork),
the run gets the value, or Failed (the code's error, as text), or Timeout, or Died, never its own
end. Its environment is ENV_KEPT's variables (and those of --tools_env). It runs as the run's
user and can read any file that user may.

    worker = sandbox.worker("hf.chat", 2 ** 30)
    worker.setup("compile", {"key": k, "source": s, ...}, seconds=5)   # replayed after a restart
    worker.request("render", {"key": k, ...}, seconds=5)    # the value, or Failed / Timeout / Died

The worker side: `python hf/sandbox.py MODULE MEMORY REQUEST_FD REPLY_FD RUN_PID CPU_LIFE` serves
MODULE.WORKER_OPS ({name: function}); a function's keyword arguments are a request's "args".
"""
import atexit
import contextlib
import ctypes
import fcntl
import importlib
import json
import os
import re
import resource
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

MAX_REPLY_BYTES = 64 * 2 ** 20     # a reply longer than this kills the worker
STOP_GRACE = 1.0                   # CPU seconds a request gets past its deadline (RLIMIT_CPU)
CPU_LIFE = 300                     # CPU seconds a worker may use in all (the hard RLIMIT_CPU)
START_SECONDS = 10.0               # for the interpreter to start, before the replays' own times
STOP_SECONDS = 2.0                 # for the keeper to clean up at stop(), before SIGKILL

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, \
    0x40000000
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, \
    MS_REC, MS_RELATIME, ST_RELATIME = 1, 2, 4, 8, 32, 1024, 2048, 4096, 0x4000, 1 << 21, 4096
ENV_KEPT = ("PATH", "HOME", "LANG", "LANGUAGE", "TZ", "PYTHONPATH", "PYTHONHOME",
            "LD_LIBRARY_PATH", "SANDBOX_NAMESPACES")    # and LC_*: the worker's environment


class Failed(Exception):
    """The untrusted code raised (any BaseException): its type and message, one line."""


class Timeout(Exception):
    """The request ran past its deadline (the worker was killed), or its worker was still
    setting up again after a restart (the message says what took the time)."""


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
    """One worker for `module`'s WORKER_OPS, started on the first request (and again at once after
    a kill), with `memory` bytes of address space."""

    def __init__(self, module, memory, cpu_life=CPU_LIFE):
        self.module, self.memory, self.cpu_life = module, memory, cpu_life
        self.proc, self.owner, self.setups, self.isolation = None, None, {}, None
        self.cpu, self.replays = 0.0, []
        self.env_names = ()        # the run's environment it keeps besides ENV_KEPT (--tools_env)

    def setup(self, op, args, seconds):
        """request(op, args), remembered under args["key"] and replayed, in order, by every new
        worker before its first request."""
        value = self.request(op, args, seconds)
        self.setups[args["key"]] = (op, args, seconds)
        return value

    def request(self, op, args, seconds):
        """The value op(**args) returns in the worker. Failed, Timeout or Died otherwise; on
        Timeout and Died the worker was killed and another is starting; on anything that
        interrupts the wait (a signal's exception) it is gone, and the next request starts one."""
        deadline = time.monotonic() + seconds
        if (self.proc is None or self.owner != os.getpid() or self.proc.poll() is not None
                or self.cpu + seconds + STOP_GRACE + 1 > self.cpu_life):
            self._start()
        while self.replays:                # a restarted worker's setups, in this deadline
            rid, what, each = self.replays[0]
            try:
                self._reply(rid, min(deadline, self.replay_deadline))
            except Timeout:
                if time.monotonic() < self.replay_deadline:     # ours: the worker keeps on
                    raise Timeout(f"its worker, started again, was still replaying {what} "
                                  f"after {time.monotonic() - self.started:.1f} s") from None
                self._restart()
                raise Died(f"replaying {what} in a new worker took past {each:g} s") from None
            except Failed as e:
                self.stop()
                raise Died(f"replaying {what} in a new worker failed ({e})") from None
            self.replays.pop(0)
        proc = self.proc
        try:
            return self._reply(self._send(op, args, seconds), deadline)
        except Timeout:
            if self.proc is proc:          # not yet restarted (a CPU limit's end was)
                self._restart()
            raise

    def _start(self):
        """A new worker; the setups are sent at once and replayed while the run goes on."""
        self.stop()
        request_r, request_w = os.pipe()
        reply_r, reply_w = os.pipe()
        env = {name: value for name, value in os.environ.items()
               if name in ENV_KEPT or name.startswith("LC_") or name in self.env_names}
        env = {**env, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        try:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), self.module, str(self.memory),
                 str(request_r), str(reply_w), str(os.getpid()), str(self.cpu_life)],
                pass_fds=(request_r, reply_w),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env=env, start_new_session=True)
        finally:
            os.close(request_r)
            os.close(reply_w)
        fcntl.fcntl(request_w, fcntl.F_SETFL, fcntl.fcntl(request_w, fcntl.F_GETFL) | os.O_NONBLOCK)
        self.owner, self.write_fd, self.read_fd = os.getpid(), request_w, reply_r
        self.inbox, self.outbox, self.cpu, self.started = b"", b"", 0.0, time.monotonic()
        self.replays = [(self._send(op, args, seconds), f"{op} {key}" if len(key) < 40 else op,
                         seconds) for key, (op, args, seconds) in self.setups.items()]
        self.replay_deadline = self.started + START_SECONDS + sum(s for *_, s in self.replays)

    def _restart(self):
        self.stop()
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            self._start()

    def _send(self, op, args, seconds):
        """Queue one request line (written as the worker reads it); its id."""
        rid = secrets.randbits(62)
        self.outbox += json.dumps({"id": rid, "op": op, "args": args,
                                   "seconds": seconds}).encode() + b"\n"
        with contextlib.suppress(BlockingIOError, BrokenPipeError):
            self.outbox = self.outbox[os.write(self.write_fd, self.outbox):]
        return rid

    def _reply(self, rid, deadline):
        """The reply to request `rid`: its value, or raise. Lines with another id are dropped."""
        try:
            while True:
                while b"\n" not in self.inbox:
                    left = deadline - time.monotonic()
                    readable, writable, _ = select.select(
                        [self.read_fd], [self.write_fd] if self.outbox else [], [], max(left, 0))
                    if not readable and not writable:
                        raise Timeout
                    if writable:
                        with contextlib.suppress(BlockingIOError):
                            self.outbox = self.outbox[os.write(self.write_fd, self.outbox):]
                    if readable:
                        chunk = os.read(self.read_fd, 2 ** 20)
                        if not chunk:
                            raise Died(self._ended())
                        self.inbox += chunk
                        if len(self.inbox) > MAX_REPLY_BYTES:
                            raise Died(f"a reply past {MAX_REPLY_BYTES >> 20} MB")
                line, _, self.inbox = self.inbox.partition(b"\n")
                reply = json.loads(line)
                if isinstance(reply, dict) and reply.get("id") == rid:
                    break
        except BrokenPipeError:
            ended = self._ended()
            self._restart()
            raise Died(ended) from None
        except (Died, ValueError, RecursionError) as e:
            ended = self._ended() if isinstance(e, Died) else None
            self._restart()
            if ended and "SIGXCPU" in ended:
                raise Timeout from None    # its CPU limit: the deadline, counted in CPU time
            if isinstance(e, (ValueError, RecursionError)):
                raise Died("a reply that is not JSON") from None
            raise
        except Timeout:
            raise                          # the caller's to decide: kill, or wait on a replay
        except BaseException:              # a signal's exception mid-request: no stale reply
            self.stop()
            raise
        if not ("ok" in reply or isinstance(reply.get("error"), str)):
            self._restart()
            raise Died("a reply of the wrong form")
        if isinstance(reply.get("cpu"), (int, float)):
            self.cpu = reply["cpu"]
        if isinstance(reply.get("isolation"), str):
            self.isolation = reply["isolation"]
        if "error" in reply:
            raise Failed(reply["error"])
        return reply["ok"]

    def _ended(self):
        """How the worker ended: 'exit code N' or 'killed by SIGNAL'."""
        try:
            code = self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            return "no reply"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    def stop(self):
        """Kill the worker and everything it started, and close its pipes: the keeper is asked
        (SIGTERM), then its whole session is killed."""
        if self.proc is None or self.owner != os.getpid():
            self.proc, self.replays = None, []
            return
        with contextlib.suppress(OSError):
            self.proc.terminate()
        waited = time.monotonic() + STOP_SECONDS
        with contextlib.suppress(ChildProcessError):   # ended, not yet reaped: its id still held
            while (not os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                   and time.monotonic() < waited):
                time.sleep(0.002)
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5.0)
        for fd in (self.write_fd, self.read_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.proc, self.replays = None, []


_WORKERS = {}


def worker(module, memory):
    """This process's worker for `module` (one each, started on its first request)."""
    if module not in _WORKERS:
        _WORKERS[module] = Worker(module, memory)
    return _WORKERS[module]


def isolation():
    """What bounds the workers this process has started: one line, or None before any."""
    said = [w.isolation for w in _WORKERS.values() if w.isolation]
    if not said:
        return None
    if said[0].startswith(NAMESPACES):
        files = "; it can write files" if "files writable" in said[0] else \
            ", or write a file but its own"
        return (f"note: a chat template's and a tool's code run in a worker process with its own "
                f"user, PID, mount and network namespaces: it cannot see or signal this run, "
                f"reach the network{files} (docs/errors.md)")
    return (f"note: no namespaces here ({said[0]}): a chat template's and a tool's code run in a "
            f"worker process bounded in memory, time and processes, but it can see and signal "
            f"this run (docs/errors.md)")


@atexit.register
def _stop_all():
    for w in _WORKERS.values():
        w.stop()


# -----------------------------------------------------------------------------
# The worker's side: keeper -> init -> server (module docstring)

NAMESPACES = "namespaces"
_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent(sig):
    """Linux: the kernel sends `sig` to this process when the one that started it ends."""
    with contextlib.suppress(Exception):
        _libc.prctl(PR_SET_PDEATHSIG, sig)


def _unshare():
    """New user, PID, mount and network namespaces for this process's children: NAMESPACES, or
    why not."""
    uid, gid = os.geteuid(), os.getegid()
    if os.environ.get("SANDBOX_NAMESPACES") == "0":
        return "SANDBOX_NAMESPACES=0"
    if _libc.unshare(CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWNET) != 0:
        return f"unshare: {os.strerror(ctypes.get_errno())}"
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                       ("gid_map", f"{gid} {gid} 1")):
        with contextlib.suppress(OSError), open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    return NAMESPACES


def _own_proc():
    """In the new namespaces (init): a /proc of their own processes only, or an empty one; False
    where neither could be mounted (the system's /proc shows every process)."""
    _libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None)          # MS_REC | MS_PRIVATE
    flags = 0x2 | 0x4 | 0x8                                            # nosuid, nodev, noexec
    return (_libc.mount(b"proc", b"/proc", b"proc", flags, None) == 0
            or _libc.mount(b"none", b"/proc", b"tmpfs", flags, None) == 0)


def _read_only(home):
    """In the new mount namespace (init): every mount read-only but `home` (a bind mount of its
    own) and /proc; False where one could not be."""
    if _libc.mount(home.encode(), home.encode(), None, MS_BIND | MS_REC, None) != 0:
        return False
    with open("/proc/self/mountinfo", "rb") as f:          # field 5: the mount point, escaped
        points = [re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), line.split()[4])
                  for line in f]
    done = True
    for point in points:
        if point == home.encode() or point == b"/proc" or point.startswith(b"/proc/"):
            continue
        try:                   # a remount keeps the flags the parent namespace locked
            flag = os.statvfs(point).f_flag
        except OSError:
            done = False
            continue
        keep = flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)
        keep |= MS_RELATIME if flag & ST_RELATIME else 0
        done &= _libc.mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep, None) == 0
    return done


def _descendants(root):
    """Every process below `root`, from /proc (the fallback's cleanup)."""
    children = {}
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            out.append(pid)
            todo.append(pid)
    return out


def _kill_below(root, spare=None):
    """Without namespaces: stop every process below `root` but `spare` until none is new, then
    kill them all and reap this one's (a fork bomb cannot outrun it: a stopped process cannot
    fork; the keeper, a subreaper, reaps the rest)."""
    seen = {spare}
    for _ in range(1000):
        new = set(_descendants(root)) - seen
        if not new:
            break
        for pid in new:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGSTOP)
        seen |= new
    for pid in seen - {spare}:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, 0)[0] > 0:
            pass


def _end_the_calls(isolated, keeper):
    """The server, after each call: what the call started ends with it (a process left running
    could read the next request). In the namespaces, kill(-1) reaches every process there but
    init and this one."""
    if isolated.startswith(NAMESPACES):
        with contextlib.suppress(OSError):
            os.kill(-1, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, 0)[0] > 0:
                pass
    else:
        _kill_below(keeper, spare=os.getpid())


def _reap(server):
    """Wait for `server`, reaping whatever else ends meanwhile; its wait status."""
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == server:
            return status


def keep(module, memory, request_fd, reply_fd, run, cpu_life):
    """The keeper: starts init (or, without namespaces, the server) and cleans up after it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(signal.SIGTERM)
    if os.getppid() != run:                       # the run ended before the line above
        os._exit(0)
    home = tempfile.mkdtemp(prefix="sandbox-")
    isolated = _unshare()
    status_r, status_w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(status_r)
        os.setpgid(0, 0)              # its own group: a tool's kill(0, ...) spares the keeper
        if isolated == NAMESPACES:
            _die_with_parent(signal.SIGKILL)
            isolated += "" if _own_proc() else " (the system's /proc)"
            isolated += "" if _read_only(home) else " (files writable)"
            server = os.fork()
            if server == 0:
                os.close(status_w)
                serve(module, memory, cpu_life, request_fd, reply_fd, home, isolated)
            os.close(request_fd)
            os.close(reply_fd)
            os.write(status_w, str(_reap(server)).encode())
            os._exit(0)                           # pid 1's end: the kernel kills the rest
        os.close(status_w)
        serve(module, memory, cpu_life, request_fd, reply_fd, home, isolated)
    os.close(status_w)
    os.close(request_fd)
    os.close(reply_fd)

    def clean_up(*_):
        if isolated == NAMESPACES:
            with contextlib.suppress(OSError):
                os.kill(child, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child, 0)
        else:
            _kill_below(os.getpid())
        shutil.rmtree(home, ignore_errors=True)
    signal.signal(signal.SIGTERM, lambda *_: (clean_up(), os._exit(1)))
    if isolated == NAMESPACES:
        os.waitpid(child, 0)
        status = int(os.read(status_r, 64) or signal.SIGKILL)   # none: init was killed
    else:
        _die_with_parent(signal.SIGTERM)
        with contextlib.suppress(OSError):
            _libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
        status = _reap(child)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    clean_up()
    if os.WIFSIGNALED(status):                    # the server's end, as the run reads it
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if os.WTERMSIG(status) not in (signal.SIGKILL, signal.SIGSTOP):    # no handler
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def serve(module, memory, cpu_life, request_fd, reply_fd, home, isolated):
    """The server: MODULE's ops for each request line, one reply line each; never returns."""
    for sig in (signal.SIGINT, signal.SIGTERM):   # the run's to handle, and the keeper's
        signal.signal(sig, signal.SIG_IGN)
    _die_with_parent(signal.SIGKILL)
    parent = os.getppid()
    os.chdir(home)
    os.environ["TMPDIR"] = home                       # the one folder it may write in
    tempfile.tempdir = None
    with contextlib.suppress(ValueError, OSError):       # where the system has no such limit
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_life, cpu_life))
    served = os.getpid()
    ops = importlib.import_module(module).WORKER_OPS
    if os.getpid() != served:                     # the module forked at import: not a server
        os._exit(0)
    requests, replies = os.fdopen(request_fd, "rb"), os.fdopen(reply_fd, "wb")
    said = {"isolation": isolated}
    for line in requests:
        if os.getppid() != parent:
            break
        rid = None
        try:
            request = json.loads(line)
            rid = request["id"]
            used = resource.getrusage(resource.RUSAGE_SELF)
            used = used.ru_utime + used.ru_stime
            soft = min(int(used + float(request["seconds"]) + STOP_GRACE) + 1, cpu_life)
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_CPU, (soft, cpu_life))
            reply = {"ok": ops[request["op"]](**request["args"])}
        except Failed as e:                           # the op's own words
            reply = {"error": str(e)}
        except BaseException as e:                    # SystemExit too: a reply
            reply = {"error": describe(e)}
        if os.getpid() != served:                     # a child the code forked returned here
            os._exit(0)
        _end_the_calls(isolated, parent)
        used = resource.getrusage(resource.RUSAGE_SELF)
        try:
            data = json.dumps({**reply, "id": rid, **said,
                               "cpu": used.ru_utime + used.ru_stime}).encode()
        except BaseException as e:
            data = json.dumps({"error": f"its value cannot be sent ({describe(e)})", "id": rid,
                               **said}).encode()
        said = {}
        replies.write(data + b"\n")
        replies.flush()
    os._exit(0)                                       # threads a tool started do not hold it


if __name__ == "__main__":
    # started by path: the root on sys.path (not hf/), and this module chat's and tools' hf.sandbox
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.modules["hf.sandbox"] = sys.modules[__name__]
    keep(sys.argv[1], *map(int, sys.argv[2:7]))
