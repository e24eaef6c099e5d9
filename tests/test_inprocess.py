"""tests/inprocess.py, the harness that runs scripts in the test's own process: it gives what a new
process gives, releases what a process's end releases, and names what a run or a test leaves."""
import os
import signal
import subprocess
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

import grpo
import task
from conftest import as_a_process, leaks, refused, restore, run_script, snapshot, task_args
from inprocess import children
from kernels import invariant


@pytest.mark.slow
def test_a_refusal_in_process_is_the_command_lines_to_the_letter(tmp_path):
    args = ["--group_size", "1", "--out", str(tmp_path / "x")]
    here, there = run_script("grpo.py", args), run_script("grpo.py", args, fresh=True)
    refused(here, "--group_size", "1")
    assert (here.returncode, here.stdout, here.stderr) == (there.returncode, there.stdout,
                                                          there.stderr)


def test_what_a_process_would_drop_is_dropped_and_the_run_sees_its_own_argv_and_environment():
    before = snapshot()
    seen = {}
    with as_a_process(["grpo.py", "--x"], env={"OMP_NUM_THREADS": "1", "SOME_FLAG": "on"}):
        invariant.enable()                                  # "for the rest of this process"
        signal.signal(signal.SIGTERM, lambda *_: None)
        sys.excepthook = lambda *a: None
        grpo.rollout = None                                 # tests/ddp_worker.py's kind of patch
        task.use(task_args("countdown"))
        seen.update(argv=sys.argv, flag=os.environ.get("SOME_FLAG"),
                    threads=torch.get_num_threads())
    assert seen == {"argv": ["grpo.py", "--x"], "flag": "on", "threads": 1}
    assert leaks(before, snapshot()) == []
    assert callable(grpo.rollout) and task.name() == "arithmetic"


def test_os_exit_ends_the_run_not_pytest():
    with as_a_process():
        os._exit(0)
    with pytest.raises(SystemExit) as e, as_a_process():
        os._exit(3)
    assert e.value.code == 3


def test_a_process_the_run_leaves_alive_fails_the_call_naming_it():
    with pytest.raises(AssertionError, match="child processes.*sleep 60"):
        with as_a_process():
            subprocess.Popen(["sleep", "60"])
    assert leaks(snapshot(), snapshot()) == []              # and it was killed


def test_a_leak_is_named():
    before = snapshot()
    torch.set_num_threads(torch.get_num_threads() + 1)
    os.environ["LEAKED"] = "1"
    try:
        assert leaks(before, snapshot()) == [
            f"torch threads: {before['torch threads'] + 1} (was {before['torch threads']})",
            "environment: {'LEAKED': '1'} (was {'LEAKED': None})"]
    finally:
        restore(before)
    assert leaks(before, snapshot()) == []


class PassThrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


# Each value snapshot() keeps, leaked the way a run would leak it (the process group and children
# have their own tests: test_distributed.py's torchrun runs, and the test above)
LEAKS = {
    "torch threads": lambda: torch.set_num_threads(torch.get_num_threads() + 1),
    "default dtype": lambda: torch.set_default_dtype(torch.float64),
    "grad mode": lambda: torch.set_grad_enabled(False),
    "deterministic algorithms": lambda: torch.use_deterministic_algorithms(True),
    "float32 matmul precision": lambda: torch.set_float32_matmul_precision("medium"),
    "anomaly detection": lambda: torch.set_anomaly_enabled(True),
    "torch function modes": lambda: PassThrough().__enter__(),
    "--batch_invariant's mode": invariant.enable,
    "SIGINT handler": lambda: signal.signal(signal.SIGINT, lambda *_: None),
    "SIGTERM handler": lambda: signal.signal(signal.SIGTERM, lambda *_: None),
    "sys.excepthook": lambda: setattr(sys, "excepthook", lambda *_: None),
    "environment": lambda: os.environ.__setitem__("LEAKED", "1"),
    "working directory": lambda: os.chdir("/"),
}


def test_the_table_covers_every_value_the_harness_keeps():
    assert set(LEAKS) | {"torch.distributed's group", "child processes"} == set(snapshot())


@pytest.mark.parametrize("key", LEAKS)
def test_each_leak_is_named_put_back_and_dropped_at_a_runs_end(key):
    """Leaked in a test's body: leaks() names it and restore() puts it back. Leaked inside
    as_a_process: nothing is left after the block."""
    before = snapshot()
    LEAKS[key]()
    try:
        assert key in [line.split(":")[0] for line in leaks(before, snapshot())]
    finally:
        restore(before)
    assert leaks(before, snapshot()) == []
    with as_a_process():
        LEAKS[key]()
    assert leaks(before, snapshot()) == []


def test_a_zombie_is_not_a_live_child():
    """A child that has ended and is not yet reaped is no process the run left alive."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    state = lambda: open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0]
    while state() != "Z":                               # ended, not reaped: child.wait() is not
        os.sched_yield()                                # called until below
    try:
        assert child.pid not in children()
    finally:
        child.wait()
