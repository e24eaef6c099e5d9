"""
Sampling speed: three ways to generate the same tokens, measured side by side in one run, same model,
same prompts, same number of new tokens.
- recompute: run the whole (growing) sequence through the model for every new token, as nanoGPT's
  `generate` does;
- KV cache: model.GPT.generate, each new token costs one position's work;
- KV cache, compiled: GPT.generate(compile=True), the per-token step with static shapes under
  torch.compile (a CUDA graph on a GPU). Its compile time (the first call) is reported separately.
Greedy decoding, so all three must produce the same tokens (checked), and a sampled run at
temperature 1 with the same generator seed checks that the compiled sampler draws what the eager one does.

    python bench/generate.py                    # default model size, 64 prompts, 64 new tokens
    python bench/generate.py --new_tokens 16 --batch 8
    python bench/generate.py --device cuda --batch 256      # bfloat16 autocast on a GPU, as the scripts sample
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import task  # noqa: E402
from model import GPT, GPTConfig, Tokenizer  # noqa: E402
from plumbing import pick_device  # noqa: E402

parser = argparse.ArgumentParser(description="sampling speed: recompute, KV cache, compiled KV cache")
parser.add_argument("--batch", type=int, default=64, help="prompts sampled at once (at most 512)")
parser.add_argument("--new_tokens", type=int, default=64, help="tokens generated per prompt")
parser.add_argument("--repeats", type=int, default=3, help="timed repetitions of each method (best is kept)")
parser.add_argument("--device", default=None, help="cuda, mps or cpu (default: the first available)")
parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="bfloat16: under bfloat16 autocast, as the scripts sample on a GPU (default: bfloat16 "
                         "on cuda, else float32)")
parser.add_argument("--no_compile", action="store_true", help="skip the compiled sampler")
parser.add_argument("--threads", type=int, default=0, help="CPU: torch threads (0: torch's default)")
args = parser.parse_args()
if not (1 <= args.batch <= len(task.eval_prompts()) and 1 <= args.new_tokens <= 64 and args.repeats >= 1):
    raise SystemExit(f"error: --batch {args.batch} --new_tokens {args.new_tokens} --repeats {args.repeats}; allowed: "
                     f"1 <= batch <= {len(task.eval_prompts())}, 1 <= new_tokens <= 64, repeats >= 1")

device = pick_device(args.device)
if args.threads > 0:
    torch.set_num_threads(args.threads)
dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=dtype == "bfloat16")
torch.manual_seed(0)
tok = Tokenizer()
model = GPT(GPTConfig(block_size=128)).to(device).eval()  # the default SFT size, long enough for 64 new tokens
prompts, mask = tok.encode_batch(task.eval_prompts()[:args.batch], device)
NEVER = -1  # an EOS id that never occurs, so every method generates exactly new_tokens tokens


@torch.no_grad()
def recompute(idx, idx_mask, n):
    """nanoGPT-style: run the whole (growing) sequence through the model for every new token."""
    out = []
    for _ in range(n):
        with autocast:
            nxt = model(idx, idx_mask)[:, -1].argmax(-1, keepdim=True)   # (B, 1)
        out.append(nxt)
        idx = torch.cat([idx, nxt], 1)
        idx_mask = torch.cat([idx_mask, torch.ones_like(idx_mask[:, :1])], 1)
    return torch.cat(out, 1)


def sample(compile, temperature=0.0, seed=None):
    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    with autocast:
        return model.generate(prompts, mask, args.new_tokens, NEVER, temperature=temperature, generator=generator,
                              compile=compile)[0]


def sync():
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn):
    """(first call's seconds, best of --repeats further calls' seconds, result)."""
    sync()
    t = time.perf_counter()
    fn()                                   # warm-up (for the compiled sampler: compilation)
    sync()
    first, best, result = time.perf_counter() - t, float("inf"), None
    for _ in range(args.repeats):
        sync()
        t = time.perf_counter()
        result = fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return first, best, result


_, t_cache, cached = timed(lambda: sample(compile=False))
_, t_full, full = timed(lambda: recompute(prompts, mask, args.new_tokens))
rows = lambda a, b: f"{int((a == b).all(1).sum())}/{a.size(0)} rows"
n = args.batch * args.new_tokens
print(f"device {device}, {dtype}, {model.num_params() / 1e6:.2f}M parameters, batch {args.batch}, "
      f"{args.new_tokens} new tokens, torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
print(f"same greedy tokens, KV cache and recompute: {torch.equal(cached, full)} ({rows(cached, full)})")
if not args.no_compile:
    t_first, t_comp, compiled = timed(lambda: sample(compile=True))
    eager_sampled, compiled_sampled = sample(False, 1.0, seed=1), sample(True, 1.0, seed=1)
    print(f"same greedy tokens, compiled and KV cache: {torch.equal(compiled, cached)} ({rows(compiled, cached)})")
    print(f"same sampled tokens (temperature 1, same generator seed), compiled and KV cache: "
          f"{torch.equal(compiled_sampled, eager_sampled)} ({rows(compiled_sampled, eager_sampled)})")
print(f"recompute all:      {n / t_full:10,.0f} tokens/s")
print(f"KV cache:           {n / t_cache:10,.0f} tokens/s   {t_full / t_cache:5.1f}x recompute")
if not args.no_compile:
    print(f"KV cache, compiled: {n / t_comp:10,.0f} tokens/s   {t_full / t_comp:5.1f}x recompute, "
          f"{t_cache / t_comp:.2f}x KV cache   (first call, compiling: {t_first:.1f} s)")
