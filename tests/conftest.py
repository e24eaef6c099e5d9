"""Shared fixtures. `tiny_sft` is the small SFT policy the algorithm scripts' tests start from: the
same file on every machine (tests/fixtures/tiny_sft.pt), so that what a test sees does not depend on
the torch build or the CPU."""
import argparse
import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import task  # noqa: E402
from inprocess import (as_a_process, bindings, leaks, put_back, rebound,  # noqa: E402,F401
                       restore, run_in_process, snapshot)


def pytest_configure(config):
    """Each process that runs tests takes its share of the cores (pytest-xdist's workers: cores /
    workers), set in OMP_NUM_THREADS too, even with -n 0, so that no run a test makes picks its
    threads from the machine's load (plumbing/loading.py:pick_threads). Not in xdist's controller:
    its workers would inherit its share, the whole machine each."""
    if not os.environ.get("PYTEST_XDIST_WORKER") and config.getoption("numprocesses", None):
        return
    share = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1))
    threads = os.environ.setdefault("OMP_NUM_THREADS", str(share))  # the processes tests start
    torch.set_num_threads(int(threads) if threads.isdigit() else share)


def run_script(script, args, timeout=600, env=None, cwd=ROOT, fresh=False):
    """`python script args` from `cwd` (default: the repository root); its CompletedProcess. In this
    process (tests/inprocess.py: torch imported once, what the run leaves behind restored or failed)
    unless `fresh`: a new Python process, for what is about processes, signals and the command line.
    env: variables to set for it (OMP_NUM_THREADS="1" where runs are compared bit for bit: more
    threads than one may split a sum differently when the machine is busy)."""
    if not fresh:
        return run_in_process(script, args, env, cwd)
    # the PyTorch kernels
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, **(env or {})}
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=env)


def run_scripts(calls, cwd=ROOT, timeout=600, env=None, fresh=False):
    """run_script on every (script, args) of `calls`: their CompletedProcesses, in order. In this
    process one after another, or (fresh) in new processes all at once."""
    if not fresh:
        return [run_in_process(script, args, env, cwd) for script, args in calls]
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, **(env or {})}
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, script), *args], cwd=cwd,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for script, args in calls]
    done = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return done


class Counted:
    """A compiled regex that appends the length of each text it is given to `scanned`: a
    verifier's work counted, not timed."""
    def __init__(self, scanned, pattern):
        self.scanned, self.pattern = scanned, pattern

    def __getattr__(self, name):
        def call(text, *a, **k):
            self.scanned.append(len(text))
            return getattr(self.pattern, name)(text, *a, **k)
        return call


def refuses_all(script, cases, tmp_path, cwd=ROOT):
    """Each (args, words) of `cases` is refused by `script` (refused(p, *words)), each run with its
    own --out under tmp_path unless its args name one. Returns the CompletedProcesses."""
    calls = [(script, args if "--out" in args else [*args, "--out", str(tmp_path / f"out{i}")])
             for i, (args, _) in enumerate(cases)]
    done = run_scripts(calls, cwd)
    for p, (args, words) in zip(done, cases):
        refused(p, *words)
    return done


def refused(p, *words):
    """A run refused bad input the way every script must: a non-zero exit, one error line naming
    each of `words` (the flag and its value), and no traceback."""
    assert p.returncode != 0, p.stdout
    assert "Traceback" not in p.stderr, p.stderr
    for w in words:
        assert w in p.stderr, (w, p.stderr)


TINY_SFT = ["--steps", "1200", "--batch_size", "32", "--n_layer", "2", "--n_head", "2",
            "--n_embd", "64", "--lr", "3e-3", "--log_every", "400", "--eval_every", "1200",
            "--eval_n", "128"]  # tiny_sft's recipe


@pytest.fixture(scope="session")
def tiny_sft(tmp_path_factory):
    """Path to a small SFT policy (2 layers, width 64, 1200 steps): held-out greedy accuracy 0.31,
    so it has learned the format and some arithmetic, and RL on it has rewards to work with. It was
    trained once, by sft.py with TINY_SFT's flags (torch 2.13, 2 CPU threads; its optimiser state
    dropped), and is kept in the repository (tests/fixtures/tiny_sft.pt): trained here, it would
    have other weights on another torch or CPU (1200 steps amplify a difference in the last bit of a
    sum to 1e-2, even in float64), and every number a test reads from a run would move with them."""
    out = tmp_path_factory.mktemp("tiny_sft")
    shutil.copy(os.path.join(ROOT, "tests", "fixtures", "tiny_sft.pt"), out / "sft.pt")
    return str(out / "sft.pt")


@pytest.fixture(autouse=True)
def isolated():
    """Every test leaves the process as it found it (tests/inprocess.py's snapshot: threads, modes,
    signal handlers, excepthook, environment, working directory, process group, workers, children):
    a test that leaks one fails, naming it, and the next test starts clean."""
    before, bound = snapshot(), bindings()
    yield
    left = leaks(before, snapshot())
    changed = rebound(bound)
    left += [f"{getattr(owner, '__name__', owner)}.{name} replaced" for owner, name in changed
             if (owner, name) != (task, "_in_use")]           # the task in use: seeded() sets it
    put_back(bound, changed)
    restore(before)
    assert not left, "the test left behind: " + "; ".join(left)


@pytest.fixture(autouse=True)
def seeded(isolated):
    """Every test starts from the same random state, so that none passes or fails by the luck of its
    draw; and with the default task (arithmetic, plain format) in use, whatever task an earlier test
    chose."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    task.use(task_args())


def task_args(name="arithmetic", fmt="plain", numbers=3, data=None, rule="exactly", chat=False,
              tools=None):
    """The task flags as a parsed namespace, for task.use."""
    return argparse.Namespace(task=name, format=fmt, countdown_numbers=numbers, data=data,
                              countdown_rule=rule, chat=chat, tools=tools)


def run_metrics(out, script):
    """The run's metrics.jsonl lines, times aside (they move between runs of the same code)."""
    with open(os.path.join(out, script, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if k not in ("elapsed_s", "tokens_per_sec")} for r in rows]


def on_a_gpu(method):
    """A Run method that decides by the device (Run.parked, Run.parked_moments), run as if the
    device were a GPU: here on the CPU."""
    def wrapped(self, *a):
        device, self.device = self.device, "cuda"
        try:
            return method(self, *a)
        finally:
            self.device = device
    return wrapped


def offloaded_runs(module, argv, out, monkeypatch, plain=(), offloaded=((),)):
    """module.main(argv + plain) on the CPU into out/plain, then module.main(argv + each of
    `offloaded`) with --offload_optimizer as on a GPU, 4 kB of parameters a chunk, into out/off; one
    torch thread (the sums in one order). Asserts that AdamW's moments hold no memory whenever the
    sampler runs or a backward pass does, and that both folders log the same metrics (times aside).
    Returns the ParkedMoments made, one a run."""
    from plumbing import parking
    import plumbing
    import sampler
    parks, real_backward = [], torch.Tensor.backward
    parked_moments = on_a_gpu(plumbing.Run.parked_moments)

    def park(self, optimizer):
        parks.append(parked_moments(self, optimizer))
        assert isinstance(parks[-1], parking.ParkedMoments)
        return parks[-1]

    def spy(fn):                                         # sampling, the update's backward passes
        def wrapped(*a, **k):
            state = parks[-1].optimizer.state.values() if parks else []
            assert all(t.untyped_storage().size() == 0
                       for st in state for k, t in st.items() if k != "step")
            return fn(*a, **k)
        return wrapped
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        with as_a_process():
            module.main(module.parse_args([*argv, *plain, "--out", str(out / "plain")]))
        monkeypatch.setattr(plumbing.Run, "parked_moments", park)
        monkeypatch.setattr(parking.ParkedMoments.__init__, "__defaults__", (4096,))  # chunks
        monkeypatch.setattr(torch.Tensor, "backward", spy(real_backward))
        monkeypatch.setattr(sampler, "generate", spy(sampler.generate))
        for more in offloaded:
            torch.manual_seed(0)
            with as_a_process():
                module.main(module.parse_args([*argv, *more, "--offload_optimizer",
                                               "--out", str(out / "off")]))
    finally:
        torch.set_num_threads(threads)
    script = module.__name__
    # (a run cut by --steps reports the sampled pass@1 at its own last step: evaluation.py)
    cut = lambda rows: [{k: v for k, v in r.items() if k != "eval_pass_at_1"} for r in rows]
    assert cut(run_metrics(out / "off", script)) == cut(run_metrics(out / "plain", script))
    return parks


def parked_runs(module, argv, out, monkeypatch):
    """module.main(argv) twice, one torch thread (the sums in one order): as it runs on the CPU, and
    with its frozen models (the reference; ppo's reward model) parked as on a GPU (parking.Parked,
    here on the CPU). Asserts that a parked model holds all its memory at each of its forwards and
    every parked model none whenever the sampler runs or a backward pass does, and that both runs
    log the same metrics (times aside). Returns the number of forwards of each parked model, in the
    order they were parked."""
    import plumbing
    import episode
    import sampler
    from model import GPT
    from plumbing.parking import Parked
    parks = []                                           # [Parked, the model, its forwards]
    real_parked = on_a_gpu(plumbing.Run.parked)
    real_hidden, real_backward = GPT.hidden, torch.Tensor.backward

    def parked(self, ref, policy):
        parking = real_parked(self, ref, policy)
        if ref is not None:
            assert isinstance(parking, Parked)
            parks.append([parking, getattr(ref, "backbone", ref), 0])   # a ScalarGPT: its GPT
        return parking

    def away(parking):
        return all(s.size() == 0 for s in parking.storages)

    def hidden(model, *a, **k):                      # every forward of a GPT goes through it
        for park in parks:
            if model is park[1]:
                assert not away(park[0])
                park[2] += 1
        return real_hidden(model, *a, **k)

    def spy(fn):                                         # sampling, the update's backward passes
        def wrapped(*a, **k):
            assert all(away(park[0]) for park in parks)
            return fn(*a, **k)
        return wrapped
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        with as_a_process():
            module.main(module.parse_args([*argv, "--out", str(out / "plain")]))
        monkeypatch.setattr(plumbing.Run, "parked", parked)
        monkeypatch.setattr(GPT, "hidden", hidden)
        monkeypatch.setattr(torch.Tensor, "backward", spy(real_backward))
        monkeypatch.setattr(sampler, "generate", spy(sampler.generate))
        monkeypatch.setattr(episode, "sample", spy(episode.sample))
        torch.manual_seed(0)
        with as_a_process():
            module.main(module.parse_args([*argv, "--out", str(out / "parked")]))
    finally:
        torch.set_num_threads(threads)
    assert parks and all(away(park[0]) for park in parks)
    script = module.__name__
    assert run_metrics(out / "parked", script) == run_metrics(out / "plain", script)
    return [park[2] for park in parks]


GROWING = open(os.path.join(ROOT, "tests", "golden", "qwen3", "chat_template.jinja")).read()
GROWING = GROWING.replace(
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}",
    "{{- '<|im_start|>' + message.role + '\\n' }}{%- for _ in range(8 if loop.index0 < "
    "messages|length - 2 else 1) %}{{- message.content }}{%- endfor %}{{- '<|im_end|>\\n' }}")


def growing_folder(path, positions):
    """tests/golden/qwen3 at `path`, with `positions` of context and a template that writes each
    message older than the last two 8 times: the history grows as the game goes on."""
    assert GROWING.count("range(8") == 1
    shutil.copytree(os.path.join(ROOT, "tests", "golden", "qwen3"), path)
    (path / "chat_template.jinja").write_text(GROWING)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": positions}))
    return str(path)
