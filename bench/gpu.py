"""
Everything that needs a GPU, in one command, for whoever has one: the CUDA-only tests, the kernel
benchmark, the sampler benchmark (toy and Qwen2.5-0.5B shapes), the README's one-GPU recipe, every
training script's default command and the sampler/trainer agreement, written up in
results/gpu-bench.md with the device, the versions and every command (results/gpu.md is the
hand-kept record of every GPU figure, with its analysis).

    python bench/gpu.py                      # everything; writes results/gpu-bench.md
                                             # (finished steps are skipped)
    python bench/gpu.py --only tests,recipe  # some steps: tests, kernels, sampler, recipe, trl,
                                             # scripts, ratio, memory
    python bench/gpu.py --fresh              # forget what is recorded and run everything again
    python bench/gpu.py --measure_ratio      # step 5 alone, printed (what step 5 runs)

Without CUDA it refuses with one line. Steps, in this order:
1. tests: the CUDA-only tests. tests/test_kernel*.py with TRITON_INTERPRET unset, so that the Triton
   kernels run on the GPU (test_int64_row_offsets_cuda and the `triton_path` cases, which skip or
   run in an interpreted child on a CPU machine), then every other test whose name says cuda (the
   compiled sampler as a CUDA graph).
2. kernels: `python bench/kernels.py --section gpu`: logprobs, kl, entropy and linear_logprobs at
   N = 16384, V in {50257, 151936}, bfloat16, forward and forward + backward: time, bandwidth
   against a device-to-device copy of the same bytes, speed against eager PyTorch, torch.compile and
   Liger-Kernel (its cross entropy, KL divergence and fused linear cross entropy; "not installed"
   otherwise).
3. sampler: `python bench/generate.py --device cuda`: nanoGPT's recompute loop and
   sampler.generate's three modes in tokens/s, under bfloat16 autocast as the scripts sample, at 64
   and 256 (a GRPO step's) rows, and once in float32, where every mode must give exactly the eager
   sampler's tokens; then at Qwen2.5-0.5B's shapes, 128 rows x 1024 new tokens, beside transformers'
   generate (`--qwen`).
   recipe: `python bench/recipe.py`: the README's one-GPU recipe, three steps, each split into
   sampling, scoring and update, with completion tokens/s, model FLOPs utilisation and peak memory;
   then with `--lora_rank 16`, then with `--offload_optimizer`.
   trl: `python bench/trl_grpo.py`: TRL's GRPOTrainer beside grpo.py at the recipe's shapes, one
   process, the ratio of their steps and their peaks (skipped with one line where trl is not
   installed).
4. scripts: every training script's default command (sft first, then reward_model, the scripts that
   need them after them), each run in out/gpu/ so that it writes out/gpu/out/ and never the
   repository's out/: wall time, its summary line, held-out greedy accuracy before -> after from its
   metrics.jsonl.
5. ratio: do the sampler and the trainer agree? A GRPO-sized batch (32 prompts x 8 samples, 4
   batches) is sampled from out/gpu/out/sft.pt (built if missing) and scored as grpo.py scores it:
   once for the whole batch without gradient (the old log-probs), then in micro-batches of several
   sizes and orders with gradient on (the first update, weights unchanged: lr = 0), under the same
   bfloat16 autocast. Reported: the share of completion tokens with
   |exp(logp_micro - logp_full) - 1| > 1e-3, with model.py's head (bf16 operands, float32
   logits: its docstring, Precision), with bfloat16 logits for contrast, and with no autocast at
   all. (grpo.py itself scores in the micro-batches it trains in, through the same function: its
   first ratio is 1 by construction.)
6. memory: `python bench/memory.py --device cuda`: peak memory of one GRPO update at Qwen2.5-0.5B's
   shapes (random weights), through the logits or the fused kernel, with and without
   --grad_checkpoint; at the CPU's batch and at the README recipe's (32 rows of 256 + 1024 tokens, 4
   micro-batches).
Each finished step is recorded in out/gpu/steps.json (its command, wall time and output; full logs
in out/gpu/logs/) and results/gpu-bench.md is rewritten from the records after every step, so an
interrupted run keeps what it measured and a re-run continues where it stopped (a script cut off
mid-run starts again).
"""
import argparse
import contextlib
import datetime
import glob
import importlib.metadata
import json
import os
import platform
import random
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import task  # noqa: E402
from kernels import logprobs  # noqa: E402
from model import completion_logits  # noqa: E402

GROUPS = ["tests", "kernels", "sampler", "recipe", "trl", "scripts", "ratio", "memory"]
# prerequisites: the SFT policy, PPO's reward model, search's verifiers
FIRST = ["sft", "reward_model", "prm"]
LAST = ["search"]                          # test-time search reads the checkpoints the others write
TOL = 1e-3                                 # |ratio - 1| above this counts as off


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "out", "gpu"),
                   help="folder for the runs, records and logs")
    p.add_argument("--results", default=os.path.join(ROOT, "results", "gpu-bench.md"),
                   help="the report to write")
    p.add_argument("--only", default=None,
                   help=f"comma-separated steps to run: {', '.join(GROUPS)} or script names")
    p.add_argument("--fresh", action="store_true",
                   help="forget the recorded steps and run them all again")
    p.add_argument("--measure_ratio", action="store_true",
                   help="only measure the sampler/trainer agreement, print it")
    p.add_argument("--ratio_batches", type=int, default=4,
                   help="GRPO-sized batches sampled for the ratio measurement")
    args = p.parse_args(argv)
    if args.ratio_batches < 1:
        p.error(f"--ratio_batches {args.ratio_batches}; allowed: at least 1")
    args.out, args.results = os.path.abspath(args.out), os.path.abspath(args.results)
    return args


# -----------------------------------------------------------------------------
# Step 5, the measurement itself: pure functions (tested on the CPU in tests/test_gpu_bench.py)

def completion_logits_bf16_head(model, prompt, prompt_mask, tokens, mask):
    """model.completion_logits with the LM head left to autocast: the logits come out rounded to
    bfloat16 when autocast is on. For contrast only."""
    idx = torch.cat([prompt, tokens], dim=1)                           # (B, Tp+Tn)
    attn = torch.cat([prompt_mask, mask], dim=1)
    # (B, Tn, V)
    return model.lm_head(model.hidden(idx[:, :-1], attn[:, :-1]))[:, prompt.size(1) - 1:]


def scoring_variants(device_type):
    """{name: (logits function, context factory)}: the three ways of scoring step 5 compares."""
    bf16 = lambda: torch.autocast(device_type, dtype=torch.bfloat16)
    return {"bf16 operands, float32 logits under bf16 autocast (model.py, as the "
            "scripts score)": (completion_logits, bf16),
            "bfloat16 logits under bf16 autocast (for contrast)":
                (completion_logits_bf16_head, bf16),
            "no autocast (float32 throughout)": (completion_logits, contextlib.nullcontext)}


def micro_batch_splits(n, parts=(1, 2, 4, 8, 32), seed=0):
    """[(name, [rows, ...]), ...]: the n rows in order, reversed and shuffled, cut into each number
    of micro-batches (tensor_split, as plumbing.Run.micro_batches cuts them). 1 micro-batch in order
    is the same batch as the full scoring, with gradient on: it isolates the grad mode from the
    batch composition."""
    g = torch.Generator().manual_seed(seed)
    orders = {"in order": torch.arange(n), "reversed": torch.arange(n).flip(0),
              "shuffled": torch.randperm(n, generator=g)}
    return [(f"{k} micro-batch{'es' if k > 1 else ''}, {how}", list(torch.tensor_split(order, k)))
            for k in parts if k <= n for how, order in orders.items()]


def first_update_deviation(policy, batch, logits_fn, context, splits):
    """|ratio - 1| of every completion token of `batch` (task.rollout's tuple), for each split of
    micro_batch_splits. The old log-probs are scored for the whole batch at once without gradient
    (grpo.py's step 2 at --grad_accum 1); the new ones in the split's micro-batches with gradient
    on (step 4), the weights unchanged, so the ratio exp(logp_new - logp_old) should be exactly 1.
    Returns {split name: (|ratio - 1| at the real tokens, 1-D)}."""
    prompt, prompt_mask, tokens, mask = batch[:4]
    device = tokens.device
    with torch.no_grad(), context():
        logits = logits_fn(policy, prompt, prompt_mask, tokens, mask)     # (B, Tn, V)
    old = logprobs(logits, tokens)                                        # (B, Tn) float32
    out = {}
    for name, parts in splits:
        new = torch.zeros_like(old)
        for rows in parts:
            rows = rows.to(device)
            with context():
                logits = logits_fn(policy, prompt[rows], prompt_mask[rows], tokens[rows],
                                   mask[rows])
            new[rows] = logprobs(logits, tokens[rows]).detach()
        out[name] = (torch.exp(new - old) - 1).abs()[mask > 0]            # (real tokens,)
    return out


def off_share(deviation, tol=TOL):
    """The share of tokens whose |ratio - 1| exceeds tol."""
    return int((deviation > tol).sum()) / deviation.numel() if deviation.numel() else 0.0


def measure_ratio(args):
    """Step 5: print the tables (markdown)."""
    from plumbing import loading
    sft = os.path.join(args.out, "out", "sft.pt")
    loading.build_missing(sft, sft, ["sft.py"], "cuda")           # python sft.py --out out/gpu/out
    policy, tok, _ = loading.load_model(sft, "cuda")
    rng, gen = random.Random(0), torch.Generator(device="cuda").manual_seed(0)
    batches = []
    with torch.autocast("cuda", dtype=torch.bfloat16):                 # the scripts sample under it
        for _ in range(args.ratio_batches):
            batches.append(task.rollout(policy, tok, task.sample_prompts(rng, 32), 8, 1.0,
                                        generator=gen))
    splits = micro_batch_splits(batches[0][2].size(0))
    print(f"policy {sft} on {torch.cuda.get_device_name()}; {len(batches)} batches of 32 "
          f"prompts x 8 samples at temperature 1, {sum(int(b[3].sum()) for b in batches)} "
          f"completion tokens; old log-probs: the whole batch without gradient; "
          f"new: micro-batches with gradient, weights unchanged (lr = 0)\n")
    print(f"| scoring | tokens | share with abs(ratio - 1) > {TOL:g} | share > 1e-2 | "
          f"max abs(ratio - 1) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    per_split = {}
    for name, (logits_fn, context) in scoring_variants("cuda").items():
        dev = {}
        for batch in batches:
            deviations = first_update_deviation(policy, batch, logits_fn, context, splits)
            for split, d in deviations.items():
                dev.setdefault(split, []).append(d)
        dev = {split: torch.cat(ds) for split, ds in dev.items()}
        every = torch.cat(list(dev.values()))
        per_split[name] = dev
        print(f"| {name} | {every.numel():,} | {off_share(every):.4f} | "
              f"{off_share(every, 1e-2):.4f} | {float(every.max()):.2e} |")
    print(f"\nPer micro-batch split, share with abs(ratio - 1) > {TOL:g}:\n")
    names = list(per_split)
    print("| split | " + " | ".join(names) + " |")
    print("| --- |" + " ---: |" * len(names))
    for split, _ in splits:
        print(f"| {split} | " + " | ".join(f"{off_share(per_split[n][split]):.4f}" for n in names)
              + " |")


# -----------------------------------------------------------------------------
# The steps: commands, run as a user would run them, recorded

def training_scripts(root=ROOT):
    """The top-level scripts that train: those defining parse_args that take --init, plus sft.py
    (where everything starts) and prm.py / search.py where present, ordered so that what a script
    loads is built before it: sft, reward_model, prm, then the rest alphabetically, search last."""
    names = []
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        name, text = os.path.basename(path)[:-3], open(path).read()
        if "def parse_args(" in text and ('"--init"' in text or name in FIRST + LAST):
            names.append(name)
    rank = lambda n: (FIRST.index(n) if n in FIRST else len(FIRST) + (n in LAST), n)
    return sorted(names, key=rank)


def metrics_summary(path):
    """(held-out greedy accuracy at the first eval step, at the last, the last line's samples) of a
    metrics.jsonl."""
    evals, samples = [], None
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if "eval_accuracy" in row:
                evals.append(row["eval_accuracy"])
            samples = row.get("samples", samples)
    return (evals[0] if evals else None, evals[-1] if evals else None, samples)


def steps(args):
    """[(key, group, title, command, cwd), ...] in the order they run; command is an argv list."""
    py = sys.executable
    kernel_tests = sorted(os.path.relpath(p, ROOT)
                          for p in glob.glob(os.path.join(ROOT, "tests", "test_kernel*.py")))
    out = [("tests:kernels", "tests", "Kernel tests on the GPU",
            [py, "-m", "pytest", "-q", "-rs", *kernel_tests], ROOT),
           ("tests:cuda", "tests", "Other CUDA-only tests",
            [py, "-m", "pytest", "-q", "-rs", "-k", "cuda", "tests",
             "--ignore-glob=tests/test_kernel*"], ROOT),
           ("kernels", "kernels", "Kernel benchmark",
            [py, "bench/kernels.py", "--section", "gpu"], ROOT),
           ("sampler:64", "sampler", "Sampler, 64 rows, bf16",
            [py, "bench/generate.py", "--device", "cuda"], ROOT),
           ("sampler:256", "sampler", "Sampler, 256 rows (a GRPO step), bf16",
            [py, "bench/generate.py", "--device", "cuda", "--batch", "256"], ROOT),
           ("sampler:256:fp32", "sampler", "Sampler, 256 rows, float32",
            [py, "bench/generate.py", "--device", "cuda", "--batch", "256", "--dtype", "float32"],
            ROOT),
           ("sampler:qwen", "sampler",
            "Sampler, Qwen2.5-0.5B's shapes, 128 x 1024 new tokens, and transformers",
            [py, "bench/generate.py", "--qwen", "--rows", "128", "--new_tokens", "1024",
             "--repeats", "2"], ROOT),
           ("recipe", "recipe", "The README's one-GPU recipe at Qwen2.5-0.5B's shapes",
            [py, "bench/recipe.py", "--steps", "3"], ROOT),
           ("recipe:lora", "recipe",
            "The same recipe with LoRA adapters of rank 16 on every projection",
            [py, "bench/recipe.py", "--steps", "3", "--extra", "--lora_rank", "16"], ROOT),
           ("recipe:offload", "recipe", "The same recipe, AdamW's moments in host memory",
            [py, "bench/recipe.py", "--steps", "3", "--extra", "--offload_optimizer"], ROOT),
           ("trl", "trl",
            "TRL's GRPOTrainer beside grpo.py at the recipe's shapes (skipped without trl)",
            [py, "bench/trl_grpo.py", "--steps", "3"], ROOT)]
    for name in training_scripts():
        out.append((f"script:{name}", "scripts", f"python {name}.py",
                    [py, os.path.join(ROOT, f"{name}.py")], args.out))
    # issue 41: 2 seeds
    out.append(("script:agent:seed1", "scripts", "python agent.py --seed 1 --out out/agent_seed1",
                [py, os.path.join(ROOT, "agent.py"), "--seed", "1", "--out", "out/agent_seed1"],
                args.out))
    out.append(("ratio", "ratio", "Sampler/trainer agreement at the first update",
                [py, "bench/gpu.py", "--measure_ratio", "--out", args.out,
                 "--ratio_batches", str(args.ratio_batches)], ROOT))
    for name, flags in (("memory", []),
                        ("memory:recipe", ["--rows", "32", "--completion_len", "1024",
                                           "--prompt_len", "256", "--grad_accum", "4"])):
        out.append((name, "memory",
                    f"Peak memory of one GRPO update at Qwen2.5-0.5B's shapes {' '.join(flags)}",
                    [py, "bench/memory.py", "--device", "cuda", *flags], ROOT))
    return out


def shown(command, cwd):
    """The command as a user would type it from the repository root."""
    words = [os.path.relpath(w, cwd) if os.path.isabs(w) and w.startswith(ROOT) else w
             for w in command[1:]]
    text = " ".join(["python", *words])
    return text if cwd == ROOT else f"cd {os.path.relpath(cwd, ROOT)} && {text}"


def run_step(command, cwd, log_path):
    """Run `command` in `cwd`, its output echoed and saved to log_path; returns (returncode, wall
    seconds, output)."""
    # Triton on the GPU, not interpreted
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    os.makedirs(cwd, exist_ok=True)
    t = time.time()
    lines = []
    with (subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, bufsize=1) as p,
          open(log_path, "w") as log):
        for line in p.stdout:
            sys.stdout.write(line)
            log.write(line)
            lines.append(line)
    return p.returncode, time.time() - t, "".join(lines)


def tail(text, n):
    lines = text.rstrip("\n").split("\n")
    return "\n".join(lines[-n:])


def environment():
    """Device and versions, for the report's head."""
    props = torch.cuda.get_device_properties(0)
    info = {"device": torch.cuda.get_device_name(0), "capability": f"sm_{props.major}{props.minor}",
            "memory": f"{props.total_memory / 2**30:.1f} GiB", "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": str(torch.backends.cudnn.version()),
            "python": platform.python_version()}
    for package in ("triton", "liger-kernel", "numpy"):
        try:
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            info[package] = "not installed"
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                         "--format=csv,noheader"], capture_output=True, text=True,
                                        timeout=30).stdout.strip().split("\n")[0]
    except (OSError, subprocess.SubprocessError):
        info["driver"] = "unknown (no nvidia-smi)"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout
        info["commit"] = commit.strip() + (" with uncommitted changes" if dirty.strip() else "")
    except OSError:
        info["commit"] = "unknown"
    return info


def report(records, info, plan):
    """results/gpu-bench.md from the records, in the order of the plan."""
    done = [(key, records[key]) for key, *_ in plan if key in records]
    lines = ["# GPU results", "", f"Written by `python bench/gpu.py` "
                                  f"on {records.get('_written', '?')}: {info['device']} "
                                  f"({info['capability']}, {info['memory']}), "
                                  f"driver {info['driver']}; torch {info['torch']} "
                                  f"(CUDA {info['cuda']}, cuDNN {info['cudnn']}), "
                                  f"triton {info['triton']}, "
                                  f"Liger-Kernel {info['liger-kernel']}, numpy {info['numpy']}, "
                                  f"Python {info['python']}; commit {info['commit']}. Every "
                                  f"command below runs from the repository root; the training "
                                  f"scripts run with their defaults in out/gpu/ (so they write "
                                  f"out/gpu/out/).", ""]
    missing = [shown(cmd, cwd) for key, _, _, cmd, cwd in plan if key not in records]
    if missing:
        lines += ["Not run yet: " + "; ".join(f"`{m}`" for m in missing), ""]
    scripts = [(k, r) for k, r in done if k.startswith("script:")]
    if scripts:
        lines += ["## Training scripts, default commands", "",
                  "| script | command | exit | wall s | held-out greedy accuracy, before -> after "
                  "| completions sampled |",
                  "| --- | --- | ---: | ---: | --- | ---: |"]
        for key, r in scripts:
            acc = " ; ".join(f"{name}: {b if b is None else f'{b:.3f}'} "
                             f"-> {a if a is None else f'{a:.3f}'}"
                             for name, (b, a, _) in sorted(r.get("metrics", {}).items())) or "-"
            sampled = " ; ".join(f"{s:,}" for _, (_, _, s) in sorted(r.get("metrics", {}).items())
                                 if s) or "-"
            lines.append(f"| {key[7:]} | `{r['command']}` | {r['returncode']} | "
                         f"{r['wall_s']:.0f} | {acc} | {sampled} |")
        lines.append("")
        lines += ["Each script's summary line:", "",
                  "```"] + [f"{k[7:]}: {r.get('summary') or '(none)'}" for k, r in scripts]
        lines += ["```", ""]
    for key, r in done:
        if key.startswith("script:"):
            continue
        lines += [f"## {r['title']}", "",
                  f"`{r['command']}`: exit {r['returncode']}, {r['wall_s']:.0f} s", ""]
        body = r["output"] if key == "ratio" else "```\n" + r["output"] + "\n```"
        lines += [body, ""]
    lines += ["## Training script outputs (last lines)", ""] if scripts else []
    for key, r in scripts:
        lines += [f"### {key[7:]}", "", f"`{r['command']}`: exit {r['returncode']}, "
                                        f"{r['wall_s']:.0f} s", "", "```", r["output"], "```", ""]
    return "\n".join(lines)


def write_atomic(path, text):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def main(args):
    plan = steps(args)
    known = set(GROUPS) | {key.split(":", 1)[1] for key, group, *_ in plan if group == "scripts"}
    only = None if args.only is None else {w.strip() for w in args.only.split(",") if w.strip()}
    if only is not None and only - known:
        raise SystemExit(f"error: --only {args.only}: {', '.join(sorted(only - known))} "
                         f"unknown; allowed: {', '.join(sorted(known))}")
    record_path, logs = os.path.join(args.out, "steps.json"), os.path.join(args.out, "logs")
    os.makedirs(logs, exist_ok=True)
    records = {}
    if os.path.exists(record_path) and not args.fresh:
        with open(record_path) as f:
            records = json.load(f)
    info = environment()
    print(f"bench/gpu.py on {info['device']}, torch {info['torch']} (CUDA {info['cuda']}), "
          f"triton {info['triton']}; runs in {args.out}, writes {args.results}", flush=True)
    for key, group, title, command, cwd in plan:
        wanted = only is None or group in only or (group == "scripts"
                                                   and key.split(":", 1)[1] in only)
        if not wanted:
            continue
        if key in records and records[key]["returncode"] == 0:
            print(f"== {title}: done before ({records[key]['wall_s']:.0f} s), skipped (--fresh "
                  f"to redo)", flush=True)
            continue
        print(f"\n== {title}: {shown(command, cwd)}", flush=True)
        started = time.time()
        code, wall, output = run_step(command, cwd,
                                      os.path.join(logs, key.replace(":", "_") + ".log"))
        r = {"title": title, "command": shown(command, cwd), "returncode": code, "wall_s": wall}
        if group == "scripts":
            r["output"] = tail(output, 40)
            r["summary"] = next((line for line in reversed(output.split("\n"))
                                 if line.startswith("done:")), None)
            r["metrics"] = {os.path.basename(os.path.dirname(p)): metrics_summary(p)
                            # out/grpo/, out/toolcalc/agent/
                            for pattern in ("*", os.path.join("*", "*"))
                            for p in glob.glob(os.path.join(cwd, "out", pattern, "metrics.jsonl"))
                            if os.path.getmtime(p) >= started}
        else:
            r["output"] = tail(output, 200)
        records[key] = r
        records["_written"] = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        write_atomic(record_path, json.dumps(records, indent=1))
        write_atomic(args.results, report(records, info, plan))
        print(f"== {title}: exit {code}, {wall:.0f} s", flush=True)
    write_atomic(args.results, report(records, info, plan))
    failed = [records[k]["title"] for k, *_ in plan if k in records
              and records[k]["returncode"] != 0]
    print(f"\nwrote {args.results}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(f"error: bench/gpu.py needs a CUDA GPU and torch {torch.__version__} "
                         f"sees none here (CUDA "
                         f"build: {torch.version.cuda or 'none, a CPU-only wheel'}); nothing "
                         f"was run or written")
    if args.measure_ratio:
        measure_ratio(args)
    else:
        sys.exit(main(args))
