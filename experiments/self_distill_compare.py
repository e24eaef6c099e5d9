"""
Self-distillation against GRPO from the same start: the SFT policy that reads a hint (sft.py
--hint_share 0.25, built if missing), each seed's runs of self_distill.py and of grpo.py --init
<that policy>, at their defaults.

Prints a markdown table over the seeds: held-out greedy accuracy before -> after, on precedence
problems, the teacher's accuracy (self-distillation's: the policy reading the answer, greedy on the
step's prompts, first and last logged), completions sampled and wall time.

Run:
    # seeds 0-2, two runs at a time: about 10 minutes on 2 CPU cores (+ the SFT policy)
    python experiments/self_distill_compare.py --seeds 0 1 2 --jobs 2
    # re-print the table from the runs already there
    python experiments/self_distill_compare.py --seeds 0 1 2 --table_only
"""
import argparse
import json
import os
import subprocess
import sys

from grpo_family import ROOT, fmt, run_jobs
INIT = os.path.join("out", "sft_hint", "sft.pt")
RUNS = {"self-distillation": "self_distill", "GRPO": "grpo"}    # row -> script


def read(path):
    rows = [json.loads(line) for line in open(path)]
    evals = [r for r in rows if "eval_accuracy" in r]
    teacher = [r["teacher_reward"] for r in rows if "teacher_reward" in r]
    return {"before": evals[0]["eval_accuracy"], "after": evals[-1]["eval_accuracy"],
            "precedence": evals[-1]["eval_accuracy_precedence"],
            "teacher_first": teacher[0] if teacher else float("nan"),
            "teacher_last": teacher[-1] if teacher else float("nan"),
            "samples": rows[-1]["samples"], "seconds": rows[-1]["elapsed_s"]}


def main():
    parser = argparse.ArgumentParser(description="self_distill.py against grpo.py, same start")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run each")
    parser.add_argument("--out", default="out/self_distill_compare", help="folder for the runs")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (1 torch thread each)")
    parser.add_argument("--table_only", action="store_true",
                        help="only print the table of the runs already there")
    args = parser.parse_args()
    if args.jobs < 1 or any(s < 0 for s in args.seeds):
        parser.error(f"--jobs {args.jobs}, --seeds {args.seeds}: jobs at least 1, seeds at least 0")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not args.table_only and not os.path.exists(os.path.join(ROOT, INIT)):
        subprocess.run([sys.executable, "sft.py", "--hint_share", "0.25", "--out",
                        os.path.dirname(INIT)], check=True, cwd=ROOT, env=env)
    runs, todo = [], []
    for name, script in RUNS.items():
        for seed in args.seeds:
            out = os.path.join(args.out, f"{script}-s{seed}")
            path = os.path.join(ROOT, out, script, "metrics.jsonl")
            runs.append((name, path))
            if not os.path.exists(os.path.join(ROOT, out, f"{script}.pt")):
                todo.append([sys.executable, f"{script}.py", "--seed", str(seed), "--init", INIT,
                             "--out", out])
    run_jobs([] if args.table_only else todo, args.jobs)
    results = {}
    for name, path in runs:
        if os.path.exists(path):
            results.setdefault(name, []).append(read(path))
    print(f"\nseeds {args.seeds}, from {INIT}\n")
    print("| method | held-out greedy accuracy, before -> after | precedence after | teacher "
          "(reads the answer), first -> last | completions sampled | wall time s |")
    print("| --- | --- | ---: | --- | ---: | ---: |")
    for name, got in results.items():
        col = lambda key, f: fmt([r[key] for r in got], f)
        teacher = (f"{col('teacher_first', '.3f')} -> {col('teacher_last', '.3f')}"
                   if name == "self-distillation" else "-")
        print(f"| {name} | {col('before', '.3f')} -> **{col('after', '.3f')}** | "
              f"{col('precedence', '.3f')} | {teacher} | {col('samples', ',.0f')} | "
              f"{col('seconds', '.0f')} |")


if __name__ == "__main__":
    main()
