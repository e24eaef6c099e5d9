"""
What a run starts from, each problem one line before any work: the device (cuda, then mps, then
cpu; one this machine lacks is refused) and the precision every script computes in on it; the
seeds; --fsdp and --batch_invariant where they can serve; a checkpoint or a Hugging Face folder
read and loaded (with its tokenizer, and with --chat its template and tools); a missing
prerequisite checkpoint (the SFT policy, the reward model) built where it is then loaded from; the
longest prompt and its completions checked against the model's context.
"""
import contextlib
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict

import numpy as np
import torch

import sampler
import task
from hf.checkpoint import (CheckpointError, fingerprint, from_pretrained, is_pretrained_folder,
                           load_checkpoint, pretrained_config)
from hf.tokenizer import Tokenizer
from kernels import invariant
from lora import add_adapters, base_model, compact, trainable
from model import GPTConfig
from plumbing.flags import RM_PATH, SFT_PATH, default_path, task_flags
from plumbing.parking import Parked, ParkedMoments
from tasks import arithmetic, guess
from tasks.toolcalc import CHAT_BLOCK_SIZE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # where the scripts are


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


def busy_cores(seconds=0.25):
    """How many of the cores this process may run on other work keeps busy now: their /proc/stat
    time not idle over `seconds`, less this process's own (its OpenMP threads spin a while after
    each parallel region); without /proc, the 1-minute load average."""
    mine = {f"cpu{i}" for i in os.sched_getaffinity(0)} if hasattr(os, "sched_getaffinity") \
        else None

    def times():
        idle = total = 0
        with open("/proc/stat") as f:
            for line in f:
                name, *t = line.split()
                if name.startswith("cpu") and name != "cpu" and (mine is None or name in mine):
                    t = [int(x) for x in t[:8]]          # user .. steal (guest is in user)
                    idle, total = idle + t[3] + t[4], total + sum(t)   # idle + iowait, all
        return idle, total, time.process_time(), time.time()
    try:
        (idle0, all0, own0, t0), _, (idle1, all1, own1, t1) = times(), time.sleep(seconds), times()
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    cores = len(mine) if mine else os.cpu_count()
    busy = cores * (1 - (idle1 - idle0) / max(all1 - all0, 1))
    return max(0.0, busy - (own1 - own0) / max(t1 - t0, 1e-9))


def pick_threads(device):
    """On a CPU without OMP_NUM_THREADS: as many torch threads as the cores other work leaves free,
    at least 1. Every OpenMP region waits at a barrier for its slowest thread, so a thread that
    shares a core with other work stalls all of them: a default grpo.py step on 2 AMD EPYC cores
    (bench/threads.py, torch 2.13) took 1.38 s with 2 threads and 2.14 with 1 when idle, but 3.87 s
    against 2.11 beside one busy process and 15.9 against 3.6 beside two. Returns the line that
    names the choice, or None where nothing was chosen."""
    if not device.startswith("cpu") or os.environ.get("OMP_NUM_THREADS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    busy = busy_cores()
    torch.set_num_threads(max(1, min(cores, round(cores - busy))))
    return (f"{torch.get_num_threads()} torch thread(s): {cores} cores, {busy:.1f} busy with "
            "other work (OMP_NUM_THREADS=N sets it)")


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


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


TORCHRUN_VARIABLES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT"}


def check_modes(script, args):
    """--fsdp and --batch_invariant where they cannot serve: one line each, before anything
    loads; then --batch_invariant's mode, for the whole run (kernels.invariant)."""
    if getattr(args, "fsdp", False):
        why = {"trpo": "its update is a natural-gradient step over one flat vector of every "
                       "weight (conjugate gradients, a line search), which shards do not form",
               "async_grpo": "its learner is one process (the actors sample apart)"}
        if script in why:
            raise SystemExit(f"error: --fsdp: {script}.py cannot shard: {why[script]}; run it "
                             f"without --fsdp")
        if getattr(args, "offload_optimizer", False):
            raise SystemExit("error: --fsdp with --offload_optimizer: the moments are sharded "
                             "over the processes already; choose one")
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError:
            raise SystemExit(f"error: --fsdp needs torch 2.6 or later (FSDP2's fully_shard); "
                             f"this is torch {torch.__version__}") from None
    if not getattr(args, "batch_invariant", False):
        return
    served = ("grpo", "rloo", "reinforce", "trpo", "ppo", "async_grpo", "agent", "multiturn",
              "distill", "self_distill", "online_dpo", "expert_iteration")
    if script not in served:
        raise SystemExit(f"error: --batch_invariant: {script}.py trains on no samples of its own "
                         f"policy (nothing to match); it serves {', '.join(served)}")
    device = pick_device(args.device)
    if device != "cpu":
        raise SystemExit(f"error: --batch_invariant runs on the CPU so far (--device {device}: "
                         f"its Triton kernels are tested in Triton's interpreter, not yet on a "
                         f"GPU); add --device cpu")
    for flag in ("fsdp", "compile"):
        if getattr(args, flag, False):
            raise SystemExit(f"error: --batch_invariant with --{flag}: not exact yet; choose one")
    invariant.enable()


BUILDING = {}     # {"path": the prerequisite being built} while build_missing's child runs


def progress(path):
    """(step, total) of a run's checkpoint at `path` that stopped before its last step, else None
    (a finished one, a Hugging Face folder, one from before total_steps was kept)."""
    if os.path.isdir(path):
        return None
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:                      # unreadable: the loading after says what is wrong
        return None
    step, total = ckpt.get("step"), ckpt.get("total_steps")
    done = not isinstance(step, int) or not isinstance(total, int) or step >= total
    return None if done else (step, total)


def build_missing(path, default, command, device=None):
    """If `path` is missing and is the flag's `default`, build it by running `command` (a script and
    its flags, in this working directory) with --out set to the folder of `path`, so it is written
    exactly where it is then loaded from. A build there that stopped before its last step is
    continued (--resume), and said so: never used as if finished. A missing path that is not the
    default is an error naming the script that makes it; a partial one is used, with a note."""
    default = os.path.abspath(path) == os.path.abspath(default)
    partial = progress(path) if os.path.exists(path) else None
    if partial and not default:
        print(f"note: {path} is a run stopped at step {partial[0]} of {partial[1]}, used as it is",
              flush=True)
    if os.path.exists(path) and (partial is None or not default):
        return
    if not default:
        raise SystemExit(f"error: no checkpoint at {path}; train one with `python {command[0]}` or "
                         "pass another path")
    cmd = [sys.executable, os.path.join(ROOT, command[0]), *command[1:],
           "--out", os.path.dirname(path) or "."]
    if device is not None:
        cmd += ["--device", device]
    if partial:
        cmd.append("--resume")
        print(f"{path} is a partial build (step {partial[0]} of {partial[1]}): continuing it with "
              f"`python {' '.join(command)} --resume`", flush=True)
    else:
        print(f"{path} not found: building it first with `python {' '.join(command)}`", flush=True)
    # one process: a child that inherited torchrun's variables would wait forever for its group
    env = {k: v for k, v in os.environ.items()
           if k not in TORCHRUN_VARIABLES and not k.startswith("TORCHELASTIC_")}
    BUILDING["path"] = path                                 # a Ctrl-C now waits for its save
    try:
        code = subprocess.run(cmd, env=env).returncode
    finally:
        BUILDING.clear()
    if code in (130, 143):                                  # Ctrl-C or SIGTERM: the build stopped
        left = progress(path) if os.path.exists(path) else None
        where = f" at step {left[0]} of {left[1]}" if left else ""
        print(f"stopped while building {path}{where}; the same command continues it", flush=True)
        raise SystemExit(code)
    if code != 0 or not os.path.exists(path) or progress(path):
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


class Models:
    """A run's models (Run is one): loaded on its device and remembered for resume's checks, built
    first where a default prerequisite is missing, adapted for LoRA, frozen for a reference, and
    parked on a GPU where a phase does not use them. Needs Run's device, args, is_main, sources,
    tokenizer_name and tokenizer_files, chat_date, print and barrier."""

    def load(self, path, kind="gpt", expect=None):
        """load_model on this run's device, remembering what was loaded (resume checks it). Returns
        (model, tok)."""
        folder, t = is_pretrained_folder(path), time.time()
        if folder:                                   # a real model: seconds to minutes
            size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                       if f.endswith((".safetensors", ".bin")))
            self.print(f"loading {path} ({size / 2 ** 30:.2f} GiB of weights)")
        model, tok, ckpt = load_model(path, self.device, kind, expect, self.chat_date)
        if folder:
            self.print(f"loaded in {time.time() - t:.0f} s")
        if kind == "gpt" and not getattr(self, "compile_said", False) and (
                getattr(self.args, "compile", False) or
                sampler.default_mode(model, torch.device(self.device)) == "compile"):
            self.print("the first rollout compiles the sampler's decode step (torch.compile: "
                       "about 30 s, once)")
            self.compile_said = True
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
        if self.device.startswith("cuda") and not getattr(self.args, "fsdp", False):
            compact(model)                     # (FSDP shards each block's tensors in one dtype)
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

    def check_demonstrations(self, model, tok):
        """sft.py on a model it did not build: the task's longest prompt and its longest
        demonstration must fit the model's context, before any work; a guess game's demonstration
        is every turn and the replies between them, as multiturn.py checks its episodes."""
        if task.name() != "guess":
            return self.check_lengths(model, tok, task.default_max_new_tokens())
        reply = max(len(r if isinstance(r, list) else tok.encode(r))
                    for r in task.environment(0, tok).replies)
        K = guess.MAX_TURNS                             # between turns: an answer, an end token
        self.check_lengths(model, tok, guess.MAX_NEW_TOKENS, turns=K, extra=(K - 1) * (reply + 1))
        if tok.chat is None:
            return
        demos = task.sample_demonstrations(random.Random(0), 8, 0.5)   # as its template renders
        try:
            tokens = task.completion_batch([p for p, _ in demos], [c for _, c in demos], tok)[0]
        except ValueError as e:
            raise SystemExit(f"error: --chat: {e}") from None
        if tokens.shape[1] > model.config.block_size:
            raise SystemExit(f"error: {self.args.init}: its chat template writes a game's "
                             f"demonstration in {tokens.shape[1]} tokens; its context holds "
                             f"{model.config.block_size}")

    def parked_moments(self, optimizer):
        """With --offload_optimizer on a GPU, ParkedMoments(optimizer); elsewhere nothing moves."""
        if getattr(self.args, "offload_optimizer", False) and self.device.startswith("cuda"):
            return ParkedMoments(optimizer)
        return contextlib.nullcontext()
