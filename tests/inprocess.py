"""A script run in the test's own process, as `python script.py args` would run it, without paying
Python's and torch's start again (2-3 s idle, far more on a busy machine, against a second or two of
a tiny run).

    p = run_in_process("grpo.py", ["--steps", "2", "--out", out])    # p.returncode, p.stdout, ...
    with as_a_process():                                              # module.main(...) directly
        grpo.main(grpo.parse_args([...]))

What a process's end releases, as_a_process releases: the atexit callbacks the run registered, the
torch function modes it entered for "the rest of this process" (--batch_invariant), its signal
handlers and sys.excepthook, what it replaced in the project's modules and torch's (the task in
use; tests/ddp_worker.py's fixed sampler), sys.argv, the environment, the working directory,
torch's threads, flags and default dtype, grad mode, the random generators, the process group it
joined. What a run must release itself and did not (a process it started, still alive) fails the
call, naming it. hf/sandbox.py's workers are this process's, kept between runs as within one (a
restarted worker replays its setups). tests/conftest.py's `isolated` fixture checks the same
after every test.
"""
import atexit
import contextlib
import importlib
import io
import os
import random
import runpy
import shlex
import signal
import subprocess
import sys
import tempfile
import traceback
import warnings

import numpy as np
import torch

from hf import sandbox
from kernels import invariant

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Exited(SystemExit):
    """os._exit(code) inside as_a_process: the run's process would end there, this one must not."""


def _exit(code):
    sys.stdout.flush()
    sys.stderr.flush()
    raise Exited(code)


def children():
    """{pid: command line} of this process's living children (zombies and hf/sandbox.py's workers
    aside: this process's own, kept between tests and runs as they are within one run)."""
    mine, found = os.getpid(), {}
    workers = {w.proc.pid for w in sandbox._WORKERS.values() if w.proc is not None}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
            if int(stat[1]) == mine and stat[0] != "Z" and int(pid) not in workers:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    found[int(pid)] = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
        except (OSError, IndexError, ValueError):
            continue
    return found


WATCHED = ("torch", "torch.optim", "torch.nn.functional", "torch.distributed")  # besides ours


def project_modules():
    """Every module of the project (its scripts, tasks/, kernels/), imported once here: a run that
    replaces one of their functions (tests/ddp_worker.py does, for its process) is then undone."""
    if not project_modules.done:
        importlib.import_module("torch._dynamo")         # which wraps torch.manual_seed on import
        for folder in ("", "tasks", "kernels", "plumbing", "hf"):
            for f in sorted(os.listdir(os.path.join(ROOT, folder))):
                if f.endswith(".py") and f != "__init__.py":
                    importlib.import_module(".".join(filter(None, (folder, f[:-3]))))
        project_modules.done = True
    return [m for name, m in list(sys.modules.items()) if name in WATCHED or
            os.path.dirname(os.path.abspath(getattr(m, "__file__", None) or "/")).startswith(
                tuple(ROOT + os.sep + d for d in ("tasks", "kernels", "plumbing", "hf"))) or
            os.path.dirname(os.path.abspath(getattr(m, "__file__", None) or "/")) == ROOT]


project_modules.done = False


def bindings():
    """{(module or class, name): value} of every project module's globals and its classes'
    attributes, and of WATCHED's globals."""
    out = {}
    with warnings.catch_warnings():                      # torch's deprecated names, read here
        warnings.simplefilter("ignore")
        for m in project_modules():
            for name, value in list(vars(m).items()):
                out[(m, name)] = value
                if isinstance(value, type) and vars(value).get("__module__") == m.__name__ and \
                        m.__name__ not in WATCHED:           # torch.compile wraps torch's own
                    for attr, v in list(vars(value).items()):
                        out[(value, attr)] = v
    return out


def rebound(before):
    """The (owner, name) pairs bound to another object now than in `before` (bindings()), and the
    names added to a class since (a cache such as copyreg's __slotnames__ aside; a module's new
    names are its submodules and Triton's interpreter's), noted in `before` as ADDED."""
    out = []
    for owner in {key[0] for key in before if isinstance(key[0], type)}:
        for name in list(vars(owner)):
            if (owner, name) not in before and not name.startswith("__"):
                before[(owner, name)] = ADDED
                out.append((owner, name))
    return out + [key for key, value in before.items() if value is not ADDED and
                  getattr(key[0], "__dict__", {}).get(key[1], value) is not value]


def put_back(before, keys):
    """What rebound(before) found, as it was in `before`."""
    for owner, name in keys:
        if before[(owner, name)] is ADDED:
            delattr(owner, name)
        else:
            setattr(owner, name, before[(owner, name)])


ADDED = object()


def snapshot():
    """The process-wide state a run can change, each as a comparable value."""
    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    return {"torch threads": torch.get_num_threads(),
            "default dtype": torch.get_default_dtype(),
            "grad mode": torch.is_grad_enabled(),
            "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
            "float32 matmul precision": torch.get_float32_matmul_precision(),
            "anomaly detection": torch.is_anomaly_enabled(),
            "torch function modes": torch._C._len_torch_function_stack(),
            "--batch_invariant's mode": invariant.BatchInvariant.depth,
            "SIGINT handler": signal.getsignal(signal.SIGINT),
            "SIGTERM handler": signal.getsignal(signal.SIGTERM),
            "sys.excepthook": sys.excepthook,
            "environment": {k: v for k, v in os.environ.items()     # torch's caches set their own
                            if k != "PYTEST_CURRENT_TEST" and "TORCHINDUCTOR_" not in k},
            "working directory": os.getcwd(),
            "torch.distributed's group": dist,
            "child processes": sorted(children())}


def leaks(before, after):
    """One line for each value of `snapshot()` that differs (of processes: those new in `after`)."""
    out = []
    for key, was in before.items():
        now = after[key]
        if key == "child processes":
            now = {pid: cmd for pid, cmd in children().items() if pid not in was}
            if now:
                out.append(f"{key}: {now!r}")
        elif now != was:
            if key == "environment":
                keys = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))
                now, was = {k: now.get(k) for k in keys}, {k: was.get(k) for k in keys}
            out.append(f"{key}: {now!r} (was {was!r})")
    return out


def restore(before):
    """Put back what `snapshot()` saw, as far as it can be put back (stray children killed)."""
    torch.set_num_threads(before["torch threads"])
    torch.set_default_dtype(before["default dtype"])
    torch.set_grad_enabled(before["grad mode"])
    torch.use_deterministic_algorithms(before["deterministic algorithms"])
    torch.set_float32_matmul_precision(before["float32 matmul precision"])
    torch.set_anomaly_enabled(before["anomaly detection"])
    while torch._C._len_torch_function_stack() > before["torch function modes"]:
        torch._C._pop_torch_function_stack()
    invariant.BatchInvariant.depth = before["--batch_invariant's mode"]
    signal.signal(signal.SIGINT, before["SIGINT handler"])
    signal.signal(signal.SIGTERM, before["SIGTERM handler"])
    sys.excepthook = before["sys.excepthook"]
    for key in set(os.environ) - set(before["environment"]) - {"PYTEST_CURRENT_TEST"}:
        if "TORCHINDUCTOR_" in key:
            continue
        del os.environ[key]
    os.environ.update(before["environment"])
    os.chdir(before["working directory"])
    if torch.distributed.is_available() and torch.distributed.is_initialized() and \
            not before["torch.distributed's group"]:
        torch.distributed.destroy_process_group()
    for pid in children():
        if pid not in before["child processes"]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


@contextlib.contextmanager
def as_a_process(argv=None, env=None, cwd=None):
    """Run the block as a process of its own would run: `env` set on the environment (as
    subprocess's, TRITON_INTERPRET aside: the kernels imported here keep their dispatch), torch's
    threads from OMP_NUM_THREADS where `env` names it, sys.argv = argv, in `cwd`. Afterwards, what
    the process's end would release is released, and anything else left behind fails the block."""
    before, bound = snapshot(), bindings()
    rng = random.getstate(), np.random.get_state(), torch.get_rng_state()
    saved_argv, registered = sys.argv, []
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.update(env or {})
    if (env or {}).get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    if argv is not None:
        sys.argv = list(argv)
    if cwd is not None:
        os.chdir(cwd)
    real_register, real_exit = atexit.register, os._exit
    atexit.register = lambda fn, *a, **k: registered.append((fn, a, k)) or fn
    os._exit = _exit
    try:
        yield
    except Exited as e:                                  # the end of the run's "process"
        if e.code:
            raise SystemExit(e.code) from None
    finally:
        atexit.register, os._exit = real_register, real_exit
        for fn, a, k in reversed(registered):            # as Python runs them at exit
            try:
                fn(*a, **k)
            except Exception:
                print("Exception ignored in atexit callback", fn, file=sys.stderr)
                traceback.print_exc()
        put_back(bound, rebound(bound))                  # the run's own replacements, task.use's
        after = snapshot()
        left = [line for line in leaks(before, after) if line.startswith("child processes")]
        restore(before)
        sys.argv = saved_argv
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        if left:
            raise AssertionError("the run left behind: " + "; ".join(left))


@contextlib.contextmanager
def captured_fds():
    """fds 1 and 2 (and sys.stdout, sys.stderr over them) into two files: what the block and any
    process it starts write. Yields a dict that holds 'stdout' and 'stderr' afterwards."""
    out = {}
    saved = sys.stdout, sys.stderr
    for stream in saved:
        stream.flush()
    files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    kept = [os.dup(1), os.dup(2)]
    try:
        os.dup2(files[0].fileno(), 1)
        os.dup2(files[1].fileno(), 2)
        sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), line_buffering=True)
        sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), line_buffering=True)
        yield out
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        sys.stdout, sys.stderr = saved
        os.dup2(kept[0], 1)
        os.dup2(kept[1], 2)
        for fd in kept:
            os.close(fd)
        for key, f in zip(("stdout", "stderr"), files):
            f.seek(0)
            out[key] = f.read().decode(errors="replace")
            f.close()


def exit_code(e, stderr):
    """The status `python script.py` exits with on SystemExit `e` (its message to stderr)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=stderr)
    return 1


def run_in_process(script, args, env=None, cwd=ROOT):
    """`python script args` (script relative to the repository root) run here, from `cwd`: its
    CompletedProcess (returncode, stdout, stderr) as the subprocess would have given it."""
    path = os.path.join(ROOT, script)
    argv = [path, *map(str, args)]
    code, left = 0, None
    with captured_fds() as out:
        try:
            with as_a_process(argv, env, cwd):
                main = sys.modules["__main__"]
                try:
                    runpy.run_path(path, run_name="__main__")
                except SystemExit as e:
                    code = exit_code(e, sys.stderr)
                except KeyboardInterrupt:
                    traceback.print_exc()
                    code = -signal.SIGINT
                except BaseException as e:          # as Python: the excepthook, then status 1
                    sys.excepthook(type(e), e, e.__traceback__)
                    code = 1
                finally:
                    sys.modules["__main__"] = main
        except AssertionError as e:                 # left something behind
            left = e
    if left is not None:
        raise AssertionError(f"{script} {shlex.join(argv[1:])}: {left}\n{out['stderr'][-2000:]}")
    return subprocess.CompletedProcess(argv, code, out["stdout"], out["stderr"])
