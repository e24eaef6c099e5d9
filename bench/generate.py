"""
Sampling speed, side by side in one run on the same model, prompts and number of new tokens:
sampler.generate's three modes (eager, a CUDA graph of the fixed-shape step, and that step under
torch.compile), nanoGPT's recompute-everything loop at the toy size, and at a real model's shapes
transformers' `generate` (its default cache and its static, compiled one) where transformers is
installed.

    python bench/generate.py                      # toy model: 64 prompts, 64 new tokens, greedy
    python bench/generate.py --device cuda --batch 256            # bf16 autocast, as scripts sample
    python bench/generate.py --qwen --rows 128 --new_tokens 1024  # Qwen2.5-0.5B's shapes (GPU)

--qwen samples from bench/recipe.py's Qwen2.5-0.5B-shaped folder (random weights, written once): our
GPT under bfloat16 autocast, as the scripts sample, and transformers' Qwen2ForCausalLM in bfloat16
from the same folder, at temperature 1 with no EOS, so every method makes exactly
--new_tokens tokens a row. The floor is one read of the bfloat16 weights and of the KV cache (at its
average length) per token step, at the device's copy bandwidth (measured here). Each method's first
call (compilation, CUDA graph recording) is reported apart from the best of --repeats further calls.
At the toy size, greedy decoding checks that every method makes the same tokens, and a sampled run
at temperature 1 that they draw the same ones from the same generator seed.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sampler  # noqa: E402
import task  # noqa: E402
from hf.checkpoint import from_pretrained  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from plumbing.loading import pick_device  # noqa: E402
from hf.tokenizer import Tokenizer  # noqa: E402

parser = argparse.ArgumentParser(description="sampling speed: the sampler's modes, recompute, "
                                             "transformers")
parser.add_argument("--batch", type=int, default=64,
                    help="toy model: prompts sampled at once (at most 512)")
parser.add_argument("--new_tokens", type=int, default=None,
                    help="tokens generated per row (toy 64, --qwen 256)")
parser.add_argument("--qwen", action="store_true",
                    help="Qwen2.5-0.5B's shapes, random weights (bench/recipe.py)")
parser.add_argument("--rows", type=int, default=128, help="--qwen: rows sampled at once")
parser.add_argument("--prompt_len", type=int, default=64, help="--qwen: prompt tokens per row")
parser.add_argument("--modes", default="eager,graph,compile",
                    help="the sampler modes to time, comma-separated")
parser.add_argument("--no_transformers", action="store_true",
                    help="--qwen: skip transformers' generate")
parser.add_argument("--repeats", type=int, default=2,
                    help="timed repetitions of each method (best is kept)")
parser.add_argument("--device", default=None,
                    help="cuda, mps or cpu (default: the first available)")
parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="bfloat16: under bfloat16 autocast, as the scripts sample on a GPU "
                         "(default: bfloat16 on cuda, else float32)")
parser.add_argument("--threads", type=int, default=0,
                    help="CPU: torch threads (0: torch's default)")
parser.add_argument("--out",
                    default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
                        __file__))), "out", "bench"),
                    help="--qwen: where the folder is written")
args = parser.parse_args()
args.new_tokens = args.new_tokens or (256 if args.qwen else 64)
modes = [m for m in args.modes.split(",") if m]
if (set(modes) - set(sampler.MODES) or args.repeats < 1 or args.new_tokens < 1 or args.rows < 1
    or not 1 <= args.batch <= len(task.eval_prompts()) or (not args.qwen and args.new_tokens > 64)):
    raise SystemExit(f"error: --modes {args.modes} --batch {args.batch} "
                     f"--new_tokens {args.new_tokens} --repeats {args.repeats}; "
                     f"allowed: modes among {', '.join(sampler.MODES)}, "
                     f"1 <= batch <= {len(task.eval_prompts())}, "
                     f"new_tokens >= 1 (toy model: <= 64), repeats >= 1")

device = pick_device(args.device)
if args.threads > 0:
    torch.set_num_threads(args.threads)
dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=dtype == "bfloat16")
NEVER = -1  # an EOS id that never occurs, so every method generates exactly new_tokens tokens


def sync():
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn):
    """(first call's seconds, best of --repeats further calls' seconds, the last result)."""
    sync()
    t = time.perf_counter()
    result = fn()                          # warm-up: compilation, graph recording
    sync()
    first, best = time.perf_counter() - t, float("inf")
    for _ in range(args.repeats):
        sync()
        t = time.perf_counter()
        result = fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return first, best, result


def ours(model, prompts, mask, mode, temperature=1.0, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    with autocast:
        return sampler.generate(model, prompts, mask, args.new_tokens, NEVER,
                                temperature=temperature, generator=g, mode=mode)[0]


def report(name, n, first, best, base=None, against=None):
    extra = f"   {base / best:5.2f}x {against or args.modes.split(',')[0]}" if base else ""
    print(f"{name:<38} {n / best:>10,.0f} tokens/s {1e3 * best / args.new_tokens:>7.2f} "
          f"ms/step   (first call {first:.1f} s){extra}")


def toy():
    torch.manual_seed(0)
    tok = Tokenizer()
    # the default SFT size, long enough for 64 new tokens
    model = GPT(GPTConfig(block_size=128)).to(device).eval()
    prompts, mask = tok.encode_batch(task.eval_prompts()[:args.batch], device)

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

    n = args.batch * args.new_tokens
    print(f"device {device}, {dtype}, {model.num_params() / 1e6:.2f}M parameters, "
          f"batch {args.batch}, {args.new_tokens} new tokens, torch {torch.__version__}, "
          f"{torch.get_num_threads()} CPU threads")
    first, t_full, full = timed(lambda: recompute(prompts, mask, args.new_tokens))
    report("recompute all (nanoGPT)", n, first, t_full)
    for mode in modes:
        first, best, greedy = timed(lambda: ours(model, prompts, mask, mode, temperature=0.0))
        same = torch.equal(greedy, full)
        drawn = torch.equal(ours(model, prompts, mask, mode, seed=1),
                            ours(model, prompts, mask, modes[0], seed=1))
        report(f"sampler, {mode}", n, first, best, t_full, "recompute")
        print(f"{'':<38} greedy tokens = recompute's: {same}; sampled (T = 1) "
              f"= {modes[0]}'s: {drawn}")


def load_recipe():
    """bench/recipe.py as a module (bench/ is not on the path: its kernels.py would shadow
    the package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "recipe", os.path.join(os.path.dirname(__file__), "recipe.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_modes(model, prompts, mask, n):
    """{mode: best seconds} of the sampler's modes, each reported."""
    results = {}
    for mode in modes:
        first, best, _ = timed(lambda: ours(model, prompts, mask, mode))
        results[mode] = best
        report(f"sampler.generate, {mode}", n, first, best,
               results[modes[0]] if mode != modes[0] else None)
    return results


def qwen():
    recipe = load_recipe()
    folder = recipe.write_folder(os.path.join(args.out, "qwen2.5-0.5b-shaped"))
    model = from_pretrained(folder).to(device).eval()
    g = torch.Generator(device=device).manual_seed(0)
    prompts = torch.randint(0, recipe.ORDINARY, (args.rows, args.prompt_len), device=device,
                            generator=g)
    mask = torch.ones(args.rows, args.prompt_len, device=device)
    n, c = args.rows * args.new_tokens, model.config
    name = torch.cuda.get_device_name() if device.startswith("cuda") else device
    print(f"Qwen2.5-0.5B's shapes ({model.num_params() / 1e6:.0f}M parameters, random "
          f"weights), {name}, torch {torch.__version__}; {args.rows} rows x {args.prompt_len} "
          f"prompt + {args.new_tokens} new tokens, temperature 1, {dtype}")
    results = time_modes(model, prompts, mask, n)
    weights = model.num_params() * 2                            # bfloat16 bytes, read once per step
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    if not args.no_transformers:
        try:
            from transformers import Qwen2ForCausalLM
        except ImportError:
            print("transformers is not installed: its generate is not measured")
        else:
            hf = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
            attn = mask.long()
            for cache in (None, "static"):
                def theirs():
                    with torch.no_grad():
                        return hf.generate(input_ids=prompts, attention_mask=attn,
                                           max_new_tokens=args.new_tokens,
                                           min_new_tokens=args.new_tokens, do_sample=True, top_k=0,
                                           top_p=1.0, pad_token_id=0, cache_implementation=cache)
                try:
                    first, best, _ = timed(theirs)
                    results[f"transformers {cache or 'default'}"] = best
                    report(f"transformers generate, {cache or 'default'} cache", n, first, best)
                except Exception as e:                             # noqa: BLE001 - report and go on
                    print(f"transformers generate, {cache} cache: failed ({type(e).__name__}: "
                          f"{str(e)[:200]})")
            del hf
    if device.startswith("cuda"):
        x = torch.empty(2**30, dtype=torch.uint8, device=device)
        y = torch.empty_like(x)
        _, t, _ = timed(lambda: y.copy_(x))
        bandwidth = 2 * x.numel() / t                              # bytes read + written per second
        kv = (2 * c.n_layer * args.rows * c.kv_heads * c.head_size * 2
              * (args.prompt_len + args.new_tokens / 2))
        floor = (weights + kv) / bandwidth                         # seconds per token step
        print(f"floor: {weights / 1e9:.2f} GB of bf16 weights + {kv / 1e9:.2f} GB of KV cache "
              f"(average) per step at {bandwidth / 1e12:.2f} TB/s (a device-to-device copy here) "
              f"= {1e3 * floor:.3f} ms/step, {args.rows / floor:,.0f} tokens/s")
        best = min(v for k, v in results.items() if k in sampler.MODES)
        print(f"fastest sampler mode: {n / best:,.0f} tokens/s "
              f"= {n / best / (args.rows / floor):.0%} of the floor" + "".join(
            f"; {v / best:.2f}x {k}" for k, v in results.items() if k.startswith("transformers")))


if __name__ == "__main__":
    print("command: python bench/generate.py " + " ".join(sys.argv[1:]))
    qwen() if args.qwen else toy()
