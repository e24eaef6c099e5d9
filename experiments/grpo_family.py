"""
GRPO and the variants people ask for, side by side on our task: GRPO, GSPO (sequence-level ratio),
CISPO (clipped importance weight, every token keeps its gradient) and DAPO (token-level mean,
clip-higher, dynamic sampling, overlong penalty, no KL), all with --mu 4 (four passes over each
batch, so that the ratio moves away from 1 and the clip or the weight truncation acts), the same
seed and the same number of steps.

For each run it reads out/grpo_family/<variant>-s<seed>/grpo/metrics.jsonl and prints a markdown
table: held-out greedy accuracy before -> after, the clip fraction (mean over logged steps: for
GRPO, GSPO and DAPO the share of tokens whose gradient the clip removed; for CISPO the share whose
weight was truncated), completions sampled (DAPO's dynamic sampling draws more), and wall time.

Run:
    # seed 0, about 6 minutes on 2 CPU cores (+ SFT if missing)
    python experiments/grpo_family.py
    # mean and spread over three seeds
    python experiments/grpo_family.py --seeds 0 1 2
    # re-print the table from the runs already there
    python experiments/grpo_family.py --table_only
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name -> grpo.py flags (beyond --mu 4): the papers' settings, no KL term where they use none
VARIANTS = {
    "GRPO": [],
    "GSPO": ["--ratio_level", "sequence", "--clip_eps", "3e-4", "--eps_high", "4e-4",
             "--beta", "0"],
    "CISPO": ["--loss_type", "cispo", "--loss_agg", "token", "--clip_eps", "1", "--eps_high", "1",
              "--beta", "0"],
    "DAPO": ["--loss_agg", "token", "--eps_high", "0.28", "--beta", "0", "--dynamic_sampling",
             "--overlong_buffer", "4"],
}


def read(path):
    rows = [json.loads(line) for line in open(path)]
    evals = [r for r in rows if "eval_accuracy" in r]
    steps = [r for r in rows if r["step"] > 0 and "clip_frac" in r]
    return {"before": evals[0]["eval_accuracy"], "after": evals[-1]["eval_accuracy"],
            "clip_frac": statistics.mean(r["clip_frac"] for r in steps),
            "samples": steps[-1]["samples"], "seconds": steps[-1]["elapsed_s"],
            "groups_kept": statistics.mean(r["groups_kept"] / r["groups_sampled"] for r in steps)}


def fmt(values, f):
    if len(values) == 1:
        return format(values[0], f)
    return f"{format(statistics.mean(values), f)} +- {format(statistics.stdev(values), f)}"


def main():
    parser = argparse.ArgumentParser(description="GRPO, GSPO, CISPO and DAPO at --mu 4 on the "
                                                 "same seed and budget")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="seeds to run (one run per variant and seed)")
    parser.add_argument("--steps", type=int, default=50, help="grpo.py --steps for every variant")
    parser.add_argument("--out", default="out/grpo_family", help="folder for the runs")
    parser.add_argument("--init", default="out/sft.pt",
                        help="the SFT policy every variant starts from")
    parser.add_argument("--table_only", action="store_true",
                        help="only print the table of the runs already there")
    args = parser.parse_args()
    if args.steps < 1 or any(s < 0 for s in args.seeds):
        parser.error(f"--steps {args.steps}, --seeds {args.seeds}: steps must be at least 1 and "
                     f"seeds at least 0")
    results = {}
    for name, flags in VARIANTS.items():
        for seed in args.seeds:
            out = os.path.join(args.out, f"{name.lower()}-s{seed}")
            path = os.path.join(ROOT, out, "grpo", "metrics.jsonl")
            cmd = [sys.executable, "grpo.py", "--mu", "4", *flags, "--steps", str(args.steps),
                   "--seed", str(seed), "--init", args.init, "--out", out]
            done = os.path.exists(path) and os.path.exists(os.path.join(ROOT, out, "grpo.pt"))
            if not args.table_only and not done:
                print(" ".join(["python"] + cmd[1:]), flush=True)
                subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
            if os.path.exists(path):
                results.setdefault(name, []).append(read(path))
    print(f"\nseeds {args.seeds}, {args.steps} steps of 32 prompts x 8 samples, --mu 4\n")
    print("| variant | flags (with --mu 4) | held-out greedy accuracy, before -> after | "
          "clip fraction | groups kept / sampled | completions sampled | wall time s |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for name, runs in results.items():
        col = lambda key, f: fmt([r[key] for r in runs], f)
        print(f"| {name} | `{' '.join(VARIANTS[name]) or '(defaults)'}` | "
              f"{col('before', '.3f')} -> **{col('after', '.3f')}** "
              f"| {col('clip_frac', '.3f')} | {col('groups_kept', '.2f')} | "
              f"{col('samples', ',.0f')} | {col('seconds', '.0f')} |")


if __name__ == "__main__":
    main()
