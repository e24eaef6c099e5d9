"""
Turn-level credit on the guessing game: multiturn.py --credit outcome, mt_grpo, returns and gigpo,
from the same SFT policy (sft.py --task guess, built if missing), each seed's runs at the script's
defaults: the same steps, games and episodes a step.

Prints a markdown table over the seeds (held-out greedy: found before -> after, the turns used
before -> after; the turns sampled in training) and writes results/multiturn/credit.json and
results/multiturn/found.png (held-out found against the turns sampled, the mean over seeds).

Run:
    # seeds 0-2, two runs at a time: about 10 minutes on 2 CPU cores (+ the SFT policy)
    python experiments/multiturn_credit.py --seeds 0 1 2 --jobs 2
    python experiments/multiturn_credit.py --seeds 0 1 2 --table_only    # from the runs there
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

from grpo_family import ROOT, fmt, run_jobs

INIT = os.path.join("out", "guess", "sft.pt")
CREDITS = ("outcome", "mt_grpo", "returns", "gigpo")
RESULTS = os.path.join(ROOT, "results", "multiturn")


def read(path):
    rows = [json.loads(line) for line in open(path)]
    evals = [r for r in rows if "eval_found" in r]
    logged = [r for r in rows if "turns" in r]         # every step logged: the turns it sampled
    games = rows[-1]["samples"] // max(len(logged), 1)
    return {"before": evals[0]["eval_found"], "after": evals[-1]["eval_found"],
            "turns_before": evals[0]["eval_turns"], "turns_after": evals[-1]["eval_turns"],
            "sampled": sum(r["turns"] * games for r in logged),
            "curve": [(sum(r["turns"] * games for r in logged if r["step"] <= e["step"]),
                       e["eval_found"]) for e in evals]}


def main():
    parser = argparse.ArgumentParser(description="multiturn.py's estimators, same start")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run each")
    parser.add_argument("--out", default="out/multiturn_credit", help="folder for the runs")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (1 torch thread each)")
    parser.add_argument("--table_only", action="store_true",
                        help="only print the table of the runs already there")
    args = parser.parse_args()
    if args.jobs < 1 or any(s < 0 for s in args.seeds):
        parser.error(f"--jobs {args.jobs}, --seeds {args.seeds}: jobs at least 1, seeds at least 0")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not args.table_only and not os.path.exists(os.path.join(ROOT, INIT)):
        subprocess.run([sys.executable, "sft.py", "--task", "guess"], check=True, cwd=ROOT,
                       env=env)
    runs, todo = [], []
    for credit in CREDITS:
        for seed in args.seeds:
            out = os.path.join(args.out, f"{credit}-s{seed}")
            runs.append((credit, os.path.join(ROOT, out, "multiturn", "metrics.jsonl")))
            if not os.path.exists(os.path.join(ROOT, out, "multiturn.pt")):
                # every step logged (the turns sampled), evaluated every 5 on 512 games
                todo.append([sys.executable, "multiturn.py", "--credit", credit, "--seed",
                             str(seed), "--init", INIT, "--out", out, "--log_every", "1",
                             "--eval_every", "5", "--eval_n", "512"])
    run_jobs([] if args.table_only else todo, args.jobs)
    results = {}
    for credit, path in runs:
        if os.path.exists(path):
            results.setdefault(credit, []).append(read(path))
    print(f"\nseeds {args.seeds}, from {INIT}\n")
    print("| --credit | held-out found, before -> after | turns used, before -> after | "
          "turns sampled |")
    print("| --- | --- | --- | ---: |")
    for credit, got in results.items():
        col = lambda key, f: fmt([r[key] for r in got], f)
        print(f"| {credit} | {col('before', '.3f')} -> **{col('after', '.3f')}** | "
              f"{col('turns_before', '.2f')} -> {col('turns_after', '.2f')} | "
              f"{col('sampled', ',.0f')} |")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "credit.json"), "w") as f:
        json.dump({"seeds": args.seeds, "runs": results}, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for credit, got in results.items():
        points = list(zip(*[r["curve"] for r in got]))          # each eval: one point per seed
        ax.plot([statistics.mean(x for x, _ in p) for p in points],
                [statistics.mean(y for _, y in p) for p in points], marker="o", label=credit)
    ax.set_xlabel("turns sampled in training")
    ax.set_ylabel("held-out games found (greedy)")
    ax.set_title(f"multiturn.py --credit, mean of seeds {', '.join(map(str, args.seeds))}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "found.png"), dpi=120)


if __name__ == "__main__":
    main()
