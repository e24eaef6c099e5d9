"""
The run plumbing every training script shares, written once so that each algorithm file shows its
algorithm and nothing else. No math lives here: a first reading of grpo.py can skip every `run.`
line and lose nothing of GRPO. Its flags are parsed in flags.py.

What it holds:
- the device (an unavailable one is one line, before anything loads) and the seeds;
- one run per output folder: a lock file, taken over when the process that left it is dead;
- building a missing prerequisite checkpoint (the SFT policy, the reward model) where it is then
  loaded from; loading a checkpoint or a Hugging Face folder with one error line for any problem;
- every check that can run before the first expensive step runs there (a --resume without a usable
  checkpoint, a missing or unreadable checkpoint flag, lengths against the model to be built);
- resume: weights, optimiser, step, random states, and the checks that the checkpoint is the one
  this run would have written (same script, same --init, same LoRA, --steps not below its step);
- the metrics log kept consistent with the checkpoint: nothing on disk is removed or rewritten
  until every check has passed; a fresh run then replaces the folder's earlier checkpoint and log
  together; a step's metrics are written before the checkpoint that covers it; on resume the log
  is cut back to the checkpoint's step;
- Ctrl-C (or SIGTERM): the step in progress finishes, a checkpoint is written, and one line says
  how to resume (SIGTERM while the run still loads: it stops at once);
- device memory: a frozen reference (Parked) and, with --offload_optimizer, AdamW's moments
  (ParkedMoments) wait in host memory where they are not used;
- held-out evaluation and the summary line;
- torch.distributed set-up for torchrun (rank 0 alone locks, prints, logs and saves).
"""
import atexit
import contextlib
import datetime
import json
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import task
from chat import ChatTemplateError
from checkpoint import (CheckpointError, fingerprint, from_pretrained, is_pretrained_folder,
                        load_checkpoint, pretrained_config, save_checkpoint)
from flags import RM_PATH, SFT_PATH, default_path, task_flags
from lora import add_adapters, base_model, compact, trainable
from model import GPT, GPTConfig
from tasks import arithmetic
from tasks.toolcalc import CHAT_BLOCK_SIZE
from tokenizer import Tokenizer

ROOT = os.path.dirname(os.path.abspath(__file__))
# what a collective raises when another process of the run is gone (gloo, NCCL)
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
             "NCCL communicator was aborted", "remote process exited or there was a network error")
# -----------------------------------------------------------------------------
# Device and seeds

def pick_device(requested=None):
    """cuda, then mps, then cpu; a requested device that this machine lacks is an error that says
    so."""
    available = {"cpu": True, "cuda": torch.cuda.is_available(),
                 "mps": getattr(torch.backends, "mps", None) is not None
                 and torch.backends.mps.is_available()}
    if requested is None:
        return next(d for d in ("cuda", "mps", "cpu") if available[d])
    kind = requested.split(":")[0]
    if kind not in available:
        raise SystemExit(f"error: --device {requested!r} is not a device this project runs on; "
                         "allowed: cuda, mps, cpu")
    if not available[kind]:
        raise SystemExit(f"error: {kind} is not available here; run with --device cpu, or without "
                         f"--device to use the first available ({pick_device()})")
    return requested


def autocast(device):
    """The precision every script computes in on `device`: bfloat16 autocast on a GPU, nothing
    elsewhere. Its cache of cast weights is off: with it, a forward without gradient (or under
    --grad_checkpoint) holds a bfloat16 copy of every weight until the context ends (scoring's
    peak at Qwen2.5-0.5B: 0.68 GiB more, results/gpu.md); without it each copy is freed after its
    layer. Each weight is used once a forward, so the casts and the numbers are the same."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"),
                          cache_enabled=False)


def bf16_linears(model):
    """Keeps the linear layers of the model's blocks in bfloat16, the numbers bfloat16 autocast
    multiplies in anyway: the same outputs under it (tests/test_grpo.py), half their memory (0.67
    GB of a frozen reference at Qwen2.5-0.5B). The embedding, the head and the norms stay as
    they are. Only for a model every forward of which runs under autocast."""
    for m in model.blocks.modules():
        if isinstance(m, torch.nn.Linear):
            m.to(torch.bfloat16)
    return model


class Parked:
    """A frozen model's weights in device memory only inside `with parked:`; outside it they wait
    in host memory (pinned, for a CUDA device), as verl's ref.fsdp_config.param_offload. The
    tensors stay: their storage shrinks to nothing and grows back (sampler.release_copy), so the
    numbers are the same bit for bit. One host-to-device copy each time (1.17 GB at
    Qwen2.5-0.5B with bf16_linears), in exchange for that memory through sampling and update."""

    def __init__(self, model):
        storages = {}
        for p in model.parameters():
            storages.setdefault(p.untyped_storage().data_ptr(), p.untyped_storage())
        self.storages = list(storages.values())                   # a tied weight's once
        pin = self.storages[0].device.type == "cuda" if self.storages else False
        self.host = [torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=pin)
                     for s in self.storages]
        for s, h in zip(self.storages, self.host):
            h.untyped_storage().copy_(s)
        self.__exit__()

    def __enter__(self):
        for s, h in zip(self.storages, self.host):
            s.resize_(h.numel())
            s.copy_(h.untyped_storage(), non_blocking=True)      # ordered before the stream's use
        return self

    def __exit__(self, *exc):
        for s in self.storages:
            s.resize_(0)


class ParkedMoments:
    """An optimizer's state (AdamW's two moments, twice the trainable weights) in host memory
    (pinned for a CUDA device) outside its step (--offload_optimizer), as verl's actor
    optimizer_offload: on the device its storage shrinks to nothing. optimizer.step, replaced by
    self.step, runs a chunk of parameters at a time (about chunk_bytes): a chunk's moments are
    copied in, stepped and copied out before the next chunk's come in, so at most one chunk's
    moments and AdamW's temporaries are on the device. `with` brings them all back (a checkpoint).
    AdamW's update is elementwise: the same numbers bit for bit. Two copies a step (3.7 GiB each way
    at Qwen2.5-0.5B); on one stream each is ordered before any later use of that memory, so the host
    never waits."""

    def __init__(self, optimizer, chunk_bytes=2**28):
        self.optimizer, self.chunk_bytes, self.host, self.away = optimizer, chunk_bytes, {}, {}
        self.real_step, optimizer.step = optimizer.step, self.step
        self.leave()                                      # a resumed run's moments leave now

    def step(self, closure=None):
        """The optimizer's own step (its hooks too) once a chunk, the other parameters hidden."""
        if closure is not None:
            raise ValueError("--offload_optimizer steps without a closure")
        groups = self.optimizer.param_groups
        every = [g["params"] for g in groups]
        try:
            for chunk in self.chunks(every):
                for g, params in zip(groups, every):
                    g["params"] = [p for p in params if id(p) in chunk]
                self.come_back(chunk)
                self.real_step()
                self.leave(chunk)
        finally:
            for g, params in zip(groups, every):
                g["params"] = params

    def chunks(self, every):
        chunk, size = set(), 0
        for p in (p for params in every for p in params):
            if chunk and size + p.nbytes > self.chunk_bytes:
                yield chunk
                chunk, size = set(), 0
            chunk.add(id(p))
            size += p.nbytes
        if chunk:
            yield chunk

    def __enter__(self):
        self.come_back()
        return self

    def __exit__(self, *exc):
        self.leave()

    def come_back(self, chunk=None):
        for key, (p, t, h) in list(self.away.items()):
            if chunk is None or id(p) in chunk:
                del self.away[key]
                if self.optimizer.state.get(p, {}).get(key[1]) is t:   # not replaced (cleared)
                    t.untyped_storage().resize_(h.numel())
                    t.untyped_storage().copy_(h.untyped_storage(), non_blocking=True)

    def leave(self, chunk=None):
        for p, state in self.optimizer.state.items():
            if chunk is not None and id(p) not in chunk:
                continue
            for k, t in state.items():                    # AdamW: exp_avg, exp_avg_sq (not step)
                if not torch.is_tensor(t) or t.dim() == 0 or not t.untyped_storage().nbytes():
                    continue                              # a step count, or away already
                if not t.untyped_storage().resizable():  # e.g. loaded from a file on the CPU
                    state[k] = t = t.clone()
                s = t.untyped_storage()
                h = self.host.get((id(p), k))
                if h is None or h.numel() != s.nbytes():
                    h = torch.empty(s.nbytes(), dtype=torch.uint8,
                                    pin_memory=s.device.type == "cuda")
                    self.host[id(p), k] = h
                h.untyped_storage().copy_(s, non_blocking=True)
                s.resize_(0)
                self.away[id(p), k] = (p, t, h)


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def lr_schedule(step, lr, warmup, total=None):
    """Learning rate at `step` (0-based): linear warm-up over `warmup` steps, then a cosine decay to
    lr / 10 at step `total`, or constant when total is None."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if total is None:
        return lr
    progress = (step - warmup) / max(1, total - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


# -----------------------------------------------------------------------------
# Checkpoints: built when missing, loaded with one error line for any problem

TORCHRUN_VARIABLES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT"}


def build_missing(path, default, command, device=None):
    """If `path` is missing and is the flag's `default`, build it by running `command` (a script and
    its flags, in this working directory) with --out set to the folder of `path`, so it is written
    exactly where it is then loaded from. A missing path that is not the default is an error naming
    the script that makes it."""
    if os.path.exists(path):
        return
    if os.path.abspath(path) != os.path.abspath(default):
        raise SystemExit(f"error: no checkpoint at {path}; train one with `python {command[0]}` or "
                         "pass another path")
    cmd = [sys.executable, os.path.join(ROOT, command[0]), *command[1:],
           "--out", os.path.dirname(path) or "."]
    if device is not None:
        cmd += ["--device", device]
    print(f"{path} not found: building it first with `python {' '.join(command)}`", flush=True)
    # one process: a child that inherited torchrun's variables would wait forever for its group
    env = {k: v for k, v in os.environ.items()
           if k not in TORCHRUN_VARIABLES and not k.startswith("TORCHELASTIC_")}
    if subprocess.run(cmd, env=env).returncode != 0 or not os.path.exists(path):
        raise SystemExit(f"error: building {path} with {command[0]} failed (its output is above)")


def read_checkpoint(path, flag):
    """The checkpoint dict at `path` (read on the CPU), or one error line naming the flag and the
    problem: for the checks a script runs before any work."""
    if not os.path.exists(path):
        hint = "; run without --resume" if flag == "--resume" else ""
        raise SystemExit(f"error: {flag}, but there is no checkpoint at {path}{hint}")
    try:
        if is_pretrained_folder(path):              # a Hugging Face folder: its config checked here
            return {"kind": "gpt", "config": asdict(pretrained_config(path)), "step": 0}
        return load_checkpoint(path, "cpu")[1]
    except (CheckpointError, ValueError) as e:
        raise SystemExit(f"error: {flag}: {e}") from None


def check_fits(longest, max_new_tokens, block_size, turns=1, extra=0):
    """The longest prompt plus `turns` completions of max_new_tokens (and `extra` tokens between
    them: a revision prompt) must fit the model's context, or one error line naming --max_new_tokens
    and what is allowed."""
    allowed = (block_size - longest - extra) // turns
    what = f"{turns} attempts of it and {extra} tokens between them" if turns > 1 else "it"
    if allowed < 1:
        raise SystemExit(f"error: the longest prompt of the task has {longest} "
                         f"tokens{f' and {extra} more come between attempts' if extra else ''}, "
                         f"and the model's context (block_size) is {block_size}: no completion "
                         "fits; train a model with a larger block_size (sft.py --block_size) or "
                         "use one with a longer context")
    if max_new_tokens > allowed:
        raise SystemExit(f"error: --max_new_tokens {max_new_tokens} does not fit: the longest "
                         f"prompt has {longest} tokens, {what} must follow, and the model's "
                         f"context (block_size) is {block_size}; allowed: --max_new_tokens <= "
                         f"{allowed}")


def load_model(path, device, kind="gpt", expect=None, chat_date=None):
    """(model in eval mode, tokenizer, checkpoint dict); any problem with the file is one error
    line. kind: "gpt" or "scalar"; expect: {key: value} the checkpoint must hold (e.g. {"script":
    "prm"}); chat_date: the day a --chat template's strftime_now writes (default: the checkpoint's,
    else today). Eval mode means no dropout, so that scoring sees the distribution the sampler drew
    from."""
    try:
        if is_pretrained_folder(path):              # a Hugging Face folder: GPT-2, Llama, Qwen
            if kind != "gpt" or expect:
                raise CheckpointError(f"{path} is a language model's folder; a checkpoint of this "
                                      f"project's {expect or kind} is needed here")
            model, tok = from_pretrained(path).to(device), Tokenizer.from_pretrained(path)
            if tok.vocab_size > model.config.vocab_size:
                raise CheckpointError(f"vocabulary mismatch: {path} has vocab_size "
                                      f"{model.config.vocab_size} but its tokenizer.json has "
                                      f"{tok.vocab_size} tokens")
            tok = tok.use_chat(chat_date) if task.chat() else tok
            task.chat_tools(tok)                    # --tools: a template with a call form
            return model, tok, {"kind": "gpt", "tokenizer": tok.name, "step": 0}
        model, ckpt = load_checkpoint(path, device, kind=kind)
        tok = Tokenizer(ckpt["tokenizer"])
        saved = ckpt.get("tokenizer_files")
        if saved is not None and tok.files != saved:   # the folder's tokenizer changed since
            differ = sorted(k for k in {*saved, *tok.files} if saved.get(k) != tok.files.get(k))
            raise CheckpointError(f"checkpoint {path} was trained with the tokenizer of "
                                  f"{ckpt['tokenizer'][3:]}, whose {', '.join(differ)} changed "
                                  "since (edited, added or removed); restore the folder as it was")
        c = model.config
        if tok.name.startswith("hf:") and not c.tokenizer_vocab and tok.vocab_size <= c.vocab_size:
            pass                                    # an older checkpoint of a padded real model
        elif tok.vocab_size != c.support:
            raise CheckpointError(f"vocabulary mismatch: checkpoint {path} has vocab_size "
                                  f"{model.config.vocab_size} but its tokenizer "
                                  f"{ckpt['tokenizer']!r} has {tok.vocab_size}")
        for key, value in (expect or {}).items():
            if ckpt.get(key) != value:
                raise CheckpointError(f"checkpoint {path} holds {key} {ckpt.get(key)!r}; {key} "
                                      f"{value!r} is needed here")
        if task.chat():
            tok.use_chat(chat_date or ckpt.get("chat_date"))
            task.chat_tools(tok)
    except (CheckpointError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    return model.eval(), tok, ckpt


# -----------------------------------------------------------------------------
# One run per output folder

class OutputLock:
    """A lock file <out>/<script>.lock holding the owner's pid, host and command. A second run on
    the same folder is refused with a message naming the first; a lock left by a dead process is
    taken over."""

    def __init__(self, path):
        self.path, self.held = path, False
        me = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv),
              "started": time.ctime()}
        for _ in range(2):
            try:
                self._create(path, json.dumps(me))
            except FileExistsError:
                owner = self._owner()
                if owner is not None and self._alive(owner):
                    raise SystemExit("error: another run is using this output folder: pid "
                                     f"{owner['pid']} on {owner['host']} since {owner['started']} "
                                     f"({owner['command']}); wait for it, stop it, or pass another "
                                     f"--out (lock file: {path})")
                try:
                    os.remove(path)                                # its owner died: take it over
                except FileNotFoundError:
                    pass
                continue
            self.held = True
            return
        raise SystemExit(f"error: could not take the lock {path}; delete it if no run is using "
                         "this folder")

    @staticmethod
    def _create(path, text):
        """Create `path` holding `text`, or FileExistsError; atomic, one process creates it: a file
        written whole, then linked (so no reader finds it empty), or where the file system has no
        hard links, created and then written."""
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                f.write(text)
            try:
                return os.link(tmp, path)
            except FileExistsError:
                raise
            except OSError:
                pass                                         # no hard links here
        finally:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
        except OSError:
            os.remove(path)
            raise

    def _owner(self):
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None                                    # unreadable: half-written, then killed

    @staticmethod
    def _alive(owner):
        if owner.get("host") != socket.gethostname():
            return True                                    # another machine's: assumed alive
        try:
            os.kill(int(owner["pid"]), 0)
        except ProcessLookupError:
            return False
        except (PermissionError, ValueError, KeyError, TypeError):
            return True
        return True

    def release(self):
        if self.held:
            self.held = False
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass


# -----------------------------------------------------------------------------
# The run

class Run:
    """The bookkeeping of one training run: where it writes, its random states, its step, its log.
    It never owns the loop: the script calls it (`run.log`, `run.save`, ...) where it needs it.

        run = Run("grpo", args)
        policy, tok = run.load_policy(args.init)
        optimizer = ...
        run.resume(policy, optimizer)                 # with --resume
        if not args.resume:
            run.log_start(run.evaluate(policy, tok))   # held-out accuracy of the starting policy:
            step 0
        while run.training():                         # False at the step limit or after Ctrl-C
            ...                                       # the algorithm's step, then run.step += 1
            if run.eval_due(): metrics.update(run.evaluate(policy, tok))
            if run.log_due(): run.log(metrics, line)
            if run.eval_due(): run.save(policy, optimizer)
        run.finish(policy, tok, optimizer)
    """

    def __init__(self, script, args, name=None, batch_flag=None, solo=False):
        """script: the file's name without .py; name: the stem of the checkpoint, log and lock files
        (default: script); batch_flag: the flag whose count is shared among ranks and micro-batches
        (checked to divide evenly); solo: this process alone trains, whatever the process group
        (async_grpo.py's learner: its sums, shares and checkpoints are its own, and the script owns
        the group)."""
        self.script, self.args, name = script, args, name or script
        self.total_steps = args.steps
        self.moments = contextlib.nullcontext()   # the optimizer's, where resume parks them
        # torchrun sets WORLD_SIZE, RANK and LOCAL_RANK; `python script.py` is one process, rank 0
        self.world, self.rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
        if solo:
            self.world, self.rank = 1, 0
        self.is_main = self.rank == 0
        if batch_flag is not None:
            n, k = getattr(args, batch_flag), getattr(args, "grad_accum", 1)
            if n % self.world or n // self.world < k:
                raise SystemExit(f"error: --{batch_flag} {n} must split evenly over {self.world} "
                                 f"processes and then into --grad_accum {k} micro-batches; "
                                 f"allowed: a multiple of {self.world} of at least "
                                 f"{self.world * k}")
        try:
            self.task = task.use(args)   # --task: what every task.* call draws from
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        if getattr(args, "eval_n", None) is not None and args.eval_n > len(task.eval_prompts()):
            raise SystemExit(f"error: --eval_n {args.eval_n}; allowed: 1 to "
                             f"{len(task.eval_prompts())}, the held-out problems of --task "
                             f"{task.name()}")
        self.device = pick_device(args.device)
        self.ckpt_path = os.path.join(args.out, f"{name}.pt")
        self.metrics_path = os.path.join(args.out, name, "metrics.jsonl")
        # before anything is built, locked or written
        self._check_inputs()
        if self.world > 1:
            if self.device.startswith("cuda"):
                self.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
                torch.cuda.set_device(self.device)
            if not dist.is_initialized():
                dist.init_process_group("nccl" if self.device.startswith("cuda") else "gloo")
        # bf16 on GPU
        self.autocast = autocast(self.device)
        seed_everything(args.seed)
        self.rng = random.Random(args.seed)                                 # draws the prompts
        self.gen = torch.Generator(device=self.device).manual_seed(args.seed + self.rank)  # samples
        self.step, self.before, self.last_eval, self.eval_step = 0, None, None, -1
        self.tokenizer_name, self.tokenizer_files = None, None   # the policy's: kept in checkpoints
        self.sources = {}                                        # abspath -> fingerprint of a load
        self.interrupted, self.current = False, 0                # current: the step in progress
        self.loading = True                                      # until the first evaluation
        # t0: the first training step; tokens: counted by the script
        self.t0, self.t_log, self.tokens = None, time.time(), 0
        self.samples = 0                       # completions drawn so far (counted by the script)
        self.lock = None
        if self.is_main:
            if os.path.exists(args.out) and not os.path.isdir(args.out):
                raise SystemExit(f"error: --out {args.out} is a file; it must be a folder (it is "
                                 "created if missing)")
            try:
                # the folders made here, removed again by close() if the run leaves them empty (a
                # refusal after this point, e.g. of the weights, leaves nothing on disk)
                self.made, folder = [], os.path.abspath(os.path.dirname(self.metrics_path))
                while not os.path.exists(folder):                             # innermost first
                    self.made.append(folder)
                    folder = os.path.dirname(folder)
                os.makedirs(os.path.dirname(self.metrics_path), exist_ok=True)
                self.lock = OutputLock(os.path.join(args.out, f"{name}.lock"))
            except OSError as e:
                for folder in self.made:                              # innermost first
                    with contextlib.suppress(OSError):
                        os.rmdir(folder)
                raise SystemExit(f"error: cannot write to --out {args.out} "
                                 f"({e.strerror})") from None
            atexit.register(self.close)                      # released however the process ends
            for folder, stem in ((args.out, os.path.basename(self.ckpt_path)),
                                 (args.out, os.path.basename(self.lock.path)),
                                 (os.path.dirname(self.metrics_path), "metrics.jsonl")):
                for f in os.listdir(folder):                 # orphans of a save or a cut killed
                    if f.startswith(f"{stem}.tmp"):
                        os.remove(os.path.join(folder, f))
            # The log is not touched here: a fresh run replaces the folder's earlier run in
            # log_start, once every check has passed; a resumed run cuts it back in resume.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._stop)
        sys.excepthook = self._uncaught
        self.print(self.task)
        if getattr(args, "offload_optimizer", False) and not self.device.startswith("cuda"):
            self.print(f"note: --offload_optimizer parks AdamW's moments in host memory on CUDA "
                       f"only; on {self.device} nothing moves")

    # ---- checks before any work, prerequisites and models

    CHECKPOINT_FLAGS = {"init": (SFT_PATH, "sft.py"),               # flag: (default, maker)
                        "rm": (RM_PATH, "reward_model.py")}

    def _check_inputs(self):
        """What can be refused before anything is built, locked or written: a --resume with no
        usable checkpoint to resume, a checkpoint flag naming a missing file (not its default, which
        is built) or an unreadable one."""
        args = self.args
        if args.resume:
            self.resume_ckpt = read_checkpoint(self.ckpt_path, "--resume")
            if self.resume_ckpt.get("script") != self.script:
                written_by = self.resume_ckpt.get("script")
                by = written_by + ".py" if written_by else "an older version of this project"
                raise SystemExit(f"error: {self.ckpt_path} was written by {by}, not by "
                                 f"{self.script}.py; it cannot be resumed here")
            if self.resume_ckpt["step"] > self.total_steps:
                raise SystemExit(f"error: {self.ckpt_path} is at step {self.resume_ckpt['step']}, "
                                 f"past this run's limit of {self.total_steps} steps; pass a "
                                 "larger limit to train on")
            if hasattr(args, "lora_rank"):
                self._check_lora_resume(self.resume_ckpt.get("lora"))
            self._check_task_resume(self.resume_ckpt.get("args") or {})
        if getattr(args, "chat", False) and hasattr(args, "init"):
            init = args.init
            built = getattr(args, "tokenizer", None) == "bytes-chat" if init is None else \
                getattr(args, "tools", None) and init == default_path(SFT_PATH, args)
            if not built and (init is None or not os.path.exists(init)):   # built: bytes-chat
                why = "no --init given" if init is None else f"{init} is missing"
                raise SystemExit("error: --chat needs --init to name a Hugging Face folder with a "
                                 f"chat template, or a checkpoint trained from one; {why} (a new "
                                 "model has one only on sft.py's tokenizer bytes-chat)")
        # --chat: the day the template's strftime_now writes, fixed for the run (Llama 3.2 writes
        # "Today Date"): the resumed run's, else that of the policy it starts from, else today's
        self.chat_date = self.resume_ckpt.get("chat_date") if args.resume else None
        policy_config = asdict(GPTConfig())                  # what a default built here would be
        for flag, (default, maker) in self.CHECKPOINT_FLAGS.items():
            path, default = getattr(args, flag, None), default_path(default, args)
            later = not os.path.exists(path or "") and \
                os.path.abspath(path or "") == os.path.abspath(default)
            if path is None or later:
                continue                                     # absent flag, or a default built later
            if not os.path.exists(path):
                raise SystemExit(f"error: --{flag}: no checkpoint at {path}; train one with "
                                 f"`python {maker}` or pass another path")
            ckpt = read_checkpoint(path, f"--{flag}")
            if flag == "init":
                policy_config = ckpt["config"]
                self.chat_date = self.chat_date or ckpt.get("chat_date")
        if getattr(args, "chat", False):
            self.chat_date = self.chat_date or datetime.date.today().isoformat()
        else:
            self.chat_date = None
        if getattr(args, "lora_rank", 0):                    # targets and rank, on a meta twin
            with torch.device("meta"):
                model = GPT(GPTConfig(**policy_config))
            try:
                add_adapters(model, args.lora_rank, args.lora_alpha, args.lora_targets)
            except ValueError as e:
                raise SystemExit(f"error: {e}") from None


    def _check_task_resume(self, saved):
        """--resume with the flags that make the prompts (the task, its format, the chat template,
        the tools, the data) as the checkpoint has them, or one line naming the flag that differs:
        a run whose prompts changed midway would compare two tasks in its summary."""
        args = self.args
        names = ["task", "format", "chat", "tools"] + {
            "countdown": ["countdown_numbers", "countdown_rule"], "gsm8k": ["data"]}.get(
                saved.get("task"), [])
        show = lambda flag, v: f"no --{flag}" if v is None or v is False else f"--{flag}" \
            if v is True else f"--{flag} {' '.join(v) if isinstance(v, list) else v}"
        for flag in names:
            if flag in saved and hasattr(args, flag) and getattr(args, flag) != saved[flag]:
                raise SystemExit(f"error: {show(flag, getattr(args, flag))}, but "
                                 f"{self.ckpt_path} was trained with {show(flag, saved[flag])}; "
                                 f"resume with {show(flag, saved[flag])}, or start afresh "
                                 f"without --resume")

    def _check_lora_resume(self, saved):
        """--resume with the LoRA settings the checkpoint was trained with, or one line naming the
        flag that differs."""
        args, where = self.args, f"{self.ckpt_path} was trained"
        if saved and not args.lora_rank:
            raise SystemExit(f"error: {where} with LoRA adapters (--lora_rank {saved['rank']}); "
                             f"resume with --lora_rank {saved['rank']}, or start afresh without "
                             "--resume")
        if not saved and args.lora_rank:
            raise SystemExit(f"error: {where} without LoRA (every weight trains); resume without "
                             f"--lora_rank {args.lora_rank}, or start afresh without --resume")
        if not saved:
            return
        for flag, mine, theirs in (("--lora_rank", args.lora_rank, saved["rank"]),
                                   ("--lora_alpha", args.lora_alpha, saved["alpha"]),
                                   ("--lora_targets", args.lora_targets, saved["targets"])):
            if mine is not None and mine != theirs:
                show = lambda v: ",".join(v) if isinstance(v, list) else f"{v:g}"
                raise SystemExit(f"error: {flag} {show(mine)}, but {where} with {flag} "
                                 f"{show(theirs)}; resume with {flag} {show(theirs)}, or start "
                                 "afresh without --resume")

    def load(self, path, kind="gpt", expect=None):
        """load_model on this run's device, remembering what was loaded (resume checks it). Returns
        (model, tok)."""
        model, tok, ckpt = load_model(path, self.device, kind, expect, self.chat_date)
        protocol = task.chat_tools(tok) if tok.chat is not None else None
        if protocol is not None and protocol.note and not getattr(self, "noted", False):
            self.print(protocol.note)                   # a template not prefix-stable: said once
            self.noted = True
        recompute = getattr(self.args, "grad_checkpoint", False)
        getattr(model, "backbone", model).grad_checkpoint = recompute     # GPT.run_blocks
        self.sources[os.path.abspath(path)] = fingerprint(model)
        self.tokenizer_name = self.tokenizer_name or ckpt["tokenizer"]
        self.tokenizer_files = self.tokenizer_files or tok.files
        return model, tok

    def load_policy(self, path):
        """(policy, tokenizer) from an SFT checkpoint; out/sft.pt is built first if it is the
        missing default."""
        if not os.path.exists(path) and hasattr(self.args, "max_new_tokens"):  # before building
            chat = getattr(self.args, "tools", None)             # sft.py's bytes-chat model
            tok = Tokenizer("bytes-chat").use_chat() if chat else Tokenizer()
            check_fits(task.max_prompt_tokens(tok), self.args.max_new_tokens,
                       CHAT_BLOCK_SIZE if chat else GPTConfig().block_size)
        if self.is_main:
            build_missing(path, default_path(SFT_PATH, self.args),
                          ["sft.py", *task_flags(self.args)],
                          self.args.device)
        self.barrier()
        policy, tok = self.load(path, "gpt")
        policy.sampler_mode = "compile" if self.args.compile else None   # None: by device
        return self.adapt(policy), tok

    def adapt(self, model):
        """--lora_rank r: every weight of `model` frozen, adapters on its projections
        (lora.add_adapters), on a GPU the frozen ones under them in bfloat16 where that is exact
        (lora.compact); without it the model as it is. A target the model lacks or a rank it
        cannot have is one error line."""
        r = getattr(self.args, "lora_rank", 0)
        if not r:
            return model
        try:
            model = add_adapters(model, r, self.args.lora_alpha, self.args.lora_targets)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        if self.device.startswith("cuda"):
            compact(model)
        n = sum(p.numel() for p in trainable(model))
        self.print(f"LoRA: rank {r}, alpha {self.args.lora_alpha:g} on "
                   f"{', '.join(model.lora['targets'])}: {n / 1e6:.3f}M of "
                   f"{model.num_params() / 1e6:.2f}M parameters train")
        return model

    def reference(self, path, policy, bf16=False):
        """pi_ref, frozen: with --lora_rank the policy without its adapters, sharing its frozen
        weights (no second copy: lora.base_model); else a copy of `path` (the policy's start).
        bf16 (a caller that runs it under self.autocast only): on a GPU its linear layers are kept
        in bfloat16 (bf16_linears)."""
        if getattr(policy, "lora", None):
            return base_model(policy)
        ref, _ = self.load(path, "gpt")
        ref.sampler_mode = policy.sampler_mode
        if bf16 and self.device.startswith("cuda"):
            bf16_linears(ref)
        return ref.requires_grad_(False)

    def parked(self, ref, policy):
        """`with run.parked(ref, policy):` around the phase that uses a frozen model (the reference,
        a reward model): on a GPU its weights are on the device only there (Parked); elsewhere,
        where it shares the policy's weights (LoRA) or where there is none (None), nothing
        moves."""
        shared = {p.untyped_storage().data_ptr() for p in policy.parameters()}
        if ref is None or not self.device.startswith("cuda") or any(
                p.untyped_storage().data_ptr() in shared for p in ref.parameters()):
            return contextlib.nullcontext()
        return Parked(ref)

    def load_reward_model(self, path, init):
        """The Bradley-Terry reward model; out/rm.pt is built first (from `init`) if it is the
        missing default."""
        if self.is_main:
            build_missing(path, default_path(RM_PATH, self.args),
                          ["reward_model.py", "--init", os.path.abspath(init),
                           *task_flags(self.args)],
                          self.args.device)
        self.barrier()
        return self.load(path, "scalar", expect={"script": "reward_model"})[0]

    def check_lengths(self, model, tok, max_new_tokens, parenthesised=False, turns=1, extra=0):
        """The longest prompt plus max_new_tokens (turns times, extra tokens between) must fit the
        model's context: checked before any work. parenthesised: the run also uses the parenthesised
        problems (longer prompts)."""
        longest = (arithmetic.max_prompt_tokens(tok, True) if parenthesised
                   else task.max_prompt_tokens(tok))
        check_fits(longest, max_new_tokens, model.config.block_size, turns, extra)

    # ---- resume

    def resume(self, model, optimizer=None, **modules):
        """With --resume, load <out>/<script>.pt into `model`, `optimizer` and the named `modules`
        (e.g. critic=...), restore the step, the random states and the starting evaluation, and
        return the checkpoint (for extra state such as PPO's beta). Refuses a checkpoint this run
        would not have written. Without --resume: None. Then, with --offload_optimizer, the
        optimizer's moments leave the device between its steps (parked_moments)."""
        ckpt = self._load(model, optimizer, **modules)
        if optimizer is not None:
            self.moments = self.parked_moments(optimizer)
        return ckpt

    def parked_moments(self, optimizer):
        """With --offload_optimizer on a GPU, ParkedMoments(optimizer); elsewhere nothing moves."""
        if getattr(self.args, "offload_optimizer", False) and self.device.startswith("cuda"):
            return ParkedMoments(optimizer)
        return contextlib.nullcontext()

    def _load(self, model, optimizer=None, **modules):
        args = self.args
        self.loading = False
        if not args.resume:
            return None
        ckpt = self.resume_ckpt                              # read and checked in _check_inputs
        saved = ckpt.get("args") or {}
        for path, print_ in (ckpt.get("sources") or {}).items():   # what it was trained from
            if self.sources.get(path) != print_:
                now = ("is missing from this run" if path not in self.sources
                       else "holds other weights now")
                raise SystemExit(f"error: {self.ckpt_path} was trained from {path}, which {now} "
                                 f"(flags --init/--rm: {saved.get('init')}, {saved.get('rm')}); "
                                 "resume with the same checkpoints, or start afresh without "
                                 "--resume (or with another --out)")
        ignore = {"resume", "steps", "epochs", "log_every", "eval_every", "device"}
        changed = [f"--{k} {saved[k]} -> {v}" for k, v in vars(args).items()
                   if k in saved and k not in ignore and saved[k] != v]
        try:
            model.load_state_dict(ckpt["model"])
            if optimizer is not None:
                optimizer.load_state_dict(ckpt["optimizer"])
            for name, module in modules.items():
                module.load_state_dict(ckpt[name])
        except (RuntimeError, ValueError, KeyError) as e:
            why = " ".join(str(e).split())                   # one line, however torch words it
            raise SystemExit(f"error: {self.ckpt_path} does not fit this run's models "
                             f"({why[:200]}); start afresh without --resume") from None
        self.step, self.before = ckpt["step"], ckpt.get("eval_before")
        self.saved_step = self.step                          # the checkpoint on disk
        self.samples = ckpt.get("samples", 0)
        state = ckpt["rng"]
        self.rng.setstate((state[0], tuple(state[1]), state[2]))
        generators = ckpt.get("generators") or [ckpt["generator"]]   # one per rank that saved it
        if len(generators) == self.world:
            self.gen.set_state(generators[self.rank].cpu())
        else:                                          # another number of processes: fresh streams
            self.gen.manual_seed(self.args.seed + 1000 * self.step + self.rank)
            self.print(f"note: {self.ckpt_path} was written by {len(generators)} process(es), this "
                       f"run has {self.world}: the sampling streams restart (the run continues, "
                       "not bit-exactly)")
        if self.is_main:
            self._cut_log(self.step)
        self.print(f"resuming from {self.ckpt_path} at step {self.step}"
                   + (" (flags changed since it was written: "
                      f"{', '.join(changed)})" if changed else ""))
        return ckpt

    def _cut_log(self, step):
        """Keep the metrics lines of steps <= step: later ones belong to steps this run will do
        again."""
        rows = []
        if os.path.exists(self.metrics_path):
            with open(self.metrics_path) as f:
                for line in f:
                    try:
                        row = json.loads(line)
                    except ValueError:
                        break                                # a line cut short by a kill
                    if row.get("step", math.inf) <= step:
                        rows.append(line if line.endswith("\n") else line + "\n")
        tmp = f"{self.metrics_path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.writelines(rows)
        os.replace(tmp, self.metrics_path)

    # ---- the loop

    def training(self):
        """True while there are steps to do and no stop was asked for (on any rank: they stop
        together)."""
        if self.t0 is None:                                  # wall time counts from the first step
            self.t0 = self.t_log = time.time()
        if self.world > 1:
            self.interrupted = bool(self.all_sum(float(self.interrupted)).item())
        going = self.step < self.total_steps and not self.interrupted
        self.current = self.step + 1 if going else self.step   # what a Ctrl-C now would finish
        return going

    def _due(self, every, step=None):
        step = self.step if step is None else step
        return step % every == 0 or step == self.total_steps

    def eval_due(self):
        return self._due(self.args.eval_every)

    def log_due(self):
        return self._due(self.args.log_every) or self.eval_due()

    def logging(self):
        """During a step (before run.step counts it): True when this step will be logged, so that
        what only the log reads (the exact KL, the entropy) is computed on those steps alone."""
        step = self.step + 1
        return self._due(self.args.log_every, step) or self._due(self.args.eval_every, step)

    def print(self, *a):
        if self.is_main:
            print(*a, flush=True)

    def evaluate(self, model, tok):
        """Held-out metrics of `model` (task.evaluate: greedy accuracy, and pass@1 of 4 samples at T
        = 1), as eval_*. Rank 0 alone evaluates; the other ranks get {}."""
        self.loading = False
        if not self.is_main:
            self.eval_step = self.step
            return {}
        t = time.time()
        with self.autocast:
            e = task.evaluate(model, tok, task.eval_prompts()[:self.args.eval_n], num_samples=4,
                              temperature=1.0, seed=self.args.seed,
                              max_new_tokens=getattr(self.args, "max_new_tokens", None))
        self.t_log += time.time() - t                        # evaluation is not training time
        self.last_eval = {"eval_accuracy": e["greedy_accuracy"], "eval_pass_at_1": e["pass_at_1"],
                          "eval_accuracy_precedence": e["greedy_accuracy_precedence"],
                          "eval_accuracy_other": e["greedy_accuracy_other"]}
        self.eval_step = self.step
        return dict(self.last_eval)

    def log_start(self, evaluation, what="the SFT policy"):
        """Step 0 of a fresh run (scripts call it when not --resume), every check passed: the
        folder's earlier run is replaced now, its checkpoint first (a fresh log is never paired with
        an older run's checkpoint), then its log; the starting policy's evaluation is kept as
        `before` and logged."""
        if self.is_main:
            if os.path.exists(self.ckpt_path):
                os.remove(self.ckpt_path)
                self.print(f"a fresh run: the earlier run in {self.args.out} ({self.ckpt_path} and "
                           "its log) is replaced")
            open(self.metrics_path, "w").close()
        self.before = dict(evaluation)
        # what the run's numbers depend on beyond its flags: on a CPU the thread count changes the
        # order of float reductions, and an RL run that differs in one bit can diverge from there
        setting = {"device": self.device, "threads": torch.get_num_threads(), "world": self.world,
                   "torch": torch.__version__}
        self.log({**self.before, **setting}, what)

    def log(self, metrics, line, tokens=False):
        """Print `step N | line` (plus held-out accuracy on eval steps) and append `metrics` as one
        JSON line. tokens=True adds tokens_per_sec: run.tokens (counted by the script) over the
        training time since the last log."""
        now = time.time()
        metrics = {"step": self.step, **metrics}
        if self.step > 0:
            metrics["samples"] = self.samples
            if tokens:
                metrics["tokens_per_sec"] = self.tokens / max(now - self.t_log, 1e-9)
            metrics["elapsed_s"] = now - self.t0
        self.t_log, self.tokens = now, 0
        if "eval_accuracy" in metrics:
            line += (f" | held-out greedy {metrics['eval_accuracy']:.3f} pass@1 "
                     f"{metrics['eval_pass_at_1']:.3f}")
        self.print(f"step {self.step:5d} | {line}")
        if self.is_main:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(metrics) + "\n")

    def save(self, model, optimizer=None, **extra):
        """Checkpoint <out>/<script>.pt atomically: weights, optimiser, step, flags, random states
        (every rank's sampling stream), `extra`. Every rank calls it; rank 0 writes."""
        generators = [self.gen.get_state()]
        if self.world > 1:
            generators = [None] * self.world
            dist.all_gather_object(generators, self.gen.get_state().cpu())
        if self.is_main:
            kept = {"chat_date": self.chat_date, "tokenizer_files": self.tokenizer_files}
            try:
                with self.moments:                           # on the device while it is written
                    save_checkpoint(self.ckpt_path, model, self.tokenizer_name, optimizer,
                                    self.step, self.args, script=self.script,
                                    sources=self.sources, rng=list(self.rng.getstate()),
                                    generator=generators[0], generators=generators,
                                    eval_before=self.before, samples=self.samples,
                                    **{k: v for k, v in kept.items() if v}, **extra)
            except CheckpointError as e:
                step = self.last_saved()
                last = "no checkpoint was written yet" if step is None else \
                    f"{self.ckpt_path} is still step {step}"
                raise SystemExit(f"error: {e}; {last}") from None
        self.saved_step = self.step

    def last_saved(self):
        """The step of this run's checkpoint on disk (saved, or resumed from), or None."""
        step = getattr(self, "saved_step", None)
        return step if step is not None and os.path.exists(self.ckpt_path) else None

    def finish(self, model, tok, optimizer=None, summary=None, **extra):
        """After the loop: on Ctrl-C, checkpoint and say how to resume; else the summary line
        (before -> after)."""
        if not self.is_main:                                 # rank 0 reports (and saves, below)
            if self.interrupted and getattr(self, "saved_step", None) != self.step:
                self.save(model, optimizer, **extra)
            self.close(finished=True, code=130 if self.interrupted else 0)
            if self.interrupted:
                raise SystemExit(130)
            return
        if self.interrupted:
            if getattr(self, "saved_step", None) != self.step:
                self.save(model, optimizer, **extra)
            argv = [a for a in sys.argv[1:] if a != "--resume"] + ["--resume"]
            self.print(f"stopped at step {self.step} of {self.total_steps}; checkpoint "
                       f"{self.ckpt_path} (step {self.step}); continue with: {self.launcher()} "
                       f"{self.script}.py {shlex.join(argv)}")
            self.close(finished=True, code=130)
            raise SystemExit(130)
        if summary is None:
            if self.eval_step != self.step:                  # e.g. resumed at the step limit
                self.evaluate(model, tok)
            final, before = self.last_eval, self.before or {}
            b = lambda key: f"{before[key]:.3f} -> " if key in before else ""
            other = final["eval_accuracy_other"]                 # NaN: none among --eval_n
            split = (" (precedence "
                     f"{b('eval_accuracy_precedence')}{final['eval_accuracy_precedence']:.3f}, "
                     f"other {f'{other:.3f}' if other == other else 'n/a'})")
            prec = final["eval_accuracy_precedence"]
            split = split if prec == prec else ""              # NaN: no precedence split (gsm8k)
            summary = (f"held-out greedy accuracy {b('eval_accuracy')}"
                       f"{final['eval_accuracy']:.3f}{split} | sampled pass@1 "
                       f"{b('eval_pass_at_1')}{final['eval_pass_at_1']:.3f}")
        samples = f" | {self.samples:,} completions sampled" if self.samples else ""
        self.print(f"done: {self.step} steps in {time.time() - self.t0:.0f}s | {summary}{samples} "
                   f"| wrote {self.ckpt_path}")
        self.close(finished=True)

    def launcher(self):
        """The command that started this process: python, or torchrun with its process counts."""
        if self.world == 1:
            return "python"
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        if local == self.world:
            return f"torchrun --standalone --nproc_per_node {local}"
        return (f"torchrun --nnodes {self.world // local} --nproc_per_node {local} <this run's "
                f"rendezvous flags>")

    def close(self, finished=False, code=0):
        """Release the lock and, under torchrun, tear the process group down. finished: every rank
        is here, so they first wait for each other (none destroys the group while another still uses
        it), and then each rank leaves at once with `code`, everything written and flushed: the DDP
        wrapper keeps the gloo process group alive past destroy_process_group, and its threads'
        teardown at interpreter exit can abort a finished run ("terminate called without an active
        exception", 3 runs in 7 here)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None
            for folder in getattr(self, "made", []):                          # innermost first
                with contextlib.suppress(OSError):
                    if os.path.isdir(folder) and not os.listdir(folder):
                        os.rmdir(folder)
        if self.world > 1 and dist.is_initialized():
            if finished:
                dist.barrier()
            dist.destroy_process_group()
            if finished:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)

    def _stop(self, signum, frame):
        """First Ctrl-C (or SIGTERM): finish the step, checkpoint, exit. A second Ctrl-C aborts at
        once. A SIGTERM while the run is still loading (before the starting evaluation or the
        resume) stops it there: nothing is trained or written yet, and what loads may take long
        (building the SFT policy, a slow chat template)."""
        if signum == signal.SIGTERM and self.loading:
            self.print("\nSIGTERM while loading: stopped; nothing was trained or written")
            raise SystemExit(143)
        self.interrupted = True
        signal.signal(signal.SIGINT, signal.default_int_handler)
        when = f"after step {self.current}" if self.current else "before the first step"
        self.print(f"\n{signal.Signals(signum).name}: stopping {when} and writing a checkpoint "
                   f"(Ctrl-C again to abort without one)")

    def _uncaught(self, kind, error, traceback):
        """An error a step cannot go on from, found deep inside it, as one line with the last
        checkpoint and how to resume: a chat template that fails mid-run, or under torchrun another
        process gone (the collective's connection reset; rank 0 says it, the others leave quietly).
        Anything else as Python prints it."""
        if isinstance(error, ChatTemplateError):
            what = f"--chat: {error}"
        elif self.world > 1 and isinstance(error, RuntimeError) and \
                any(words in str(error) for words in PEER_GONE):
            what = "another process of this run stopped"
        else:
            return sys.__excepthook__(kind, error, traceback)
        if self.is_main:
            step = self.last_saved()
            argv = [a for a in sys.argv[1:] if a != "--resume"] + ["--resume"]
            last = "no checkpoint was written yet" if step is None else (
                f"the last checkpoint is {self.ckpt_path} (step {step}); continue with: "
                f"{self.launcher()} {self.script}.py {shlex.join(argv)}")
            print(f"error: {what}; {last}", file=sys.stderr, flush=True)

    def check_finite(self, loss, hint):
        """A NaN or infinite loss stops the run with one line (the last checkpoint is kept). Under
        torchrun every rank learns whether any rank's loss is bad, so that they stop together: a
        rank that left alone would leave the others waiting for it in the next collective."""
        bad = torch.zeros(self.world, device=self.device)
        bad[self.rank] = (~torch.isfinite(loss.detach())).float()
        bad = self.all_sum(bad)                              # (world,) 1 where a rank's loss is bad
        if bad.any():
            ranks = bad.nonzero().flatten().tolist()
            self.close()
            if not self.is_main:
                raise SystemExit(1)                                         # rank 0 says why
            ranks_text = ", ".join(map(str, ranks))
            where = f" on rank {ranks_text} of {self.world}" if self.world > 1 else ""
            value = f" {loss.item()}" if ranks[0] == 0 else " not finite"
            raise SystemExit(f"error: the loss is{value}{where} at step {self.step + 1}; {hint} "
                             f"(the last checkpoint, if any, is {self.ckpt_path})")

    # ---- more than one process (torchrun): shares, global sums, DDP, micro-batches

    def shard(self, items):
        """This rank's contiguous share of `items`, a list every rank drew identically (all of it in
        one process): a group of completions never spans two ranks."""
        n = len(items) // self.world
        return items[self.rank * n:(self.rank + 1) * n]

    def all_sum(self, x):
        """x (a tensor or a number) summed over the ranks, as a tensor on this run's device; x
        itself in one process. Every global quantity goes through it: normalisers, batch means and
        std, logged metrics."""
        x = x if torch.is_tensor(x) else torch.tensor(float(x), device=self.device)
        if self.world == 1:
            return x
        x = x.detach().clone()
        dist.all_reduce(x)
        return x

    def mean(self, x, mask=None):
        """For logged metrics, a float: the mean of x's elements over every rank's x (x.mean() in
        one process), or with a mask, of the elements where mask is 1 (model.masked_mean(x, mask) in
        one process)."""
        if mask is None:
            return (self.all_sum(x.sum()) / self.all_sum(x.numel())).item()
        total = self.all_sum(torch.where(mask > 0, x, 0.0).sum())
        return (total / self.all_sum(mask.sum()).clamp(min=1)).item()

    def std(self, x):
        """The population std of x's elements over every rank's x (x.std(unbiased=False) in one
        process)."""
        if self.world == 1:
            return x.std(unbiased=False).item()
        return math.sqrt(self.mean((x - self.mean(x)) ** 2))

    def ddp(self, model):
        """The model wrapped in DistributedDataParallel, for the training forward and backward, or
        the model itself in one process. Its gradient is the SUM of the ranks' gradients, not their
        mean: each rank's loss is its share of the whole batch's loss (normalised by all_sum
        counts), so the shares add up to exactly one batch's gradient."""
        if self.world == 1:
            return model
        wrapped = DistributedDataParallel(model)
        wrapped.register_comm_hook(None, _allreduce_sum)
        return wrapped

    def micro_batches(self, n, *ddp_models):
        """The row indices of each --grad_accum micro-batch of an n-row batch, one at a time:

            for rows in run.micro_batches(B, train_policy):
                loss = ...(train_policy(x[rows]) ...)       # forward and backward both inside the
                loop body loss.backward()

        Under torchrun, the gradients of `ddp_models` are summed over ranks once, after the last
        micro-batch: every earlier one runs inside their no_sync(). The forward must be inside it
        too, not only the backward: DDP decides at forward time whether the backward that follows
        all-reduces. Without models (scoring under no_grad) it only splits the rows."""
        parts = torch.tensor_split(torch.arange(n, device=self.device), self.args.grad_accum)
        for i, rows in enumerate(parts):
            with contextlib.ExitStack() as stack:
                if self.world > 1 and i < len(parts) - 1:
                    for m in ddp_models:
                        stack.enter_context(m.no_sync())
                yield rows

    def barrier(self):
        if self.world > 1:
            dist.barrier()


def _allreduce_sum(state, bucket):
    """DDP communication hook: sum a gradient bucket over ranks (DDP's default averages)."""
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])
