"""hf/sandbox.py: the worker process untrusted code runs in. Its uses are tested with them
(tests/test_chat.py: templates; tests/test_tools.py: tools); here what belongs to the worker alone:
nothing it starts outlives it, however the run ends; a reply belongs to its call; the run's signals
are the run's; a restart's replay is counted and named; where namespaces are allowed, the code
cannot see or signal the run, nor reach the network; a request a signal interrupts leaves no stale
reply for the next one. The tools that try: tests/escaping_tools.py."""
import contextlib
import glob
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import ROOT
from hf import sandbox
from hf import tools
from hf.tools import Call, run_call

ESCAPING = ("forks", "spawns", "bomb", "spins", "lifts", "returns_twice", "forges", "burns",
            "budget", "signals", "to_parent", "writes", "connects", "sees", "kills_group", "steals",
            "temp_file", "holds_on", "terms_itself")


def named(tag):
    """The processes whose name (/proc/PID/comm) is `tag`."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{entry}/comm") as f:
            if f.read().strip() == tag:
                out.append(int(entry))
    return out


def below(pid):
    """The pids below `pid` (from /proc: ppid links)."""
    parents = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
    out, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, ppid in parents.items() if ppid in frontier} - out
        out |= frontier
    return out


def cpu_below(pid):
    """CPU seconds used so far by the processes below `pid`."""
    ticks = 0
    for p in below(pid):
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def eventually(condition, seconds=10.0):
    started = time.time()
    while not condition() and time.time() - started < seconds:
        time.sleep(0.02)
    return condition()


@pytest.fixture(params=["namespaces", "process bounds"])
def own_worker(monkeypatch, request):
    """A tools worker of the test's own (its setups are not replayed in other tests' workers), in
    namespaces where the system allows them, and without (SANDBOX_NAMESPACES=0)."""
    if request.param == "process bounds":
        monkeypatch.setenv("SANDBOX_NAMESPACES", "0")
    monkeypatch.setitem(sandbox._WORKERS, "hf.tools", sandbox.Worker("hf.tools", tools.MEMORY))
    yield
    tools._worker().stop()


@pytest.fixture
def escaping(monkeypatch, own_worker):
    monkeypatch.setattr(tools, "RUN_SECONDS", 1.0)
    table = tools.resolve(",".join(f"escaping_tools:{n}" for n in ESCAPING))
    return table, f"esc{os.getpid() % 10 ** 6}"


def test_nothing_a_tool_starts_outlives_its_call(escaping):
    """Children that leave the session, a program in a session of its own, a child that lifts
    its CPU limit and spins: gone when the call that started them returns; a fork bomb's
    processes gone when its call's deadline ends it."""
    table, tag = escaping
    for call, reply in ((Call("forks", {"tag": tag, "n": 4}), "forked"),
                        (Call("spawns", {"tag": tag}), "spawned"),
                        (Call("spins", {"tag": tag}), "spinning")):
        assert run_call(table, call) == (reply, False)
        assert eventually(lambda: named(tag) == []), named(tag)
    text, failed = run_call(table, Call("bomb", {"tag": tag, "doublings": 4}))
    assert failed and "bomb ran past 1 s" in text, text
    assert named(tag) == []


def test_a_tool_that_kills_its_process_group_leaves_no_folder_and_the_next_call_works(escaping):
    """A tool's kill(0, SIGKILL) reaches its own process group, not the keeper: the call is
    answered as ended, the worker's folder (what the tool wrote in it too) is removed, and the next
    call runs in a new worker."""
    table, tag = escaping
    text, failed = run_call(table, Call("kills_group", {"tag": tag}))
    assert failed and "ended its process" in text, text
    left = lambda: glob.glob(os.path.join(tempfile.gettempdir(), "sandbox-*", tag))
    assert eventually(lambda: not left(), 10), left()
    assert run_call(table, Call("burns", {"seconds": 0.0})) == ("burnt", False)


def test_a_tool_that_sends_its_process_sigterm_is_answered_and_the_worker_goes_on(escaping):
    """The run's SIGTERM is the run's to handle: the worker ignores one, whoever sends it."""
    table, _ = escaping
    pid = tools._worker().proc.pid
    assert run_call(table, Call("terms_itself", {"x": 0})) == ("alive", False)
    assert run_call(table, Call("burns", {"seconds": 0.0})) == ("burnt", False)
    assert tools._worker().proc.pid == pid


def test_a_reply_belongs_to_its_call(escaping):
    """A forked child that returns into the worker's loop serves nothing, nor one left to read
    the next request and answer it with its id; a line the code writes on the reply pipe itself
    is dropped."""
    table, _ = escaping
    assert run_call(table, Call("steals", {"x": 0})) == ("stealing", False)
    assert [run_call(table, Call("returns_twice", {"x": i})).text for i in range(3)] == \
        ["parent 0", "parent 1", "parent 2"]
    assert [run_call(table, Call("forges", {"x": i})).text for i in range(3)] == \
        ["real 0", "real 1", "real 2"]


def test_the_cpu_limit_is_each_calls_and_cannot_be_lifted(escaping, monkeypatch):
    """Each call's CPU limit is its own deadline's seconds past what the worker has used; the tool
    cannot lift it. The deadline is far off (30 s), so that a loaded machine's slow burn of 0.3 CPU
    seconds never reaches it: the CPU limit is what is read, never the wall clock."""
    monkeypatch.setattr(tools, "RUN_SECONDS", 30.0)
    table, _ = escaping
    for _ in range(3):                    # the same budget at every call, however much was used
        left = float(run_call(table, Call("budget", {"x": 0})).text)
        assert tools.RUN_SECONDS <= left <= tools.RUN_SECONDS + sandbox.STOP_GRACE + 1, left
        assert run_call(table, Call("burns", {"seconds": 0.3})) == ("burnt", False)
    if tools._worker().isolation.startswith(sandbox.NAMESPACES) or os.geteuid() != 0:
        assert run_call(table, Call("lifts", {"x": 0})).text.startswith("refused"), "lifted"


@pytest.mark.slow
def test_a_workers_life_in_cpu_seconds_is_bounded(monkeypatch, own_worker):
    """A worker of 9 CPU seconds: a call whose budget (its 5 s, the grace, one more) would pass
    what is left starts a new worker first, and no other does; a tool that ignores the soft limit's
    SIGXCPU is killed at the hard one, its CPU seconds never past the life."""
    monkeypatch.setitem(sandbox._WORKERS, "hf.tools", sandbox.Worker("hf.tools", tools.MEMORY,
                                                                     cpu_life=9))
    monkeypatch.setattr(tools, "RUN_SECONDS", 5.0)
    table = tools.resolve("escaping_tools:burns,escaping_tools:holds_on")
    worker, budget, restarts = tools._worker(), 5.0 + sandbox.STOP_GRACE + 1, 0
    for _ in range(6):
        used, pid = worker.cpu, worker.proc.pid
        assert run_call(table, Call("burns", {"seconds": 0.5})) == ("burnt", False)
        assert (worker.proc.pid != pid) == (used + budget > 9), (used, pid, worker.proc.pid)
        restarts += worker.proc.pid != pid
    assert restarts >= 1
    monkeypatch.setattr(tools, "RUN_SECONDS", 30.0)         # the call's own limit past the life
    worker.cpu_life = 3
    worker.stop()
    text, failed = run_call(table, Call("holds_on", {"seconds": 10.0}))
    assert failed and "SIGKILL" in text, text
    assert run_call(table, Call("burns", {"seconds": 0.0})) == ("burnt", False)


def test_the_runs_signals_are_the_runs():
    """A SIGTERM to the run's whole process group (what timeout, Slurm and kill -TERM -PGID send)
    is the run's to handle: the call in flight finishes as it would have."""
    script = ("import signal, sys\nfrom hf import tools, chat\n"
              "signal.signal(signal.SIGTERM, lambda *a: print('SIGTERM', flush=True))\n"
              "tools.RUN_SECONDS = 30.0\n"           # the call's own deadline far off, under load
              "table = tools.resolve('hostile_tools:slow')\n"
              "chat.ChatTemplate('{{ messages[0].content }}', {}, set(), {})\n"
              "print('calling', flush=True)\n"
              "print(tools.run_call(table, tools.Call('slow', {'seconds': 1.5})), flush=True)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}
    run = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                           text=True, env=env, start_new_session=True)
    assert run.stdout.readline() == "calling\n"
    time.sleep(0.3)
    os.killpg(run.pid, signal.SIGTERM)
    out, _ = run.communicate(timeout=30)
    assert out == "SIGTERM\nReply(text='done', failed=False)\n"


@pytest.mark.slow
def test_a_restarts_replay_is_counted_in_the_next_calls_deadline_and_named(tmp_path,
                                                                             monkeypatch,
                                                                             own_worker):
    """After a tool runs past its deadline, the new worker re-imports the tools' modules while the
    run goes on; a call that finds it still importing is answered by its deadline, saying so, the
    import still going on. The import (6 s) is longer than the start's own budget (here 1 s): the
    replay's deadline counts its setups' seconds, so the worker comes back."""
    (tmp_path / "slowimp_tools.py").write_text(
        "import time\ntime.sleep(6)\n\n\ndef hang(x: int) -> str:\n"
        '    """Loop.\n\n    Args:\n        x: unused\n    """\n    while True:\n        pass\n'
        "\n\ndef quick(x: int) -> str:\n"
        '    """Return.\n\n    Args:\n        x: unused\n    """\n    return "quick"\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(tools, "RUN_SECONDS", 0.5)
    monkeypatch.setattr(sandbox, "START_SECONDS", 1.0)
    table = tools.resolve("slowimp_tools:hang,slowimp_tools:quick")
    for call, words in ((Call("hang", {"x": 0}), "error: hang ran past 0.5 s"),
                        (Call("quick", {"x": 0}), "error: quick ran past 0.5 s (its worker, "
                                                  "started again, was still replaying load "
                                                  "slowimp_tools:hang after")):
        text, failed = run_call(table, call)
        assert failed and text.startswith(words), text
        assert tools._worker().replays, text               # not kept waiting for the import
    assert eventually(lambda: run_call(table, Call("quick", {"x": 0})) == ("quick", False), 30)


def test_the_namespaces_the_worker_reports_are_the_ones_the_kernel_shows(escaping):
    """Read from /proc, not from the worker's word: with namespaces, the process that serves the
    call (below the keeper) is in a user, PID, mount and network namespace other than the run's;
    without them (SANDBOX_NAMESPACES=0), in the run's own."""
    table, _ = escaping
    assert run_call(table, Call("burns", {"seconds": 0.0})) == ("burnt", False)
    isolated = tools._worker().isolation.startswith(sandbox.NAMESPACES)
    assert not isolated or os.environ.get("SANDBOX_NAMESPACES") != "0"
    served = below(tools._worker().proc.pid)
    assert served, "no process below the keeper"
    for ns in ("user", "pid", "mnt", "net"):
        mine = os.readlink(f"/proc/self/ns/{ns}")
        theirs = {os.readlink(f"/proc/{p}/ns/{ns}") for p in served}
        assert (mine not in theirs) == isolated, (ns, mine, theirs)


def test_a_tool_cannot_see_or_signal_the_run_write_beside_it_or_reach_the_network(escaping,
                                                                                  tmp_path):
    table, _ = escaping
    isolation = tools._worker().isolation
    if not isolation.startswith(sandbox.NAMESPACES):
        pytest.skip(f"no namespaces ({isolation}): a tool can signal the run")
    if "/proc" not in isolation:                          # its own: init, the server
        assert int(run_call(table, Call("sees", {"x": 0})).text) <= 3
    for name in ("SIGKILL", "SIGSTOP"):
        text, failed = run_call(table, Call("signals", {"pid": os.getpid(), "name": name}))
        assert failed and "ProcessLookupError" in text, text
        assert run_call(table, Call("to_parent", {"name": name})) == ("sent", False)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        text, failed = run_call(table, Call("connects", {"port": server.getsockname()[1]}))
    assert failed and "Network is unreachable" in text, text
    written, failed = run_call(table, Call("writes", {"path": "victim.pt"}))
    assert not failed and os.path.dirname(written) != os.getcwd(), written
    assert not os.path.exists("victim.pt")
    temp, failed = run_call(table, Call("temp_file", {"x": 0}))
    assert not failed and os.path.dirname(temp) == os.path.dirname(written), (temp, written)
    if "files writable" not in isolation:               # every file read-only but its own
        victim = str(tmp_path / "victim.pt")
        text, failed = run_call(table, Call("writes", {"path": victim}))
        assert failed and "Read-only file system" in text, text
        assert not os.path.exists(victim)
    assert run_call(table, Call("burns", {"seconds": 0.0})) == ("burnt", False)   # it goes on
    tools._worker().stop()                                # as at the run's end
    assert not os.path.exists(written)                    # its folder goes with it


def test_the_worker_keeps_only_the_environment_it_is_given(monkeypatch, own_worker):
    """A token in the run's environment is not the tool's; --tools_env passes one by name, and a
    name that is not set is refused in one line."""
    monkeypatch.setenv("MY_SECRET", "s3cret")
    table = tools.resolve("escaping_tools:environment")
    names = run_call(table, Call("environment", {"x": 0})).text.split(",")
    assert "MY_SECRET" not in names and "PATH" in names, names
    tools.keep_environment("MY_SECRET")
    table = tools.resolve("escaping_tools:environment")
    assert "MY_SECRET" in run_call(table, Call("environment", {"x": 0})).text.split(",")
    with pytest.raises(ValueError, match=r"^--tools_env NOT_SET_X: no such variable"):
        tools.keep_environment("NOT_SET_X")


RUN = """
import os, sys, time
from hf import chat, tools
template = chat.ChatTemplate("{{ messages[0]['content'] }}", {}, set(), {})
template.render([{"role": "user", "content": "x"}])
table = tools.resolve("escaping_tools:forks,escaping_tools:forks_and_burns")
print(chat._worker().proc.pid, tools._worker().proc.pid, flush=True)
if sys.argv[2] == "busy":               # killed while the worker computes, not on its pipe
    tools.RUN_SECONDS = 120.0
    tools.run_call(table, tools.Call("forks_and_burns", {"tag": sys.argv[1], "n": 3,
                                                         "seconds": 60}))
else:
    print(tools.run_call(table, tools.Call("forks", {"tag": sys.argv[1], "n": 3})).text,
          flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
@pytest.mark.parametrize("namespaces", ["1", "0"])
@pytest.mark.parametrize("when", ["idle", "busy"])
@pytest.mark.slow
def test_the_worker_and_what_it_started_end_with_its_run(how, namespaces, when):
    """Killed or stopped, idle or while its worker is in the middle of a long call (a worker that
    is computing never sees its pipe close): the workers and what they started end with it."""
    tag = f"end{os.getpid() % 10 ** 6}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
           "SANDBOX_NAMESPACES": namespaces}
    run = subprocess.Popen([sys.executable, "-c", RUN, tag, when], cwd=ROOT,
                           stdout=subprocess.PIPE, text=True, env=env)
    workers = [int(pid) for pid in run.stdout.readline().split()]
    for pid in workers:
        os.kill(pid, 0)                                    # alive while the run is
        assert os.getsid(pid) == pid                       # in a session of its own
    if when == "idle":                     # what the call started ended with it
        assert run.stdout.readline() == "forked\n"
        assert eventually(lambda: named(tag) == [])
    else:                                  # the call in flight: its children, the worker burning
        assert eventually(lambda: len(named(tag)) == 3, 30)
        start = cpu_below(workers[1])
        assert eventually(lambda: cpu_below(workers[1]) > start + 0.3, 60)
    run.send_signal(how)
    run.wait(timeout=30)

    def gone():
        alive = []
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 0)
                alive.append(pid)
        return not alive and not named(tag)
    assert eventually(gone, 5.0), f"the workers or their children outlived the run ({how.name})"


def test_a_request_a_signal_interrupts_leaves_no_stale_reply(monkeypatch):
    """An exception raised by a signal's handler while the run waits (Run's SIGTERM while loading)
    kills the worker; the next request gets its own reply from a new one."""
    from hf import chat
    template = chat.ChatTemplate("{% for i in range(100000) %}{% for j in range(100) %}"
                                 "{% endfor %}{% endfor %}{{ messages[0]['content'] }}", {}, set(),
                                 {})

    def interrupt(signum, frame):
        raise SystemExit(143)
    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    try:
        with pytest.raises(SystemExit):
            template.render([{"role": "user", "content": "first"}])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert chat._worker().proc is None                     # killed, not left mid-request
    quick = chat.ChatTemplate("{{ messages[0]['content'] }}", {}, set(), {})
    assert quick.render([{"role": "user", "content": "second"}]) == "second"


def test_describe_names_any_exception_in_one_line():
    class Hostile(Exception):
        def __str__(self):
            raise RuntimeError("no")
    assert sandbox.describe(ValueError("a\nb")) == "ValueError: a"
    assert sandbox.describe(KeyboardInterrupt()) == "KeyboardInterrupt"
    assert sandbox.describe(MemoryError()) == "MemoryError: past the worker's memory limit"
    assert sandbox.describe(Hostile()) == "Hostile: (its message cannot be shown)"
