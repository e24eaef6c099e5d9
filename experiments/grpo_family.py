"""
GRPO and the variants people ask for, side by side on our task: GRPO, GSPO (sequence-level ratio),
CISPO (clipped importance weight, every token keeps its gradient), DAPO (token-level mean,
clip-higher, dynamic sampling, overlong penalty, no KL), and 2026's SAPO (a soft gate for the
clip), DPPO (a mask on each token's probability shift) and MaxRL (advantages over the group's mean
reward), all with --mu 4 (four passes over each batch, so that the ratio moves away from 1 and the
clip, gate or mask acts), the same seed and the same number of steps.

For each run it reads out/grpo_family/<variant>-s<seed>/grpo/metrics.jsonl and prints a markdown
table: held-out greedy accuracy before -> after, the clip fraction (mean over logged steps; what it
counts for each loss: docs/metrics.md), completions sampled (DAPO's dynamic sampling draws more),
and wall time.

Run:
    # seed 0, about 10 minutes on 2 CPU cores (+ SFT if missing)
    python experiments/grpo_family.py
    # mean and spread over three seeds, two runs at a time
    python experiments/grpo_family.py --seeds 0 1 2 --jobs 2
    # some variants, at another --mu (its own folders)
    python experiments/grpo_family.py --only GRPO MaxRL --mu 1 --seeds 0 1 2
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
    # 2026: only the trust region or the advantage changes from GRPO's row (the papers' defaults:
    # SAPO's temperatures 1.0 and 1.05, DPPO's binary TV bound 0.15)
    "SAPO": ["--loss_type", "sapo"],
    "DPPO": ["--loss_type", "dppo"],
    "MaxRL": ["--maxrl"],
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


def run_jobs(commands, jobs):
    """Run `commands` (argv lists, from the repository root) `jobs` at a time, one torch thread
    each; stop at the first batch with a failure."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for i in range(0, len(commands), jobs):
        procs = []
        for cmd in commands[i:i + jobs]:
            print(" ".join(["python"] + cmd[1:]), flush=True)
            procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, env=env))
        if any(p.wait() for p in procs):
            raise SystemExit("a run failed; its command is printed above")


def main():
    parser = argparse.ArgumentParser(description="GRPO and its family at --mu 4 on the same seed "
                                                 "and budget")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="seeds to run (one run per variant and seed)")
    parser.add_argument("--steps", type=int, default=50, help="grpo.py --steps for every variant")
    parser.add_argument("--out", default="out/grpo_family", help="folder for the runs")
    parser.add_argument("--init", default="out/sft.pt",
                        help="the SFT policy every variant starts from")
    parser.add_argument("--table_only", action="store_true",
                        help="only print the table of the runs already there")
    parser.add_argument("--only", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="these variants alone")
    parser.add_argument("--mu", type=int, default=4, help="grpo.py --mu for every variant")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (1 torch thread each)")
    args = parser.parse_args()
    if args.steps < 1 or args.mu < 1 or args.jobs < 1 or any(s < 0 for s in args.seeds):
        parser.error(f"--steps {args.steps}, --mu {args.mu}, --jobs {args.jobs}, --seeds "
                     f"{args.seeds}: steps, mu and jobs must be at least 1 and seeds at least 0")
    runs, todo = [], []
    for name in args.only:
        for seed in args.seeds:
            tag = "" if args.mu == 4 else f"-mu{args.mu}"          # --mu 4's folders as before
            out = os.path.join(args.out, f"{name.lower()}{tag}-s{seed}")
            path = os.path.join(ROOT, out, "grpo", "metrics.jsonl")
            cmd = [sys.executable, "grpo.py", "--mu", str(args.mu), *VARIANTS[name], "--steps",
                   str(args.steps), "--seed", str(seed), "--init", args.init, "--out", out]
            runs.append((name, path))
            if not (os.path.exists(path) and os.path.exists(os.path.join(ROOT, out, "grpo.pt"))):
                todo.append(cmd)
    run_jobs([] if args.table_only else todo, args.jobs)
    results = {}
    for name, path in runs:
        if os.path.exists(path):
            results.setdefault(name, []).append(read(path))
    print(f"\nseeds {args.seeds}, {args.steps} steps of 32 prompts x 8 samples, --mu {args.mu}\n")
    print(f"| variant | flags (with --mu {args.mu}) | held-out greedy accuracy, before -> after | "
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
