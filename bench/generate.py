"""
Sampling speed: KV-cache generation (model.GPT.generate) against recomputing the whole sequence
at every step, as nanoGPT's `generate` does. Same model, same prompts, same number of new tokens,
measured side by side in one run; greedy decoding, so both must also produce the same tokens.

    python bench/generate.py                    # default model size, 64 prompts, 64 new tokens
    python bench/generate.py --new_tokens 16 --batch 8
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

parser = argparse.ArgumentParser(description="KV-cache sampling vs full recomputation")
parser.add_argument("--batch", type=int, default=64, help="prompts sampled at once")
parser.add_argument("--new_tokens", type=int, default=64, help="tokens generated per prompt")
parser.add_argument("--repeats", type=int, default=3, help="timed repetitions of each method (best is kept)")
parser.add_argument("--device", default=None, help="cuda, mps or cpu (default: the first available)")
args = parser.parse_args()

device = pick_device(args.device)
torch.manual_seed(0)
tok = Tokenizer()
model = GPT(GPTConfig(block_size=128)).to(device).eval()  # the default SFT size, long enough for 64 new tokens
prompts, mask = tok.encode_batch(task.eval_prompts()[:args.batch], device)
NEVER = -1  # an EOS id that never occurs, so both methods generate exactly new_tokens tokens


@torch.no_grad()
def recompute(idx, idx_mask, n):
    """nanoGPT-style: run the whole (growing) sequence through the model for every new token."""
    out = []
    for _ in range(n):
        nxt = model(idx, idx_mask)[:, -1].argmax(-1, keepdim=True)       # (B, 1)
        out.append(nxt)
        idx = torch.cat([idx, nxt], 1)
        idx_mask = torch.cat([idx_mask, torch.ones_like(idx_mask[:, :1])], 1)
    return torch.cat(out, 1)


def timed(fn):
    fn()  # warm-up, not timed
    best, result = float("inf"), None
    for _ in range(args.repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        result = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best, result


t_cache, (cached, _, _) = timed(lambda: model.generate(prompts, mask, args.new_tokens, NEVER, temperature=0))
t_full, full = timed(lambda: recompute(prompts, mask, args.new_tokens))
n = args.batch * args.new_tokens
print(f"device {device}, {model.num_params() / 1e6:.2f}M parameters, batch {args.batch}, {args.new_tokens} new tokens")
print(f"same greedy tokens: {torch.equal(cached, full)}")
print(f"KV cache:      {n / t_cache:10,.0f} tokens/s")
print(f"recompute all: {n / t_full:10,.0f} tokens/s")
print(f"speed-up:      {t_full / t_cache:.1f}x")
