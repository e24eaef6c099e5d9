"""
Peak memory of one GRPO update at a real checkpoint's shapes (Qwen2.5-0.5B by default, random
weights), with and without the fused log-prob path and gradient checkpointing: what
--grad_checkpoint and model.token_logprobs buy.

    python bench/memory.py                  # CPU: 5 processes (~20 min on 2 cores)
    python bench/memory.py --device cuda --rows 32 --completion_len 1024 --grad_accum 4  # gpu.py's
    python bench/memory.py --lora_rank 16   # full fine-tuning against LoRA (fused, checkpointing)

One update is grpo.py's steps 2 and 4 on one batch of random tokens (sampling is not measured).
Step 2 scores without gradient, per micro-batch, as grpo.py does: each model's forward once, the old
and reference log-probs, the exact KL and the entropy a chunk of positions at a time; and, for
contrast, through both models' [B, T, V] logits. Step 4, per micro-batch: the policy's log-probs
with gradient (model.completion_logprobs, through the logits or fused), grpo_loss, backward; then
AdamW's step. Each phase runs in a fresh process of its own (an allocator keeps what an earlier
phase freed), and its peak is on CUDA torch.cuda.max_memory_allocated, on the CPU the peak resident
memory (VmHWM, restarted through /proc/self/clear_refs once the models are built). "State" is the
memory in use before the update: both models' weights and AdamW's two moments, which no path
changes. With --lora_rank the table compares full fine-tuning with LoRA (lora.py, every projection):
the reference is the policy's own weights with the adapters off, AdamW's moments are the adapters'.
The README recipe's own peak, by owner and phase, with the sampler and the reference as grpo.py
keeps them: bench/recipe.py (its ledger; results/gpu.md, issue 49).
"""
import argparse
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from grpo import grpo_advantages, grpo_loss  # noqa: E402
from kernels import entropy, kl, logprobs  # noqa: E402
from lora import add_adapters, base_model, trainable  # noqa: E402
from model import (GPT, GPTConfig, completion_hidden, completion_logits,  # noqa: E402
                   completion_logprobs, kl_entropy)

SHAPES = {   # config.json of each family's checkpoint, as model.pretrained_config reads it
    "qwen2.5-0.5b": dict(vocab_size=151936, block_size=32768, n_layer=24, n_head=14, n_kv_head=2,
                         n_embd=896, mlp_hidden=4864, norm="rmsnorm", norm_eps=1e-6, pos="rope",
                         rope_theta=1e6, mlp="swiglu", bias=False, qkv_bias=True,
                         tie_embeddings=True),
    "gpt2": dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768,
                 gelu="tanh"),
    "qwen2.5-7b": dict(vocab_size=152064, block_size=32768, n_layer=28, n_head=28, n_kv_head=4,
                       n_embd=3584, mlp_hidden=18944, norm="rmsnorm", norm_eps=1e-6, pos="rope",
                       rope_theta=1e6, mlp="swiglu", bias=False, qkv_bias=True,
                       tie_embeddings=False),
    "llama-3.1-8b": dict(vocab_size=128256, block_size=131072, n_layer=32, n_head=32, n_kv_head=8,
                         n_embd=4096, mlp_hidden=14336, norm="rmsnorm", norm_eps=1e-5, pos="rope",
                         rope_theta=5e5, mlp="swiglu", bias=False, tie_embeddings=False),
}
# (log-prob path, checkpointing)
CONFIGS = [("logits", False), ("logits", True), ("fused", False), ("fused", True)]


def peak_reset(device):
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:   # Linux: VmHWM restarts from resident now
            f.write("5")


def peak_gib(device, now=False):
    """The peak since peak_reset (now=True: the current use), GiB."""
    if device == "cuda":
        torch.cuda.synchronize()
        return (torch.cuda.memory_allocated() if now else torch.cuda.max_memory_allocated()) / 2**30
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f
                   if line.startswith("VmRSS" if now else "VmHWM"))
    return kib / 2**20


def one_phase(args, phase, path, checkpointing, lora=0):
    """Step 2 ("score") or step 4 ("update") of grpo.py on one batch, alone in this process (an
    allocator keeps what an earlier phase freed): {"state": GiB in use before it, phase: its peak
    GiB, phase + "_s": its seconds}. lora: a rank (0: full fine-tuning)."""
    torch.manual_seed(0)
    config = GPTConfig(**SHAPES[args.shape])
    policy = GPT(config).to(args.device)
    if lora:
        ref = base_model(add_adapters(policy, lora, 2.0 * lora))  # the same weights, no second copy
    else:
        ref = GPT(config).to(args.device).requires_grad_(False)
    policy.grad_checkpoint = checkpointing
    optimizer = torch.optim.AdamW(trainable(policy), lr=1e-6)
    for p in trainable(policy):          # AdamW's moments exist before the first step in a long run
        optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                              "exp_avg_sq": torch.zeros_like(p)}
    B, Tp, Tn, V = args.rows, args.prompt_len, args.completion_len, config.vocab_size
    prompt, tokens = (torch.randint(0, V, (B, Tp), device=args.device),
                      torch.randint(0, V, (B, Tn), device=args.device))
    prompt_mask, mask = torch.ones(B, Tp, device=args.device), torch.ones(B, Tn, device=args.device)
    rewards = torch.randint(0, 2, (B,), device=args.device).float()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.device == "cuda",
                              cache_enabled=False)
    micro = [torch.arange(i, min(i + -(-B // args.grad_accum), B))
             for i in range(0, B, -(-B // args.grad_accum))]
    old_logp, ref_logp = (-torch.rand(B, Tn, device=args.device),
                          -torch.rand(B, Tn, device=args.device))
    out = {"state": peak_gib(args.device, now=True)}
    peak_reset(args.device)
    start = time.time()
    if phase == "score":
        score(policy, ref, prompt, prompt_mask, tokens, mask, micro, autocast, path)
    else:
        update(policy, optimizer, prompt, prompt_mask, tokens, mask, old_logp, ref_logp, rewards,
               micro, autocast, path == "fused", args.group_size)
    out[phase], out[phase + "_s"] = peak_gib(args.device), time.time() - start
    return out


def score(policy, ref, prompt, prompt_mask, tokens, mask, micro, autocast, path):
    """grpo.py's step 2: without gradient, per micro-batch, both models' log-probs, the exact KL and
    the entropy. path "fused" is grpo.py's: one forward of each model, the log-probs through
    model.head_logprobs, the KL and the entropy a chunk of positions at a time (model.kl_entropy);
    "logits" forms both models' [b, Tn, V] logits, as grpo.py did before (for contrast)."""
    for rows in micro:
        a = (prompt[rows], prompt_mask[rows], tokens[rows], mask[rows])
        with torch.no_grad(), autocast:
            if path == "fused":
                h, h_ref = completion_hidden(policy, *a), completion_hidden(ref, *a)
                policy.head_logprobs(h, tokens[rows]), ref.head_logprobs(h_ref, tokens[rows])
                kl_t, ent_t = kl_entropy(policy, ref, h, h_ref, mask[rows])
                del h, h_ref
            else:
                logits, ref_logits = completion_logits(policy, *a), completion_logits(ref, *a)
                logprobs(logits, tokens[rows]), logprobs(ref_logits, tokens[rows])
                kl(logits, ref_logits).sum(), entropy(logits).sum()
                del logits, ref_logits


def update(policy, optimizer, prompt, prompt_mask, tokens, mask, old_logp, ref_logp, rewards, micro,
           autocast, fused, group_size):
    """grpo.py's step 4: per micro-batch the policy's log-probs with gradient, grpo_loss,
    backward; then AdamW's step."""
    advantages = grpo_advantages(rewards, group_size)
    B = len(rewards)
    for rows in micro:
        with autocast:
            logp = completion_logprobs(policy, prompt[rows], prompt_mask[rows], tokens[rows],
                                       mask[rows], fused=fused)                            # (b, Tn)
        loss, _ = grpo_loss(logp, old_logp[rows], ref_logp[rows], advantages[rows], mask[rows],
                            num_seqs=B, num_tokens=mask.sum())
        loss.backward()
        del logp, loss
    optimizer.step()


# -----------------------------------------------------------------------------
# --ledger: GRPO full fine-tuning's peak per GPU on paper, DDP against --fsdp
# (plumbing/distributed.py)

def counts(shape):
    """Parameter counts of a shape, from the model built on the meta device (no memory): all, the
    blocks' linear layers (bfloat16 in the whole copy and the reference), the root's (embedding,
    final norm, head: one FSDP unit, whole through forward and backward) and the largest block."""
    with torch.device("meta"):
        model = GPT(GPTConfig(**SHAPES[shape]))
    n = lambda ps: sum(p.numel() for p in ps)
    blocks = list(model.blocks)
    return {"all": model.num_params(),
            "linear": n(m.weight for b in blocks for m in b.modules()
                        if isinstance(m, torch.nn.Linear)),
            "root": model.num_params() - n(p for b in blocks for p in b.parameters()),
            "block": max(n(b.parameters()) for b in blocks), "config": model.config}


def ledger_rows(shape, world, rows, tokens, sample_rows):
    """{phase: (GiB per GPU, formula)} for `world` GPUs under DDP and --fsdp: setup (both models
    read whole before the reference drops to bfloat16 and the policy is sharded), sampling (step 1),
    scoring (step 2: the reference on the device), update (step 4, --grad_checkpoint, the fused
    log-prob path, micro-batches of `rows` x `tokens`). P all parameters, L the linear ones, R the
    root's, K one block's, W the world; the activations: the checkpointed block inputs (float32
    residual stream) and one block recomputed in bfloat16 (its projections' outputs and the
    MLP's three), twice over for its backward; the KV cache bfloat16."""
    c, G = counts(shape), 2**30
    P, L, R, K, cfg = c["all"], c["linear"], c["root"], c["block"], c["config"]
    copy = 2 * L + 4 * (P - L)                          # bf16 linears, float32 the rest
    acts = (cfg.n_layer * rows * tokens * cfg.n_embd * 4
            + 2 * rows * tokens * (8 * cfg.n_embd + 3 * cfg.mlp_hidden) * 2)
    kv = sample_rows * tokens * cfg.n_layer * 2 * cfg.kv_heads * cfg.head_size * 2
    ddp = 16 * P                                        # float32 weights, gradients, m, v
    fsdp = 16 * P / world                               # the same, 1/W of each
    gathered = 4 * R * 2 + 4 * K * 3                    # root weights + grads, 2 blocks + 1 grad
    setup = (8 * P, "8P (policy and reference read in float32)")
    out = {"ddp": {"setup": setup, "sample": (ddp + kv, "16P + KV"),
                   "score": (ddp + copy, "16P + ref(2L + 4(P-L))"),
                   "update": (ddp + acts, "16P + activations")},
           "fsdp": {"setup": setup, "sample": (fsdp + copy + kv, "16P/W + copy(2L + 4(P-L)) + KV"),
                    "score": (fsdp + 2 * copy, "16P/W + copy + ref"),
                    "update": (fsdp + copy + gathered + acts,
                               "16P/W + copy + 8R + 12K + activations")}}
    return {k: {ph: (b / G, f) for ph, (b, f) in v.items()} for k, v in out.items()}, c


def ledger(args):
    print(f"GRPO full fine-tuning, per GPU of {args.gpu_gib:g} GiB, on paper (bench/memory.py "
          f"--ledger): update micro-batches of {args.rows} rows x {args.tokens} tokens "
          f"(--grad_checkpoint, fused log-probs), sampling {args.sample_rows} rows' KV cache")
    print("| model | params | GPUs | engine | setup GiB | sampling GiB | scoring GiB | update GiB "
          "| peak GiB | fits |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    formulas = {}
    for shape in ("qwen2.5-7b", "llama-3.1-8b"):
        for world in (4, 8):
            rows, c = ledger_rows(shape, world, args.rows, args.tokens, args.sample_rows)
            for engine in ("ddp", "fsdp"):
                phases = rows[engine]
                peak = max(g for g, _ in phases.values())
                formulas[engine] = {ph: f for ph, (_, f) in phases.items()}
                print(f"| {shape} | {c['all'] / 1e9:.2f}B | {world} | "
                      f"{'DDP' if engine == 'ddp' else '--fsdp'} | "
                      + " | ".join(f"{phases[ph][0]:.1f}"
                                   for ph in ("setup", "sample", "score", "update"))
                      + f" | {peak:.1f} | {'yes' if peak <= args.gpu_gib else 'no'} |")
    for engine, fs in formulas.items():
        print(f"{engine}: " + "; ".join(f"{ph} {f}" for ph, f in fs.items()))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--rows", type=int, default=8, help="completions in the batch (P x G)")
    p.add_argument("--group_size", type=int, default=4, help="G (divides --rows)")
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--completion_len", type=int, default=192)
    p.add_argument("--grad_accum", type=int, default=1, help="micro-batches of each phase")
    p.add_argument("--lora_rank", type=int, default=0,
                   help="compare full fine-tuning with LoRA of this rank")
    p.add_argument("--ledger", action="store_true",
                   help="the per-GPU peak of 7B-8B full fine-tuning under DDP and --fsdp, on paper")
    p.add_argument("--gpu_gib", type=float, default=80.0, help="--ledger: a GPU's memory")
    p.add_argument("--tokens", type=int, default=1280,
                   help="--ledger: prompt + completion tokens of a row")
    p.add_argument("--sample_rows", type=int, default=64,
                   help="--ledger: rows sampled at once on a GPU (their KV cache)")
    p.add_argument("--config", default=None,
                   help="internal: one phase, 'phase,path,checkpointing,lora'")
    args = p.parse_args(argv)
    if args.lora_rank < 0:
        p.error(f"--lora_rank {args.lora_rank}; allowed: 0 (the log-prob paths' table) or a rank")
    for name in ("rows", "group_size", "prompt_len", "completion_len", "grad_accum"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)}; allowed: at least 1")
    if args.rows % args.group_size:
        p.error(f"--rows {args.rows} is not a multiple of --group_size {args.group_size}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available here")
    if args.device == "cpu" and not os.path.exists("/proc/self/clear_refs"):
        p.error("--device cpu measures peak resident memory through /proc (Linux); "
                "use a Linux machine or CUDA")
    return args


def child(flags, phase, path, checkpointing, lora=0):
    p = subprocess.run([sys.executable, __file__, *flags,
                        "--config", f"{phase},{path},{int(checkpointing)},{lora}"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"error: the {phase} phase ({path}, checkpointing {checkpointing}) "
                         f"failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(args):
    if args.ledger:
        ledger(args)
        return
    if args.config:                                    # a child: one phase, one JSON line
        phase, path, checkpointing, lora = args.config.split(",")
        print(json.dumps(one_phase(args, phase, path, checkpointing == "1", int(lora))))
        return
    flags = sys.argv[1:]
    print(f"one GRPO update at {args.shape}'s shapes, "
          f"{args.rows} rows x ({args.prompt_len} + {args.completion_len}) tokens, "
          f"{args.grad_accum} micro-batch(es), {args.device}, torch {torch.__version__}")
    if args.lora_rank:
        print("| fine-tuning | state GiB | scoring (step 2) peak GiB | "
              "update (step 4) peak GiB | update seconds |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for lora in (0, args.lora_rank):
            s, r = (child(flags, "score", "fused", True, lora),
                    child(flags, "update", "fused", True, lora))
            print(f"| {f'LoRA rank {lora}, every projection' if lora else 'full'} "
                  f"| {r['state']:.2f} | {s['score']:.2f} | {r['update']:.2f} | "
                  f"{r['update_s']:.0f} |", flush=True)
        return
    for path in ("logits", "fused"):         # step 2: no gradient, so checkpointing changes nothing
        s = child(flags, "score", path, False)
        through = ("[B, T, V] logits" if path == "logits"
                   else "fused path, a chunk of logits at a time")
        print(f"state (weights of both models, AdamW's moments) {s['state']:.2f} GiB; "
              f"scoring (step 2) through the {through}: peak {s['score']:.2f} GiB, "
              f"{s['score'] - s['state']:.2f} above the state, {s['score_s']:.0f} s", flush=True)
    print("| log-prob path | --grad_checkpoint | update (step 4) peak GiB | "
          "above the state GiB | seconds |")
    print("| --- | --- | ---: | ---: | ---: |")
    for path, checkpointing in CONFIGS:
        r = child(flags, "update", path, checkpointing)
        print(f"| {path} | {'on' if checkpointing else 'off'} | {r['update']:.2f} | "
              f"{r['update'] - r['state']:.2f} | {r['update_s']:.0f} |", flush=True)


if __name__ == "__main__":
    main(parse_args())
