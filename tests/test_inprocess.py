"""tests/inprocess.py, the harness that runs scripts in the test's own process: it gives what a new
process gives, releases what a process's end releases, and names what a run or a test leaves."""
import os
import signal
import subprocess
import sys

import pytest
import torch

import grpo
import task
from conftest import as_a_process, leaks, refused, restore, run_script, snapshot, task_args
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
