"""
The run plumbing every training script shares, written once so that each algorithm file shows its
algorithm and nothing else. No math lives here: a first reading of grpo.py can skip every `run.`
line and lose nothing of GRPO. Its flags are parsed in plumbing/flags.py.

Run holds the run's life:
- every check that can run before the first expensive step runs there (a --resume without a usable
  checkpoint, a missing or unreadable checkpoint flag, lengths against the model to be built);
- resume: weights, optimiser, step, random states, and the checks that the checkpoint is the one
  this run would have written (same script, same --init, same LoRA and prompts, --steps not below
  its step);
- the metrics log kept consistent with the checkpoint: nothing on disk is removed or rewritten
  until every check has passed; a fresh run then replaces the folder's earlier checkpoint and log
  together; a step's metrics are written before the checkpoint that covers it; on resume the log
  is cut back to the checkpoint's step;
- Ctrl-C (or SIGTERM): the step in progress finishes, a checkpoint is written, and one line says
  how to resume (SIGTERM while the run still loads: it stops at once); an error a step cannot go
  on from is one line naming the last checkpoint;
- held-out evaluation and the summary line.
The rest has rooms of its own beside this file: the device, seeds and loading (loading.py, whose
Models a Run is), the output folder's lock (lock.py), torch.distributed (distributed.py, whose
Distributed a Run is), device memory parking (parking.py).
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
import sys
import time
from dataclasses import asdict

import torch

import evaluation
import task
from hf import sandbox
from hf.chat import ChatTemplateError
from hf.checkpoint import CheckpointError, save_checkpoint
from lora import add_adapters
from model import GPT, GPTConfig
from plumbing.distributed import Distributed
from plumbing.flags import RM_PATH, SFT_PATH, default_path
from plumbing.loading import (BUILDING, Models, autocast, check_modes, pick_device, pick_threads,
                              read_checkpoint, seed_everything)
from plumbing import live
from plumbing.lock import OutputLock

# -----------------------------------------------------------------------------
# The learning rate

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
# The run

class Run(Distributed, Models):
    """The bookkeeping of one training run: where it writes, its random states, its step, its log.
    It never owns the loop: the script calls it (`run.log`, `run.save`, ...) where it needs it.

        run = Run("grpo", args)
        policy, tok = run.load_policy(args.init)
        optimizer = ...
        run.resume(policy, optimizer)                 # with --resume
        if not args.resume:
            run.log_start(run.evaluate(policy, tok))  # step 0: the starting policy's accuracy
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
        self.processes(solo)                      # world, rank, is_main (plumbing/distributed.py)
        if batch_flag is not None:
            n, k = getattr(args, batch_flag), getattr(args, "grad_accum", 1)
            if n % self.world or n // self.world < k:
                raise SystemExit(f"error: --{batch_flag} {n} must split evenly over {self.world} "
                                 f"processes and then into --grad_accum {k} micro-batches; "
                                 f"allowed: a multiple of {self.world} of at least "
                                 f"{self.world * k}")
        check_modes(script, args)                 # --fsdp, --batch_invariant: one line each
        try:
            self.task = task.use(args)   # --task: what every task.* call draws from
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        if getattr(args, "eval_n", None) is not None and args.eval_n > len(task.eval_prompts()):
            raise SystemExit(f"error: --eval_n {args.eval_n}; allowed: 1 to "
                             f"{len(task.eval_prompts())}, the held-out problems of --task "
                             f"{task.name()}")
        self.device = pick_device(args.device)
        self.threads = pick_threads(self.device)          # a CPU's: what the load leaves free
        self.ckpt_path = os.path.join(args.out, f"{name}.pt")
        self.metrics_path = os.path.join(args.out, name, "metrics.jsonl")
        self.live = live.Mirror(getattr(args, "report_to", "none"), os.path.dirname(
            self.metrics_path))
        # before anything is built, locked or written
        self._check_inputs()
        self.join()                               # under torchrun: the process group
        # bf16 on GPU
        self.autocast = autocast(self.device)
        seed_everything(args.seed)
        self.rng = random.Random(args.seed)                                 # draws the prompts
        self.gen = torch.Generator(device=self.device).manual_seed(args.seed + self.rank)  # samples
        self.step, self.before, self.last_eval, self.eval_step, self.eval_s = 0, None, None, -1, 0.0
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
        self.print(self.task + (f"; {self.threads}" if self.threads else ""))
        self.isolation = None                # what bounds a chat template's and a tool's code
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
        self.chat_date = (self.chat_date or datetime.date.today().isoformat()
                          if getattr(args, "chat", False) else None)
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
            self.follow(optimizer)         # --fsdp: the whole models refreshed after each step
        return ckpt

    def _load(self, model, optimizer=None, **modules):
        args = self.args
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
        if self.threads and ckpt.get("threads"):        # chosen, not set: the run's own count
            torch.set_num_threads(ckpt["threads"])
        if ckpt.get("threads", torch.get_num_threads()) != torch.get_num_threads():
            changed.append(f"torch threads {ckpt['threads']} -> {torch.get_num_threads()} "
                           f"(OMP_NUM_THREADS: bit-exact only with the same count)")
        try:
            self.load_whole(model, ckpt["model"], optimizer, ckpt["optimizer"])
            for name, module in modules.items():
                self.load_whole(module, ckpt[name])
        except (RuntimeError, ValueError, KeyError) as e:
            why = "changed: " + "; ".join(changed) if changed else " ".join(str(e).split())[:200]
            raise SystemExit(f"error: {self.ckpt_path} does not fit this run's models "
                             f"({why}); start afresh without --resume") from None
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
            self.loading = False
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
        """Held-out metrics of `model` (evaluation.evaluate at the run's --eval_temperature,
        --eval_top_p and --eval_k), as eval_*. Rank 0 alone evaluates; the other ranks get {}. In
        one process the run still loads until the first evaluation has ended: a Ctrl-C in it
        stops at once."""
        self.loading = self.loading and self.world == 1
        if not self.is_main:
            self.eval_step = self.step
            return {}
        t, prompts, a = time.time(), task.eval_prompts()[:self.args.eval_n], self.args
        # the sampled pass@1 (4x the greedy pass's rows) at the first and last step alone, unless
        # asked for more often
        every = getattr(a, "pass_at_1_every", None)
        sampled = self.step in (0, self.total_steps) or bool(every and self.step % every == 0)
        if self.loading:                     # the starting policy's: minutes on a busy CPU
            self.print(f"evaluating the starting policy on {len(prompts)} held-out problems")
        with self.autocast:
            self.last_eval = evaluation.evaluate(
                model, tok, prompts, a.eval_temperature, a.eval_top_p, a.eval_k, a.seed,
                getattr(a, "max_new_tokens", None), num_samples=4 if sampled else 0,
                progress=live.Progress("evaluating" + (" (prompts of both passes)" if sampled
                                                       else ""), self.print))
        self.eval_s = time.time() - t                        # printed with the held-out line
        self.t_log += self.eval_s                            # evaluation is not training time
        self.eval_step, self.loading = self.step, False
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
            line += f" | held-out {evaluation.line(metrics)} ({self.eval_s:.0f} s)"
        if self.isolation is None and sandbox.isolation():  # once, before the first step's line
            self.isolation = sandbox.isolation()
            self.print(self.isolation)
        self.print(f"step {self.step:5d} | {line}")
        if self.is_main:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(metrics) + "\n")
            self.live.log(metrics)                           # --report_to

    def save(self, model, optimizer=None, **extra):
        """Checkpoint <out>/<script>.pt atomically: weights, optimiser, step, flags, random states
        (every rank's sampling stream), `extra`. Every rank calls it; rank 0 writes."""
        generators = self.gather(self.gen.get_state().cpu())
        # --fsdp: the whole state gathered to rank 0 a tensor at a time (every rank takes part)
        state = self.whole_state(model)
        moments = None if optimizer is None else self.whole_optimizer_state(optimizer)
        extra = {k: self.whole_state(v) if isinstance(v, torch.nn.Module) else v
                 for k, v in extra.items()}
        if self.is_main:
            kept = {"chat_date": self.chat_date, "tokenizer_files": self.tokenizer_files}
            try:
                with self.moments:                           # on the device while it is written
                    save_checkpoint(self.ckpt_path, model, self.tokenizer_name, moments,
                                    self.step, self.args, state=state, script=self.script,
                                    sources=self.sources, rng=list(self.rng.getstate()),
                                    generator=generators[0], generators=generators,
                                    eval_before=self.before, samples=self.samples,
                                    total_steps=self.total_steps, threads=torch.get_num_threads(),
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
            summary = (f"held-out {evaluation.name(final)} {b('eval_accuracy')}"
                       f"{final['eval_accuracy']:.3f}{split}")
            if "eval_pass_at_1" in final:
                summary += (f" | sampled pass@1 {b('eval_pass_at_1')}"
                            f"{final['eval_pass_at_1']:.3f}")
        samples = f" | {self.samples:,} completions sampled" if self.samples else ""
        self.print(f"done: {self.step} steps in {time.time() - self.t0:.0f}s | {summary}{samples} "
                   f"| wrote {self.ckpt_path}")
        self.close(finished=True)

    def close(self, finished=False, code=0):
        """Release the lock and, under torchrun, tear the process group down (Distributed.leave:
        finished, every rank is here and leaves at once with `code`)."""
        self.live.close()
        if self.lock is not None:
            self.lock.release()
            self.lock = None
            for folder in getattr(self, "made", []):                          # innermost first
                with contextlib.suppress(OSError):
                    if os.path.isdir(folder) and not os.listdir(folder):
                        os.rmdir(folder)
        self.leave(finished, code)

    def _stop(self, signum, frame):
        """First Ctrl-C (or SIGTERM): finish the step, checkpoint, exit. A second Ctrl-C aborts at
        once. While the run still loads (before the starting evaluation or the resume) it stops at
        once: nothing is trained or written yet, and what loads may take long (a slow chat
        template, sampling preference pairs). A Ctrl-C while a prerequisite is built waits for the
        build, which the terminal's Ctrl-C reached too, to save and stop (the same command
        continues it)."""
        name, building = signal.Signals(signum).name, BUILDING.get("path")
        if self.loading and (signum == signal.SIGTERM or building is None):
            self.print(f"\n{name} while loading: stopped; nothing was trained or written")
            raise SystemExit(143 if signum == signal.SIGTERM else 130)
        self.interrupted = True
        signal.signal(signal.SIGINT, signal.default_int_handler)
        when = f"after step {self.current}" if self.current else "before the first step"
        then = f"once {building} has saved" if self.loading else f"{when} and writing a checkpoint"
        self.print(f"\n{name}: stopping {then} (Ctrl-C again to abort without one)")

    def _uncaught(self, kind, error, traceback):
        """An error a step cannot go on from, found deep inside it, as one line with the last
        checkpoint and how to resume: a chat template that fails mid-run, or under torchrun another
        process gone (the collective's connection reset; rank 0 says it, the others leave quietly).
        Anything else as Python prints it."""
        if isinstance(error, ChatTemplateError):
            what = f"--chat: {error}"
        elif isinstance(error, ValueError) and str(error).startswith("the model's logits are "
                                                                    "not finite"):
            lr = f"; if it diverged, lower --lr (now {self.args.lr})" if "lr" in self.args else ""
            what = f"{error} (step {self.step + 1}){lr}"
        elif self.peer_gone(error):
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

    def check_finite(self, loss, hint, what="the loss"):
        """A NaN or infinite loss (or gradient norm: what) stops the run with one line (the last
        checkpoint is kept). Under
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
            raise SystemExit(f"error: {what} is{value}{where} at step {self.step + 1}; {hint} "
                             f"(the last checkpoint, if any, is {self.ckpt_path})")
