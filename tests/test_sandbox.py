"""sandbox.py: the worker process untrusted code runs in. Its uses are tested with them
(tests/test_chat.py: templates; tests/test_tools.py: tools); here what belongs to the worker alone:
it never outlives its run, however the run ends, and a request a signal interrupts leaves no stale
reply for the next one."""
import os
import signal
import subprocess
import sys
import time

import pytest

import sandbox
from conftest import ROOT

RUN = """
import os, sys, time
import chat
template = chat.ChatTemplate("{{ messages[0]['content'] }}", {}, set(), {})
template.render([{"role": "user", "content": "x"}])
print(chat._worker().proc.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
@pytest.mark.slow
def test_the_worker_ends_with_its_run(how):
    run = subprocess.Popen([sys.executable, "-c", RUN], cwd=ROOT, stdout=subprocess.PIPE,
                           text=True)
    worker = int(run.stdout.readline())
    os.kill(worker, 0)                                     # alive while the run is
    run.send_signal(how)
    run.wait(timeout=30)
    started = time.time()
    while time.time() - started < 10:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    pytest.fail(f"worker {worker} outlived its run ({signal.Signals(how).name})")


def test_a_request_a_signal_interrupts_leaves_no_stale_reply(monkeypatch):
    """An exception raised by a signal's handler while the run waits (Run's SIGTERM while loading)
    kills the worker; the next request gets its own reply from a new one."""
    import chat
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
