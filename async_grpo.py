"""
Asynchronous GRPO: actors sample while a learner trains, with an importance-sampling correction.

grpo.py alternates: sample, then learn, then sample. Here K actors (--actors) sample groups
continuously with a copy of the weights, score them with the verifier and send them to one
learner, which trains on them and publishes new weights every --sync_every steps; generation and
learning overlap. The price is staleness: a group sampled with weights `lag` versions old is
off-policy, so each token's loss is weighted by rho = pi_theta / mu, mu the policy that sampled it,
truncated or masked where rho is far from 1. LlamaRL (arXiv 2505.24034), AReaL (arXiv 2505.24298),
PipelineRL and verl's async mode share this layout. `truncate` caps the ratio, min(rho, C), as
IMPALA's truncated importance weight (Espeholt et al. 2018, arXiv 1802.01561) and AReaL's capped
behaviour weight (Yao et al. 2025's TIS, for the sampler/trainer mismatch at lag 0); `mask` drops
the tokens whose rho leaves [1/C, C], as IcePop (Ant Group's Ring team, 2025) does for that
mismatch. A dropped token still counts in 1/|o_i| and keeps no KL term (its whole term weighs 0).

Learner step on P groups (GRPO, Shao et al. 2024, arXiv 2402.03300, eq. 3, mu = 1), token t of o_i:
    A_i = (r_i - mean_g r) / (std_g r + eps)
    w_it = 1 (none), min(rho_it, C) (truncate), 1[1/C <= rho_it <= C] (mask)
    L = 1/G sum_i 1/|o_i| sum_t sg(w_it) [ -rho'_it A_i + beta KL_it ],   rho' = pi / sg(pi) = 1
At one pass per batch rho' is 1 (its gradient is grad log pi): AReaL's decoupled objective with the
proximal policy equal to the current one. w is detached: the behaviour log-probs are the sampler's.

Staleness is bounded by admission, not discarding: an actor samples learner step s's groups (P/K
of them, in order) only with weights of version >= s - --max_lag, else waits for a publication
(AReaL's and the Tinker cookbook's rule); --max_lag 0 is synchronous GRPO in two processes.

Deviations and choices:
- One message per actor per learner step (its P/K groups), over gloo through host memory; weights
  go as one flat float32 vector. One pass per batch (no --mu); no family options (grpo.py's).
- Which weight version samples which step depends on timing: runs are not bit-reproducible.
- --resume restores the learner (weights, optimiser, step = version, random states); the actors
  restart, the groups in flight are dropped. A dead actor stops the run with its exit code.

Shapes: P prompts per learner step, G completions each, B = P*G rows; T completion tokens; K actors.
Run (out/sft.pt built first if missing):
    python async_grpo.py                         # 1 actor + 1 learner, local processes
    python async_grpo.py --actors 3 --max_lag 2 --is_correction mask
    torchrun --nproc_per_node 4 async_grpo.py --actors 3     # rank 0 the learner, 1..3 the actors
Metrics: out/async_grpo/metrics.jsonl (docs/metrics.md); checkpoint out/async_grpo.pt.
"""
import contextlib
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import task
from kernels import invariant, kl_penalty
from lora import merge, trainable
from model import completion_logprobs
from plumbing import Run
from plumbing.flags import SFT_PATH, TEMPERATURE, Float, Int, add_run_flags, parser
from plumbing.loading import autocast, load_model, pick_device

CHUNK, WEIGHTS = 1, 2      # message tags: actor -> learner groups, learner -> actor weights
GROUPS, GOODBYE, STOP = 1.0, 2.0, -1.0


# -----------------------------------------------------------------------------
# The algorithm: GRPO's advantages and loss, each token weighted by its importance weight

def importance_weights(logp, behaviour_logp, mask, mode="truncate", cap=2.0):
    """Per-token importance weights (B, T), detached, for tokens sampled from a behaviour policy mu
    and trained under pi_theta: rho = exp(logp - behaviour_logp); "none": 1; "truncate":
    min(rho, cap) (TIS); "mask": 1 where 1/cap <= rho <= cap, else 0. 0 where mask is 0 (a NaN there
    never leaks); a NaN log-prob gives a NaN weight."""
    if mode not in ("none", "truncate", "mask"):
        raise ValueError(f"mode {mode!r} is unknown; allowed: 'none', 'truncate', 'mask'")
    real = mask > 0
    rho = torch.exp(torch.where(real, logp.detach() - behaviour_logp, 0.0))   # (B, T) pi_theta / mu
    if mode == "none":
        w = torch.ones_like(rho)
    elif mode == "truncate":
        w = torch.clamp(rho, max=cap)                                           # min(rho, C)
    else:
        w = ((rho >= 1 / cap) & (rho <= cap)).float()                           # 1[1/C <= rho <= C]
    w = torch.where(torch.isnan(rho), rho, w)                                   # NaN stays NaN
    return torch.where(real, w, 0.0)


def grpo_advantages(rewards, group_size, eps=1e-6):
    """rewards (P*G,) -> (P*G,): (r - mean_g) / (std_g + eps), population std, 0 for a group of
    equal rewards."""
    r = rewards.view(-1, group_size)                                   # (P, G)
    advantages = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True, unbiased=False) + eps)
    all_equal = (r == r[:, :1]).all(dim=1, keepdim=True)
    return torch.where(all_equal, torch.zeros_like(advantages), advantages).view(-1)


def async_grpo_loss(logp, ref_logp, advantages, weights, mask, beta=0.04, num_seqs=None):
    """GRPO's loss at one pass per batch with per-token importance weights: logp (B, T) with grad;
    ref_logp (B, T); advantages (B,); weights (B, T) detached (importance_weights); mask (B, T).
    num_seqs: the step's completions when this is a micro-batch. Returns (loss, metrics as detached
    tensors)."""
    real = mask > 0
    logp, ref_logp = torch.where(real, logp, 0.0), torch.where(real, ref_logp, 0.0)
    ratio = torch.exp(logp - logp.detach())                     # rho' = pi_theta / sg(pi_theta) = 1
    pg = -ratio * advantages[:, None]                               # (B, T) gradient -A grad log pi
    kl_t = kl_penalty(logp, ref_logp, "k3")                            # (B, T) KL_it
    per_token = torch.where(real, weights * (pg + beta * kl_t), 0.0)   # w_it [ ... ]
    n_seqs = mask.size(0) if num_seqs is None else num_seqs
    loss = (per_token.sum(1) / mask.sum(1).clamp(min=1)).sum() / n_seqs   # 1/G sum_i 1/|o_i| sum_t
    return loss, {"kl_k3": torch.where(real, kl_t.detach(), 0.0).sum()}


# -----------------------------------------------------------------------------
# Hyperparameters

def parse_args(argv=None):
    p = parser(__doc__)
    g = p.add_argument_group("algorithm")
    g.add_argument("--group_size", type=Int(ge=2), default=8,
                   help="G: completions sampled per prompt")
    g.add_argument("--beta", type=Float(ge=0), default=0.04,
                   help="weight of the KL-to-reference penalty in the loss")
    g.add_argument("--is_correction", default="truncate", choices=["none", "truncate", "mask"],
                   help="per-token importance weight for stale tokens: none, min(rho, C), or "
                        "drop rho outside [1/C, C]")
    g.add_argument("--is_cap", type=Float(gt=1), default=2.0, help="C of --is_correction")
    g = p.add_argument_group("actors and staleness")
    g.add_argument("--actors", type=Int(ge=1), default=1,
                   help="K: sampling processes (one learner besides them)")
    g.add_argument("--max_lag", type=Int(ge=0), default=1,
                   help="the most weight versions a group's sampler may be behind the step that "
                        "trains on it")
    g.add_argument("--sync_every", type=Int(ge=1), default=1,
                   help="publish the weights every this many steps")
    g.add_argument("--threads", type=Int(ge=1), default=None,
                   help="torch threads per process (default: OMP_NUM_THREADS, else the CPU's "
                        "cores over K + 1)")
    g = p.add_argument_group("sampling")
    g.add_argument("--steps", type=Int(ge=1), default=50, help="learner steps (P groups each)")
    g.add_argument("--prompts_per_step", type=Int(ge=1), default=32,
                   help="P: groups per learner step")
    g.add_argument("--temperature", type=TEMPERATURE, default=1.0,
                   help="sampling temperature; log-probs use the same")
    g.add_argument("--max_new_tokens", type=Int(ge=1), default=None,
                   help="longest completion (default: the task's)")
    g.add_argument("--precedence_share", type=Float(ge=0, le=1), default=None,
                   help="share of problems where precedence matters (default: the task's; "
                        "arithmetic: 0.5)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=Float(gt=0), default=3e-4, help="AdamW learning rate (constant)")
    g.add_argument("--grad_clip", type=Float(gt=0), default=1.0,
                   help="clip the gradient's global norm to this")
    g = add_run_flags(p, "async_grpo", log_every=5, eval_every=10)
    g.add_argument("--init", default=SFT_PATH,
                   help="SFT checkpoint: the starting policy and the frozen reference")
    args = p.parse_args(argv)
    if args.prompts_per_step % args.actors:
        p.error(f"--prompts_per_step {args.prompts_per_step} must split evenly over "
                f"--actors {args.actors}")
    if args.compile:
        p.error("--compile is not supported by async_grpo.py (each actor would compile its "
                "own sampler)")
    # step s needs version >= s - max_lag; the newest may be s - sync_every + 1
    if args.sync_every > args.max_lag + 1:
        p.error(f"--sync_every {args.sync_every} with --max_lag {args.max_lag}: an actor would "
                f"wait for weights the learner publishes only every {args.sync_every} steps, "
                f"and the learner for that actor's groups; allowed: "
                f"--sync_every <= --max_lag + 1 = {args.max_lag + 1}")
    return args


# -----------------------------------------------------------------------------
# Messages: a step's groups, and the weights, as flat float32 tensors of fixed size (token ids <
# 2^24 are exact)

def chunk_size(args, Tp, Tn):
    """Floats in one actor's message: header (kind, version, step, sampling seconds, seconds since
    its last message), then per row the prompt and its mask (Tp each), tokens, mask, behaviour
    log-probs (Tn each), reward, correct, truncated."""
    return 5 + args.prompts_per_step // args.actors * args.group_size * (2 * Tp + 3 * Tn + 3)


def pack(batch, behaviour_logp, kind, version, step, sample_s, cycle_s, size, Tp, Tn, pad_id):
    """A Rollout and its behaviour log-probs -> one message (size,), prompts left-padded to Tp,
    completions right-padded to Tn."""
    msg = torch.zeros(size)
    msg[:5] = torch.tensor([kind, version, step, sample_s, cycle_s])
    if batch is not None:
        left = lambda x, v: torch.nn.functional.pad(x.float().cpu(), (Tp - x.size(1), 0), value=v)
        right = lambda x, v: torch.nn.functional.pad(x.float().cpu(), (0, Tn - x.size(1)), value=v)
        parts = [left(batch.prompt, pad_id), left(batch.prompt_mask, 0),
                 right(batch.tokens, pad_id), right(batch.mask, 0), right(behaviour_logp, 0),
                 batch.rewards.float().cpu()[:, None], batch.correct.float().cpu()[:, None],
                 batch.truncated.float().cpu()[:, None]]
        rows = torch.cat(parts, 1).flatten()                           # (n * (2Tp + 3Tn + 3),)
        msg[5:5 + rows.numel()] = rows
    return msg


def unpack(msgs, Tp, Tn, device):
    """Messages -> (task.Rollout, behaviour log-probs (B, Tn), versions (B,)), trimmed to the
    longest rows."""
    width = 2 * Tp + 3 * Tn + 3
    rows = torch.cat([m[5:].view(-1, width) for m in msgs]).to(device)            # (B, width)
    version = torch.cat([m[1].expand(len(m[5:]) // width) for m in msgs]).to(device)
    prompt, prompt_mask = rows[:, :Tp].long(), rows[:, Tp:2 * Tp]
    tokens, mask, logp = (rows[:, 2 * Tp:2 * Tp + Tn].long(), rows[:, 2 * Tp + Tn:2 * Tp + 2 * Tn],
                          rows[:, -Tn - 3:-3])
    start = int((prompt_mask.sum(0) == 0).sum())                        # all-padding prompt columns
    end = int((mask.sum(0) > 0).sum())                                  # completion columns in use
    batch = task.Rollout(prompt[:, start:], prompt_mask[:, start:], tokens[:, :end], mask[:, :end],
                         rows[:, -1] > 0, rows[:, -3], rows[:, -2] > 0)
    return batch, logp[:, :end], version


# -----------------------------------------------------------------------------
# An actor: sample the groups of each learner step with the newest weights it may use, send them

def receiver(src, tag, size, inbox, last_kinds):
    """A thread that receives messages of `size` floats from rank `src` and puts them on `inbox` (a
    queue.Queue, whose put waits while it is full: a bounded buffer), until one whose kind is in
    `last_kinds`; None when `src` is gone. (Blocking receives in a thread: gloo's non-blocking ones
    report nothing until waited on.)"""
    def loop():
        try:
            while True:
                msg = torch.zeros(size)
                dist.recv(msg, src=src, tag=tag)
                inbox.put(msg)
                if msg[0] in last_kinds:
                    return
        except RuntimeError:                        # the connection closed: the peer died
            inbox.put(None)
    threading.Thread(target=loop, daemon=True).start()


def leave_with(parent):
    """End this actor within 0.5 s of its learner, wherever its main thread is waiting."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def actor(args, rank):
    # Ctrl-C under torchrun reaches every process: the learner decides
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    task.use(args)
    device = pick_device(args.device)
    if device == "cuda" and torch.cuda.device_count() > 1:
        device = f"cuda:{rank % torch.cuda.device_count()}"
    dist.barrier()                              # the learner has built or checked what --init names
    date = [None]
    dist.broadcast_object_list(date, src=0)     # --chat: the day its template writes, the learner's
    policy, tok, _ = load_model(args.init, device, "gpt", chat_date=date[0])
    if args.batch_invariant:        # the learner's mode (the learner has checked that it serves)
        invariant.enable()
    # sample under the autocast the learner scores under (plumbing.Run.autocast: bfloat16 on a GPU),
    # so that at lag 0 the importance weight measures staleness and the sampler's numerics only, not
    # a precision gap as well
    sample_precision = autocast(device)
    per_actor = args.prompts_per_step // args.actors
    Tp, Tn = task.max_prompt_tokens(tok), args.max_new_tokens
    parent, local = os.getppid(), "TORCHELASTIC_RUN_ID" not in os.environ
    if local:                                    # the learner started this process
        threading.Thread(target=leave_with, args=(parent,), daemon=True).start()
    inbox = queue.Queue()                # the learner's publications: (kind, version) + the weights
    receiver(0, WEIGHTS, parameters_to_vector(policy.parameters()).numel() + 2, inbox, (STOP,))

    def newest_weights(block):
        """Load the newest publication received (block: wait for one if there is none). False:
        stop."""
        nonlocal version
        latest = None
        while latest is None or not inbox.empty():
            try:
                msg = inbox.get(timeout=0.5) if block and latest is None else inbox.get_nowait()
            except queue.Empty:
                if not block:
                    break
                continue
            if msg is None or msg[0] == STOP:
                return False
            latest = msg
        if latest is not None:
            version = int(latest[1])
            vector_to_parameters(latest[2:].to(device), policy.parameters())
        return True

    version = -1
    going = newest_weights(block=True)                             # the learner's starting weights
    step = version                                                 # the learner step sampled for
    rng = random.Random(f"{args.seed}-{rank}-{step}")              # this actor's prompt stream
    gen = torch.Generator(device=device).manual_seed(args.seed * 1000 + rank + 100_000 * step)
    t_last = time.time()
    while going:
        # admission: the groups of learner step `step` need weights of version >= step - max_lag
        going = newest_weights(block=False)
        while going and step - version > args.max_lag:
            going = newest_weights(block=True)
        if not going:
            break
        t = time.time()
        prompts = task.sample_prompts(rng, per_actor, args.precedence_share)
        with torch.no_grad(), sample_precision:                    # the learner's precision
            # logp (n, Tn): the sampler's own
            batch, logp, _ = task.rollout(policy, tok, prompts, args.group_size,
                                          args.temperature, Tn, 0.0, gen, return_logprobs=True)
        now = time.time()
        try:
            dist.send(pack(batch, logp, GROUPS, version, step, now - t, now - t_last,
                           chunk_size(args, Tp, Tn), Tp, Tn, tok.pad_id), dst=0, tag=CHUNK)
        except RuntimeError:              # the connection closed: the learner is gone, and says why
            return
        t_last = now
        step += 1
    with contextlib.suppress(RuntimeError):         # the learner may be gone already
        dist.send(pack(None, None, GOODBYE, version, step, 0, 0, chunk_size(args, Tp, Tn), Tp, Tn,
                       tok.pad_id), dst=0, tag=CHUNK)                             # the last message


# -----------------------------------------------------------------------------
# The learner

class Actors:
    """The learner's side of the actors: a bounded buffer of received steps per actor (max_lag + 1
    deep, the most an actor can be ahead), the weights it publishes, and the local actor processes
    it started (their exit codes)."""

    def __init__(self, args, size, procs, run):
        self.procs, self.run = procs, run
        self.buffers = {a: queue.Queue(maxsize=args.max_lag + 1) for a in range(1, args.actors + 1)}
        for a, inbox in self.buffers.items():
            receiver(a, CHUNK, size, inbox, (GOODBYE,))

    def queued(self):
        """Steps received and not yet trained on, over every actor."""
        return sum(inbox.qsize() for inbox in self.buffers.values())

    def check_alive(self):
        for a, p in enumerate(self.procs, 1):
            if p.poll() is not None:
                raise SystemExit(f"error: actor {a} (pid {p.pid}) exited with "
                                 f"code {p.returncode} at learner step {self.run.step}; the run "
                                 f"stops (last checkpoint: {self.run.ckpt_path})")

    def take(self, a):
        """Actor a's next message, waiting for it; None on Ctrl-C."""
        while True:
            try:
                msg = self.buffers[a].get(timeout=0.1)
            except queue.Empty:
                self.check_alive()
                if self.run.interrupted:
                    return None
                continue
            if msg is None:                         # its connection closed
                self.gone(a)
            return msg

    def gone(self, a):
        """Actor a's connection closed: stop the run, with a local actor's exit code where there is
        one."""
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=0.1 * len(self.procs) + 1)
        self.check_alive()
        raise SystemExit(f"error: actor {a} is gone (its connection closed) at learner "
                         f"step {self.run.step}; the run stops (last "
                         f"checkpoint: {self.run.ckpt_path})")

    def next_step(self):
        """One message from each actor, in order: the P groups of the next step (None on Ctrl-C)."""
        msgs = [self.take(a) for a in self.buffers]
        return None if any(m is None for m in msgs) else msgs

    def publish(self, policy, version, stop=False):
        """Send the weights to every actor (--lora_rank: merged, W + (alpha / r) B A: an actor holds
        a plain model)."""
        self.check_alive()
        weights = merge(policy) if getattr(policy, "lora", None) else policy
        flat = torch.cat([torch.tensor([STOP if stop else GROUPS, float(version)]),
                          parameters_to_vector(weights.parameters()).detach().float().cpu()])
        for a in self.buffers:
            try:
                dist.send(flat, dst=a, tag=WEIGHTS)
            except RuntimeError:        # it died after check_alive: the same one line, no traceback
                self.gone(a)

    def stop(self, policy, version):
        """Tell every actor to stop, and take what they still send until each one's goodbye."""
        self.publish(policy, version, stop=True)
        for a, inbox in self.buffers.items():
            msg = inbox.get(timeout=600)
            while msg is not None and msg[0] != GOODBYE:
                msg = inbox.get(timeout=600)
        for p in self.procs:
            p.wait(timeout=60)


def learner(args, procs):
    # lock, log, resume: plumbing/run.py
    run = Run("async_grpo", args, batch_flag="prompts_per_step", solo=True)
    policy, tok = run.load_policy(args.init)        # the policy starts as the SFT policy ...
    ref = run.reference(args.init, policy)          # ... which stays frozen as the reference
    run.check_lengths(policy, tok, args.max_new_tokens)
    optimizer = torch.optim.AdamW(trainable(policy), lr=args.lr, betas=(0.9, 0.99))
    run.resume(policy, optimizer)
    dist.barrier()                                  # the actors may load --init now
    dist.broadcast_object_list([run.chat_date], src=0)
    P, G, K, temp = args.prompts_per_step, args.group_size, args.actors, args.temperature
    Tp, Tn = task.max_prompt_tokens(tok), args.max_new_tokens
    actors = Actors(args, chunk_size(args, Tp, Tn), procs, run)
    actors.publish(policy, run.step)       # version = learner steps taken; the actors start from it
    run.print(f"async GRPO: {policy.num_params() / 1e6:.2f}M parameters on {run.device}, {K} "
              f"actor(s) + 1 learner, {torch.get_num_threads()} thread(s) each, {args.steps} "
              f"steps of {P} prompts x {G} samples, max lag {args.max_lag}, sync "
              f"every {args.sync_every}, IS correction {args.is_correction} (C "
              f"= {args.is_cap}), beta {args.beta}")
    if not args.resume:                                 # a fresh run: the starting policy is step 0
        run.log_start(run.evaluate(policy, tok))
    busy, sampled, t_window = 0.0, [], time.time()
    while run.training():
        # 1. the step's groups from the buffer: P/K from each actor, sampled with weights `lag`
        #    versions old
        queued = actors.queued()
        msgs = actors.next_step()
        if msgs is None:                            # Ctrl-C while waiting
            break
        t_busy = time.time()
        batch, behaviour_logp, version = unpack(msgs, Tp, Tn, run.device)
        # (B, Tp), (B, Tn), (B,); B = P*G
        prompt, prompt_mask, tokens, mask, truncated, rewards, _ = batch
        lag = run.step - version                                          # (B,) versions behind
        run.samples += P * G
        # each actor's sampling and wall seconds
        sampled += [(float(m[3]), float(m[4])) for m in msgs]

        # 2. advantages: the group is the baseline
        advantages = grpo_advantages(rewards, G)                          # (B,)

        # 3. one pass of the loss over the --grad_accum micro-batches, each token weighted by
        #    pi_theta / mu
        loss, kl_sum, n_tokens = 0.0, 0.0, mask.sum()
        weights, log_rho = torch.zeros_like(mask), torch.zeros_like(mask)
        for rows in run.micro_batches(len(mask)):
            with torch.no_grad(), run.autocast:                                 # (b, Tn) log pi_ref
                ref_logp = completion_logprobs(ref, prompt[rows], prompt_mask[rows], tokens[rows],
                                               mask[rows], temp)
            with run.autocast:                                                # (b, Tn) log pi_theta
                logp = completion_logprobs(policy, prompt[rows], prompt_mask[rows], tokens[rows],
                                           mask[rows], temp)
            w = importance_weights(logp, behaviour_logp[rows], mask[rows], args.is_correction,
                                   args.is_cap)
            part, part_stats = async_grpo_loss(logp, ref_logp, advantages[rows], w, mask[rows],
                                               args.beta, num_seqs=len(mask))
            run.check_finite(part, f"lower --lr (now {args.lr})")
            part.backward()
            loss, kl_sum = loss + part.detach(), kl_sum + part_stats["kl_k3"]
            weights[rows], log_rho[rows] = w, logp.detach() - behaviour_logp[rows]    # (b, Tn) each
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        run.step += 1
        run.tokens += int(n_tokens)
        if run.step % args.sync_every == 0 and run.step < run.total_steps:
            actors.publish(policy, run.step)        # the actors take it before their next groups
        busy += time.time() - t_busy

        # 4. log, evaluate, checkpoint
        if run.log_due():
            real = mask > 0
            fresh = real & (lag[:, None] == 0)                 # sampled with the weights trained on
            window, cap = time.time() - t_window, torch.tensor(args.is_cap).log()
            groups = rewards.view(-1, G)
            metrics = {"loss": loss.item(), "reward_mean": rewards.mean().item(),
                       "zero_var_groups": (groups == groups[:, :1]).all(1).float().mean().item(),
                       "kl_k3": kl_sum.item() / max(n_tokens.item(), 1),
                       "lag_mean": lag.float().mean().item(), "lag_max": int(lag.max()),
                       "is_weight_mean": weights[real].mean().item(),
                       "rho_above_cap": (log_rho[real] > cap).float().mean().item(),
                       "rho_outside_band": (log_rho[real].abs() > cap).float().mean().item(),
                       "logp_gap_lag0": (log_rho[fresh].abs().mean().item() if fresh.any()
                                         else float("nan")),
                       # the sampler against the trainer, the same weights (--batch_invariant: 0.0)
                       "sampler_logp_diff": (log_rho[fresh].abs().max().item() if fresh.any()
                                             else float("nan")),
                       "queue": queued,
                       "actor_busy": (sum(s for s, _ in sampled)
                                      / max(sum(w for _, w in sampled), 1e-9)),
                       "learner_busy": busy / max(window, 1e-9),
                       "completions_per_sec": len(sampled) // K * P * G / max(window, 1e-9),
                       "completion_len": mask.sum(1).mean().item(),
                       "truncated": truncated.float().mean().item(),
                       "grad_norm": grad_norm.item()}
            busy, sampled, t_window = 0.0, [], time.time()
            if run.eval_due():
                metrics.update(run.evaluate(policy, tok))
            t_window = time.time()                  # evaluation time is not the window's
            run.log(metrics, f"reward {metrics['reward_mean']:.3f} | "
                             f"lag {metrics['lag_mean']:.2f} (max {metrics['lag_max']}) | "
                             f"w {metrics['is_weight_mean']:.3f} | queue {queued} | busy "
                             f"actor {metrics['actor_busy']:.2f} "
                             f"learner {metrics['learner_busy']:.2f} "
                             f"| {metrics['completions_per_sec']:.0f} completions/s", tokens=True)
        if run.eval_due():
            run.save(policy, optimizer)
    actors.stop(policy, run.step)                   # every actor says goodbye, the local ones exit
    run.finish(policy, tok, optimizer)


# -----------------------------------------------------------------------------
# Processes: rank 0 the learner, ranks 1..K the actors; `python async_grpo.py` starts its own actors

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous(rank, world, procs):
    """gloo's process group, joined in a thread while this one watches the local actors (and
    Ctrl-C): an actor that dies before every process has joined would otherwise leave the learner
    waiting out gloo's 30-minute timeout."""
    joined = []

    def join():
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world)
            joined.append(True)
        except Exception:                           # noqa: BLE001 - said below, in one line
            pass
    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(timeout=0.1)
        for a, p in enumerate(procs, 1):
            if p.poll() is not None:
                raise SystemExit(f"error: actor {a} (pid {p.pid}) exited with "
                                 f"code {p.returncode} before the processes had met; nothing "
                                 f"was trained")
    if not joined:
        raise SystemExit("error: the processes could not form their group (gloo's "
                         "rendezvous failed)")


def main(args):
    omp, per_process = (os.environ.get("OMP_NUM_THREADS", ""),
                        max(1, (os.cpu_count() or 1) // (args.actors + 1)))
    torch.set_num_threads(args.threads or (int(omp) if omp.isdigit() else per_process))
    procs, held, code = [], [], 0
    try:
        if "RANK" not in os.environ:   # a plain `python async_grpo.py`: this process is the learner
            # Ctrl-C stops it from now on, even if it was
            signal.signal(signal.SIGINT, signal.default_int_handler)
            # started ignoring SIGINT (a script's background job), as Run's handler does once
            # training starts
            env = {**os.environ, "WORLD_SIZE": str(args.actors + 1), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(free_port())}
            os.environ.update(env, RANK="0")
            # The actors in a session of their own: a terminal's Ctrl-C reaches the learner alone,
            # which decides. One that comes while they are spawned is held, then acted on. (Ignoring
            # SIGINT here for them to inherit lost a Ctrl-C that came in that window: the run went
            # on.)
            handler = signal.signal(signal.SIGINT, lambda *_: held.append(True))
            # this process's own command
            cmd = [sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]]
            procs = [subprocess.Popen(cmd, env={**env, "RANK": str(a)}, start_new_session=True)
                     for a in range(1, args.actors + 1)]
            signal.signal(signal.SIGINT, handler)
            if held:
                raise KeyboardInterrupt
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if world != args.actors + 1:
            raise SystemExit(f"error: {world} processes for --actors {args.actors}; allowed: "
                             f"--actors + 1 processes")
        rendezvous(rank, world, procs)
        learner(args, procs) if rank == 0 else actor(args, rank)
    except SystemExit as e:         # a refusal, a dead actor, Ctrl-C: said once, by the learner
        code = e.code if isinstance(e.code, int) else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:       # Ctrl-C while the processes were still meeting: nothing to save
        code = 130
        print("stopped while starting: nothing was trained or written", file=sys.stderr)
    finally:
        for p in procs:             # no actor outlives the learner (and none is left a zombie)
            if p.poll() is None:
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)                  # gloo's threads may outlive a peer that left first


if __name__ == "__main__":
    main(parse_args())
