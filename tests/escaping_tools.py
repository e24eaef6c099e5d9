"""Tools for tests/test_sandbox.py that reach past their call: processes that outlive it, a forged
reply, a lifted CPU limit, a signal to the run, a file beside it, the network. Each child names
itself `tag` (its /proc comm) so that the test can look for it afterwards."""
import ctypes
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time


def _name(tag):
    ctypes.CDLL(None).prctl(15, tag.encode(), 0, 0, 0)          # PR_SET_NAME


def forks(tag: str, n: int) -> str:
    """Start n children that leave the process group (setsid) and sleep; return once each has
    taken its name.

    Args:
        tag: the children's name
        n: how many
    """
    named_r, named_w = os.pipe()
    for _ in range(n):
        if os.fork() == 0:
            os.setsid()
            _name(tag)
            os.write(named_w, b"x")
            time.sleep(120)
            os._exit(0)
    for _ in range(n):
        os.read(named_r, 1)
    return "forked"


def forks_and_burns(tag: str, n: int, seconds: float) -> str:
    """forks, then burns: a call in flight with its children alive.

    Args:
        tag: the children's name
        n: how many
        seconds: the CPU time to use
    """
    forks(tag, n)
    return burns(seconds)


def steals(x: int) -> str:
    """Fork a child that reads the next request on the worker's request pipe and answers it with
    its id.

    Args:
        x: unused
    """
    if os.fork() == 0:
        line = os.read(int(sys.argv[3]), 1 << 16).split(b"\n")[0]
        rid = json.loads(line)["id"]
        os.write(int(sys.argv[4]), json.dumps({"ok": "STOLEN", "id": rid}).encode() + b"\n")
        os._exit(0)
    return "stealing"


def spawns(tag: str) -> str:
    """Start a program in a session of its own.

    Args:
        tag: its name
    """
    subprocess.Popen([sys.executable, "-c", f"import ctypes, time; ctypes.CDLL(None).prctl("
                      f"15, b'{tag}', 0, 0, 0); time.sleep(120)"], start_new_session=True)
    return "spawned"


def bomb(tag: str, doublings: int) -> str:
    """A bounded fork bomb: every process forks `doublings` times, then all sleep.

    Args:
        tag: the processes' name
        doublings: how many times
    """
    for _ in range(doublings):
        os.fork()
    _name(tag)
    time.sleep(120)
    return "never"


def spins(tag: str) -> str:
    """Start a child that ignores SIGXCPU, lifts its CPU limit as far as it may, and spins.

    Args:
        tag: the child's name
    """
    if os.fork() == 0:
        _name(tag)
        signal.signal(signal.SIGXCPU, signal.SIG_IGN)
        try:
            resource.setrlimit(resource.RLIMIT_CPU, (resource.RLIM_INFINITY,) * 2)
        except (ValueError, OSError):
            hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
            resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))
        while True:
            pass
    return "spinning"


def lifts(x: int) -> str:
    """Lift its own CPU limit: 'lifted' or why not.

    Args:
        x: unused
    """
    try:
        resource.setrlimit(resource.RLIMIT_CPU, (resource.RLIM_INFINITY,) * 2)
        return "lifted"
    except (ValueError, OSError) as e:
        return f"refused ({e})"


def returns_twice(x: int) -> str:
    """Fork; both processes return.

    Args:
        x: a number
    """
    return f"child {x}" if os.fork() == 0 else f"parent {x}"


def forges(x: int) -> str:
    """Write a reply line of its own on the worker's reply pipe, then return.

    Args:
        x: a number
    """
    os.write(int(sys.argv[4]), b'{"ok": "FORGED"}\n')
    return f"real {x}"


def burns(seconds: float) -> str:
    """Use `seconds` of CPU time.

    Args:
        seconds: how long
    """
    start = time.process_time()
    while time.process_time() - start < seconds:
        pass
    return "burnt"


def signals(pid: int, name: str) -> str:
    """Send a signal to a process.

    Args:
        pid: the process
        name: the signal, e.g. SIGKILL
    """
    os.kill(pid, getattr(signal, name))
    return "sent"


def writes(path: str) -> str:
    """Write a file; its absolute path.

    Args:
        path: where
    """
    with open(path, "w") as f:
        f.write("a tool was here")
    return os.path.abspath(path)


def connects(port: int) -> str:
    """Connect to 127.0.0.1.

    Args:
        port: the port
    """
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    return "connected"


def sees(x: int) -> str:
    """How many processes its /proc shows.

    Args:
        x: unused
    """
    return str(sum(entry.isdigit() for entry in os.listdir("/proc")))


def budget(x: int) -> str:
    """The CPU seconds its limit leaves it.

    Args:
        x: unused
    """
    used = resource.getrusage(resource.RUSAGE_SELF)
    return str(resource.getrlimit(resource.RLIMIT_CPU)[0] - used.ru_utime - used.ru_stime)


def to_parent(name: str) -> str:
    """Send a signal to its parent process.

    Args:
        name: the signal, e.g. SIGKILL
    """
    os.kill(os.getppid(), getattr(signal, name))
    return "sent"


def kills_group(tag: str) -> str:
    """Write a file named `tag` in its folder, then SIGKILL its own process group.

    Args:
        tag: the file's name
    """
    with open(tag, "w") as f:
        f.write("left behind?")
    os.kill(0, signal.SIGKILL)
    return "survived"


def environment(x: int) -> str:
    """Its environment's names, comma-separated.

    Args:
        x: unused
    """
    return ",".join(sorted(os.environ))


def temp_file(x: int) -> str:
    """Make a temporary file; its path.

    Args:
        x: unused
    """
    import tempfile
    fd, path = tempfile.mkstemp()
    os.close(fd)
    return path


def holds_on(seconds: float) -> str:
    """Ignore SIGXCPU (the soft CPU limit) and use `seconds` of CPU time.

    Args:
        seconds: how long
    """
    signal.signal(signal.SIGXCPU, signal.SIG_IGN)
    return burns(seconds)


def terms_itself(x: int) -> str:
    """Send SIGTERM to its own process (what a library's cleanup may do), then return.

    Args:
        x: unused
    """
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)
    return "alive"
