"""
agent.py's study: tool use learned by GRPO on episodes, what a call's cost does, what training on
the environment's tokens does, and self-correction over two attempts.

Runs agent.py from the same SFT policy (out/toolcalc/sft.pt, built by the first run if missing) with
each setting below, one process at a time, and reads their metrics.jsonl: held-out greedy accuracy
with the tool, without it (calls banned), on hard and easy problems; calls per episode on the
held-out set and over training; for --turns 2 each attempt's accuracy and the share of answers each
revision turned.

Run:
    # about 50 minutes on 2 CPU cores (+ the SFT)
    OMP_NUM_THREADS=1 python experiments/agent_study.py
    # some of them
    python experiments/agent_study.py --runs default "call cost 0"
    # re-print the tables from the runs there
    python experiments/agent_study.py --table_only
Outputs: results/agent/results.md (the tables) and results.json.
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {  # name -> agent.py flags beyond --seed and --out
    "default": [],
    "call cost 0": ["--call_cost", "0"],
    "call cost 0.5": ["--call_cost", "0.5"],
    "call cost 1": ["--call_cost", "1"],
    "env tokens in the loss": ["--train_on_env_tokens"],
    "two attempts": ["--turns", "2"],
    "two attempts, env tokens in the loss": ["--turns", "2", "--train_on_env_tokens"],
}


def read(out):
    rows = [json.loads(line) for line in open(os.path.join(out, "agent", "metrics.jsonl"))]
    evals = [r for r in rows if "eval_accuracy" in r]
    return {"before": evals[0], "after": evals[-1], "steps": [r for r in rows if r["step"] > 0],
            "seconds": rows[-1].get("elapsed_s", 0.0)}


def tables(results, seed):
    f = lambda r, key, spec=".3f": format(r[key], spec) if key in r else "-"
    arrow = lambda run, key, spec=".3f": (f"{f(run['before'], key, spec)} -> "
                                          f"**{f(run['after'], key, spec)}**")
    lines = [f"Seed {seed}, every run from the same SFT policy; held-out: 512 problems (256 "
             f"hard, 256 easy), greedy.", "",
             "| run | accuracy with the tool | hard | easy | without the tool | "
             "calls per episode | calls on hard / easy (share) | "
             "accuracy with / without a call | pass@1 | wall s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | ---: | ---: |"]
    for name, run in results.items():
        a = run["after"]
        lines.append(f"| {name} | {arrow(run, 'eval_accuracy')} | "
                     f"{arrow(run, 'eval_accuracy_precedence')} | "
                     f"{arrow(run, 'eval_accuracy_other')} | "
                     f"{arrow(run, 'eval_accuracy_no_tool')} | "
                     f"{arrow(run, 'eval_calls', '.2f')} | "
                     f"{f(a, 'eval_call_share_hard', '.2f')} "
                     f"/ {f(a, 'eval_call_share_easy', '.2f')} | {f(a, 'eval_accuracy_called')} "
                     f"/ {f(a, 'eval_accuracy_uncalled')} | {f(a, 'eval_pass_at_1')} | "
                     f"{run['seconds']:.0f} |")
    marks = sorted({r["step"] for run in results.values()
                    for r in run["steps"] if r["step"] % 10 == 0})
    lines += ["", "Calls per training episode (sampled at temperature 1) and training accuracy, "
                  "by step:", "", "| run | " + " | ".join(f"step {s}" for s in marks) + " |",
              "| --- |" + " ---: |" * len(marks)]
    for name, run in results.items():
        by_step = {r["step"]: r for r in run["steps"]}
        cells = [f"{by_step[s]['calls']:.2f} "
                 f"({by_step[s]['accuracy']:.2f})" if s in by_step else "-" for s in marks]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "The environment's tokens: their mean log-probability under the policy "
                  "(env_logp) and the KL to the reference, first and last logged step:", "",
              "| run | env_logp | kl_exact | entropy |", "| --- | --- | --- | --- |"]
    for name, run in results.items():
        s0, s1 = run["steps"][0], run["steps"][-1]
        lines.append(f"| {name} | {s0['env_logp']:.2f} -> {s1['env_logp']:.2f} | "
                     f"{s0['kl_exact']:.4f} -> {s1['kl_exact']:.4f} | "
                     f"{s0['entropy']:.3f} -> {s1['entropy']:.3f} |")
    two = {n: r for n, r in results.items() if "eval_accuracy_turn2" in r["after"]}
    if two:
        lines += ["", "Two attempts (--turns 2), held-out greedy, before -> after:", "",
                  "| run | first attempt | second attempt | wrong to right | right to wrong | "
                  "second-attempt calls |", "| --- | --- | --- | --- | --- | --- |"]
        for name, run in two.items():
            lines.append(f"| {name} | {arrow(run, 'eval_accuracy')} | "
                         f"{arrow(run, 'eval_accuracy_turn2')} | "
                         f"{arrow(run, 'eval_wrong_to_right')} | "
                         f"{arrow(run, 'eval_right_to_wrong')} | "
                         f"{arrow(run, 'eval_calls_turn2', '.2f')} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description="agent.py: tool use, a call's cost, the masking "
                                                 "pitfall, two attempts")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS),
                        help="the settings to run")
    parser.add_argument("--seed", type=int, default=0, help="the seed of every run")
    parser.add_argument("--out", default="out/agent_study", help="folder for the runs")
    parser.add_argument("--results", default="results/agent",
                        help="folder for the tables and numbers")
    parser.add_argument("--table_only", action="store_true",
                        help="only print the tables of the runs already there")
    args = parser.parse_args()
    results = {}
    for name in args.runs:
        out = os.path.join(args.out, name.replace(" ", "_"))
        cmd = [sys.executable, "agent.py", *RUNS[name], "--seed", str(args.seed), "--out", out]
        done = os.path.exists(os.path.join(ROOT, out, "agent.pt"))
        if not args.table_only and not done:
            print(" ".join(["python"] + cmd[1:]), flush=True)
            subprocess.run(cmd, check=True, cwd=ROOT)
        if os.path.exists(os.path.join(ROOT, out, "agent.pt")):
            results[name] = read(os.path.join(ROOT, out))
    if not results:
        raise SystemExit(f"error: no finished agent.py runs in {args.out}; run without "
                         f"--table_only first")
    text = tables(results, args.seed)
    folder = os.path.join(ROOT, args.results)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "results.md"), "w") as f:
        f.write(text)
    with open(os.path.join(folder, "results.json"), "w") as f:
        json.dump({"seed": args.seed, "runs": {n: {k: r[k] for k in ("before", "after", "seconds")}
                                               for n, r in results.items()}}, f, indent=1)
    print("\n" + text)
    print(f"wrote {args.results}/results.md and results.json")


if __name__ == "__main__":
    main()
