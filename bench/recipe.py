"""
The README's one-GPU recipe, measured: grpo.py at Qwen2.5-0.5B-Instruct's shapes, with the time
of each phase.

    python bench/recipe.py                                 # 3 steps of the README's recipe, a GPU
    python bench/recipe.py --steps 2 --max_new_tokens 256  # shorter
    python bench/recipe.py --device cpu --tiny             # the same code at toy shapes
                                                           # (tests/test_recipe_bench.py)

It first writes, once, a Hugging Face folder with Qwen2.5-0.5B-Instruct's layout and random weights
(out/bench/qwen2.5-0.5b-shaped/; no transformers, no download): config.json with the real config
(151936 embedding rows, 24 layers, 896 channels, 14 query and 2 key/value heads, rope theta 1e6,
tied head), model.safetensors in bfloat16, and a byte-level BPE tokenizer.json with Qwen2.5's id
layout, 151643 ordinary ids and 22 special ones from 151643 on (<|endoftext|>, <|im_start|>,
<|im_end|>, ...): fewer ids than embedding rows, as in the real folder. Its ordinary tokens are the
256 bytes, every pair of bytes and then triples: text encodes to about half as many tokens as bytes.
Then it runs grpo.main on that folder with the recipe's flags (README, Real checkpoints) and times,
each step:
- sampling: grpo.rollout (the sampler and the verifier), with completion tokens per second;
- scoring: step 2, the reference's weights brought back to the GPU (parking.Parked), both models'
  forwards and their log-probs (and the exact KL and entropy on logged steps: grpo.py logs every 5th
  step and the last, so the last step here is one);
- update: the rest of the step (step 4's forward, backward and AdamW's step), evaluation and
  checkpoints excluded;
each phase between device syncs. Model FLOPs utilisation counts 2 x parameters x tokens for a
forward, 6 x for a forward and backward, 8 x with --grad_checkpoint (the recomputed forward), over
the real prompt and completion tokens (attention's own FLOPs are not counted), against the chip's
dense bf16 peak (--peak_tflops; 989 for an H100 or H200 SXM) and against a bf16 8192^3 matrix
product measured here. Memory (CUDA; Ledger): each phase's peak (torch.cuda.max_memory_allocated)
and what was in use when it began, by owner; the run's peak is the largest. A random model rarely
samples its EOS, so completions run to --max_new_tokens: the longest step the recipe can take. The
run's checkpoint is not written (6 GB of weights and AdamW moments, not part of a step).
"""
import argparse
import json
import os
import shlex
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from hf import checkpoint  # noqa: E402
import grpo  # noqa: E402
from plumbing import parking  # noqa: E402
import plumbing  # noqa: E402
import sampler  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from hf.tokenizer import bytes_to_unicode  # noqa: E402

QWEN = dict(vocab_size=151936, block_size=32768, n_layer=24, n_head=14, n_kv_head=2, n_embd=896,
            mlp_hidden=4864, norm="rmsnorm", norm_eps=1e-6, pos="rope", rope_theta=1e6,
            mlp="swiglu", bias=False, qkv_bias=True, tie_embeddings=True)
TINY = dict(QWEN, vocab_size=70000, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, mlp_hidden=128)
ORDINARY = 151643        # Qwen2.5's ordinary ids; its special ids follow
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
           "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
           "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
           "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
           "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
with open(os.path.join(ROOT, "recipes", "grpo_one_gpu.txt")) as _f:   # the README's: @this file
    RECIPE = shlex.split(_f.read(), comments=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3,
                   help="GRPO steps to time (the first includes warm-up)")
    p.add_argument("--max_new_tokens", type=int, default=1024,
                   help="the recipe's longest completion")
    p.add_argument("--device", default="cuda",
                   help="cuda (the measurement) or cpu (--tiny, a check of the code)")
    p.add_argument("--tiny", action="store_true",
                   help="a 2-layer model of 70000 ids in place of Qwen2.5-0.5B's")
    p.add_argument("--peak_tflops", type=float, default=989.0,
                   help="the chip's dense bf16 peak, for the MFU")
    p.add_argument("--out", default=os.path.join(ROOT, "out", "bench"),
                   help="folder for the model and the runs")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                   help="more grpo.py flags (after everything else)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.max_new_tokens < 1:
        p.error(f"--steps {args.steps} --max_new_tokens {args.max_new_tokens}; "
                "allowed: both at least 1")
    return args


# -----------------------------------------------------------------------------
# The folder: Qwen2.5-0.5B-Instruct's layout, random weights, written without transformers

def tokenizer_json(n_ordinary=ORDINARY, special=SPECIAL):
    """A byte-level BPE tokenizer.json (as model.pretrained_tokenizer_parts reads it) of n_ordinary
    ids: the 256 bytes, then pairs of bytes, then triples, in order; then the special tokens."""
    alphabet = bytes_to_unicode()                          # byte -> its character in tokenizer.json
    chars = [alphabet[b] for b in range(256)]
    vocab, n = {}, 0
    for length in (1, 2, 3):
        for i in range(256 ** length):
            if n == n_ordinary:
                break
            token = "".join(chars[(i >> (8 * k)) & 255] for k in reversed(range(length)))
            vocab[token] = n
            n += 1
    added = [{"id": n_ordinary + i, "content": t, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True} for i, t in enumerate(special)]
    return {"version": "1.0", "added_tokens": added, "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                              "use_regex": True},
            "model": {"type": "BPE", "vocab": vocab, "merges": []}}


def hf_tensors(gpt):
    """Our GPT's weights (Qwen2's config) under the Hugging Face names (checkpoint.hf_tensors, the
    table loading reads), in bfloat16."""
    return {k: v.to(torch.bfloat16).contiguous()
            for k, v in checkpoint.hf_tensors(gpt.state_dict(), gpt.config).items()}


def write_folder(folder, shapes=QWEN, n_ordinary=ORDINARY, seed=0):
    """The Hugging Face folder (module docstring), written once; returns its path."""
    from safetensors.torch import save_file
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return folder
    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(seed)
    gpt = GPT(GPTConfig(**shapes))
    eos = n_ordinary + SPECIAL.index("<|im_end|>")
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
              "vocab_size": shapes["vocab_size"], "hidden_size": shapes["n_embd"],
              "intermediate_size": shapes["mlp_hidden"], "num_hidden_layers": shapes["n_layer"],
              "num_attention_heads": shapes["n_head"], "num_key_value_heads": shapes["n_kv_head"],
              "max_position_embeddings": shapes["block_size"], "rope_theta": shapes["rope_theta"],
              "rms_norm_eps": shapes["norm_eps"], "hidden_act": "silu", "tie_word_embeddings": True,
              "use_sliding_window": False, "attention_dropout": 0.0, "bos_token_id": n_ordinary,
              "eos_token_id": eos, "torch_dtype": "bfloat16"}
    files = {"config.json": config,
             "generation_config.json": {"bos_token_id": n_ordinary, "eos_token_id": eos},
             "tokenizer_config.json": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
             "tokenizer.json": tokenizer_json(n_ordinary)}
    for name, data in files.items():
        with open(os.path.join(folder, name), "w") as f:
            json.dump(data, f)
    tmp = os.path.join(folder, "model.safetensors.tmp")
    save_file(hf_tensors(gpt), tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(folder, "model.safetensors"))  # last: so the folder is whole
    return folder


# -----------------------------------------------------------------------------
# The run, timed by phase

class Timer:
    """Seconds spent inside wrapped functions, per phase, between device syncs, for the current
    step."""

    def __init__(self, device):
        self.device, self.now, self.depth = device, {}, 0
        self.tokens = self.rows = self.real = 0
        self.ledger = Ledger("cpu")

    def sync(self):
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def wrap(self, phase, fn, when=lambda: True):
        def timed(*a, **k):
            if self.depth or not when():                     # the outermost timed call counts, once
                return fn(*a, **k)
            self.depth += 1
            self.sync()
            self.ledger.mark(phase)
            t = time.perf_counter()
            try:
                out = fn(*a, **k)
                self.sync()
            finally:
                self.depth -= 1
            self.now[phase] = self.now.get(phase, 0.0) + time.perf_counter() - t
            return out
        return timed


class Ledger:
    """Device memory by phase (CUDA): each phase's peak (torch.cuda.max_memory_allocated, restarted
    at every change of phase) and, when it first begins in a step, what is in use by owner: the
    policy's weights, their gradients, AdamW's moments, the reference's weights, the sampler's copy
    (sampler.sampling_copy), the rest. Phases: sampling, scoring, update (the rest of a step) and
    within it the optimizer step (with --offload_optimizer AdamW's moments come back there)."""
    OWNERS = ("weights", "gradients", "adamw", "reference", "sampler copy")

    def __init__(self, device):
        self.on, self.phase = device.startswith("cuda"), "load"
        self.models, self.optimizers = [], []
        self.device = device.split(":")[0]                          # owners() counts tensors there
        self.steps, self.now, self.kv, self.peak = [], {}, 0, 0.0

    def owners(self):
        seen, out = set(), {}

        def add(owner, tensors):
            for t in tensors:
                s = t.untyped_storage()
                if t.device.type == self.device and s.data_ptr() not in seen and s.size():
                    seen.add(s.data_ptr())
                    out[owner] = out.get(owner, 0) + s.size()
        policy = self.models[0] if self.models else None
        if policy is not None:
            params = list(policy.parameters())
            add("weights", params)
            add("gradients", [p.grad for p in params if p.grad is not None])
        for opt in self.optimizers:
            add("adamw", [t for st in opt.state.values() for t in st.values()
                          if torch.is_tensor(t) and t.dim()])
        for m in self.models[1:2]:
            add("reference", m.parameters())
        copied = sampler._copies.get(policy) if policy is not None else None
        if copied:
            add("sampler copy", copied[1].parameters())
        return {k: v / 2**30 for k, v in out.items()}

    def mark(self, phase):
        """The phase in progress ends here and `phase` begins."""
        if not self.on or phase == self.phase:
            return
        rec, peak = self.now.setdefault(self.phase, {}), torch.cuda.max_memory_allocated() / 2**30
        rec["peak"], self.peak = max(rec.get("peak", 0.0), peak), max(self.peak, peak)
        torch.cuda.reset_peak_memory_stats()
        self.phase = phase
        if phase not in self.now:
            self.now[phase] = {"start": torch.cuda.memory_allocated() / 2**30, **self.owners()}

    def end_step(self, record=True):
        self.mark("between")
        self.now.pop("between", None)
        self.now.get("sampling", {})["kv cache"] = self.kv
        if record:
            self.steps.append(self.now)
        self.now, self.kv = {}, 0


def matmul_tflops(device):
    """A bf16 8192^3 matrix product's rate here, TFLOP/s (the median of 10 after 3 warm-ups)."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    times = []
    for i in range(13):
        torch.cuda.synchronize()
        t = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t)
    return 2 * 8192 ** 3 / sorted(times)[len(times) // 2] / 1e12


def run(args):
    folder = write_folder(os.path.join(args.out, "tiny-qwen2-shaped" if args.tiny
                                       else "qwen2.5-0.5b-shaped"),
                          TINY if args.tiny else QWEN, 65000 if args.tiny else ORDINARY)
    flags = [*RECIPE, "--max_new_tokens", str(args.max_new_tokens), "--steps", str(args.steps),
             "--eval_every", "1000000", "--eval_n", "1", "--device", args.device, "--init", folder,
             "--out", os.path.join(args.out, "recipe-run"), *args.extra]
    timer, steps, ledger = Timer(args.device), [], Ledger(args.device)
    timer.ledger = ledger
    real_rollout, real_adamw = grpo.rollout, torch.optim.AdamW
    real_advantages = grpo.grpo_advantages
    real_load, real_reference = plumbing.Run.load_policy, plumbing.Run.reference
    real_cache, cache_attr = sampler.KVCache.preallocated, sampler.KVCache.__dict__["preallocated"]
    real_enter, real_parked_step = parking.Parked.__enter__, parking.ParkedMoments.step

    def rollout(run, policy, tok, a):
        batch, *drawn, rounds = real_rollout(run, policy, tok, a)   # log-probs, hidden states
        timer.tokens, timer.rows = int(batch.mask.sum()), len(batch.mask)
        timer.real = int(batch.prompt_mask.sum() + batch.mask.sum())   # real tokens a forward reads
        return batch, *drawn, rounds

    def load_policy(self, *a, **k):                   # the policy and the reference, for the ledger
        policy, tok = real_load(self, *a, **k)
        ledger.models[:] = [policy]
        return policy, tok

    def reference(self, *a, **k):
        ledger.models[1:] = [real_reference(self, *a, **k)]
        return ledger.models[1]

    def advantages(*a, **k):                                      # step 3: the update begins
        ledger.mark("update")
        return real_advantages(*a, **k)

    def optimizer_step(fn):                                       # a phase of its own in the ledger
        def step(*a, **k):
            outer = ledger.phase != "optimizer step"    # ParkedMoments steps a chunk at a time
            ledger.mark("optimizer step")
            try:
                return fn(*a, **k)
            finally:
                if outer:
                    ledger.mark("update")
        return step

    class AdamW(real_adamw):                                   # grpo.py's optimizer, for the ledger
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            ledger.optimizers.append(self)

        step = optimizer_step(real_adamw.step)

    def preallocated(*a, **k):                                    # the rollout's KV cache, its GiB
        cache = real_cache(*a, **k)
        if ledger.phase == "sampling":                              # not an evaluation's
            ledger.kv = sum(t.numel() * t.element_size() for t in cache.k + cache.v) / 2**30
        return cache

    def enter(self):                                       # step 2 begins: the reference comes back
        timer.wrap("scoring", real_enter)(self)
        if ledger.on:                                       # what scoring holds: with the reference
            ledger.now["scoring"].update(start=torch.cuda.memory_allocated() / 2**30,
                                         **ledger.owners())
        return self

    no_grad = lambda: not torch.is_grad_enabled()
    torch.optim.AdamW = AdamW
    sampler.KVCache.preallocated = preallocated
    grpo.rollout = timer.wrap("sampling", rollout)
    sampler.completion_hidden = timer.wrap("scoring", sampler.completion_hidden)
    grpo.grpo_advantages = advantages
    plumbing.Run.load_policy, plumbing.Run.reference = load_policy, reference
    parking.Parked.__enter__ = enter
    parking.ParkedMoments.step = optimizer_step(real_parked_step)
    sampler.kl_entropy = timer.wrap("scoring", sampler.kl_entropy)
    GPT.head_logprobs = timer.wrap("scoring", GPT.head_logprobs, when=no_grad)
    plumbing.Run.evaluate = timer.wrap("other", plumbing.Run.evaluate)
    plumbing.Run.save = lambda *a, **k: None        # the run's checkpoint (6 GB) is not needed here
    plumbing.Run.log_start = timer.wrap("other", plumbing.Run.log_start)
    real_training, marks = plumbing.Run.training, []

    def training(self):                                # called once before each step and once after
        timer.sync()
        marks.append(time.perf_counter())
        ledger.end_step(record=len(marks) > 1)
        if len(marks) > 1:
            total, phases = marks[-1] - marks[-2], dict(timer.now)
            steps.append({"total": total, **phases, "update": total - sum(phases.values()),
                          "completion_tokens": timer.tokens, "rows": timer.rows,
                          "real_tokens": timer.real})
        timer.now = {}
        return real_training(self)

    plumbing.Run.training = training
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    try:
        grpo.main(grpo.parse_args(flags))
    finally:
        torch.optim.AdamW, sampler.KVCache.preallocated = real_adamw, cache_attr
        grpo.grpo_advantages, plumbing.Run.load_policy = real_advantages, real_load
        plumbing.Run.reference, parking.Parked.__enter__ = real_reference, real_enter
        parking.ParkedMoments.step = real_parked_step
    with torch.device("meta"):                            # the parameter count, without the weights
        params = GPT(GPTConfig(**(TINY if args.tiny else QWEN))).num_params()
    ledger.mark("between")
    peak = ledger.peak if args.device.startswith("cuda") else None
    ledger.models.clear(), ledger.optimizers.clear()      # the run's memory, given back
    measured = matmul_tflops(args.device) if args.device.startswith("cuda") else None
    return summarise(steps, params, peak, args, measured, flags, ledger.steps)


def summarise(steps, params, peak, args, measured, flags, memory=()):
    """The figures, per step, and the table printed last."""
    per_token = 2 * 2 + (8 if "--grad_checkpoint" in flags else 6)  # scoring (2 models), update
    rows = []
    for i, s in enumerate(steps, 1):
        flops = per_token * params * s["real_tokens"]
        busy = s.get("scoring", 0.0) + s["update"]
        rows.append({"step": i, **s, "tokens_per_s": s["completion_tokens"] / s["sampling"],
                     "train_tflops": flops / busy / 1e12,
                     "mfu": flops / busy / 1e12 / args.peak_tflops, "step_s": s["sampling"] + busy})
    print(f"\n== the README recipe at {'tiny' if args.tiny else 'Qwen2.5-0.5B'} shapes, "
          f"{params / 1e6:.1f}M parameters, {args.device}, torch {torch.__version__}"
          + (f", {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""))
    print("command: python bench/recipe.py " + " ".join(sys.argv[1:]))
    print("| step | step s (sampling + scoring + update) | sampling s | completion tokens | "
          "tokens/s | scoring s | update s | scoring + update TFLOP/s | MFU |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['step']} | {r['step_s']:.2f} | {r['sampling']:.2f} | "
              f"{r['completion_tokens']:,} | {r['tokens_per_s']:,.0f} | "
              f"{r.get('scoring', 0.0):.2f} | {r['update']:.2f} | {r['train_tflops']:.0f} | "
              f"{100 * r['mfu']:.1f} % |")
    if peak is not None:
        print(f"peak allocated {peak:.2f} GiB; MFU against --peak_tflops {args.peak_tflops:g}"
              + (f"; a bf16 8192^3 matrix product runs at {measured:.0f} TFLOP/s here"
                 if measured else ""))
    if memory:
        print("memory, GiB: in use when each phase began, by owner, and the phase's peak (Ledger)")
        print(f"| step | phase | {' | '.join(Ledger.OWNERS)} | rest | in use | KV cache | peak | "
              "peak - in use |")
        print("| ---: | --- |" + " ---: |" * (len(Ledger.OWNERS) + 5))
        for i, rec in enumerate(memory, 1):
            for phase in ("sampling", "scoring", "update", "optimizer step"):
                m = rec.get(phase)
                if m:
                    rest = m["start"] - sum(m.get(o, 0.0) for o in Ledger.OWNERS)
                    kv = f"{m['kv cache']:.2f}" if "kv cache" in m else ""
                    print(f"| {i} | {phase} | "
                          + " | ".join(f"{m.get(o, 0.0):.2f}" for o in Ledger.OWNERS)
                          + f" | {rest:.2f} | {m['start']:.2f} | {kv} | {m['peak']:.2f} | "
                          f"{m['peak'] - m['start']:.2f} |")
    result = {"steps": rows, "peak_gib": peak, "params": params, "matmul_tflops": measured,
              "peak_tflops": args.peak_tflops, "flags": flags, "memory": list(memory)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    a = parse_args()
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but CUDA is not available here; "
                         "use --device cpu --tiny")
    run(a)
