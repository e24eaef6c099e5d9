"""
Reward-model over-optimisation (Goodhart's law) made visible: PPO against the learned reward model
with no KL anchor (beta = 0), trained long, with the proxy (reward-model score) and the truth (the
verifier's accuracy) measured side by side on the same completions. Gao, Schulman and Hilton 2022,
"Scaling Laws for Reward Model Overoptimization", arXiv 2210.10760, show the shape on
human-preference tasks with a larger "gold" reward model; here the gold reward is exact.

It runs ppo.py (`--beta 0`, longer, an evaluation every `--every` steps) into out/ppo/overopt/, then
prints a markdown table against KL(pi || pi_ref): the reward model's mean score and the verifier's
accuracy of the greedy completions on the held-out prompts, and the same pair on the training
rollouts.

Run:
    # about 10 minutes on 2 CPU cores
    python experiments/overoptimisation.py
    # re-print the table from out/ppo/overopt/ppo/metrics.jsonl
    python experiments/overoptimisation.py --table_only
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def table(rows):
    """Markdown table: one line per evaluation step."""
    lines = ["| PPO step | KL(pi \\|\\| pi_ref) per completion | "
             "RM score, held-out greedy (proxy) | gold accuracy, held-out greedy (verifier) | "
             "RM score, rollouts | gold accuracy, rollouts |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        fmt = lambda key, f: format(r[key], f) if r.get(key) is not None else "-"
        lines.append(f"| {r['step']} | {fmt('kl', '.2f')} | {fmt('eval_rm_score', '+.2f')} | "
                     f"{fmt('eval_accuracy', '.3f')} | "
                     f"{fmt('rm_score', '+.2f')} | {fmt('gold_accuracy', '.3f')} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description="PPO with beta = 0 against the reward model: "
                                                 "proxy score vs gold accuracy")
    parser.add_argument("--steps", type=int, default=90, help="PPO steps")
    parser.add_argument("--every", type=int, default=10,
                        help="evaluate (and log) every this many steps")
    parser.add_argument("--eval_n", type=int, default=256, help="held-out prompts per evaluation")
    parser.add_argument("--out", default="out/ppo/overopt", help="ppo.py --out folder for this run")
    parser.add_argument("--seed", type=int, default=0, help="ppo.py --seed")
    parser.add_argument("--table_only", action="store_true",
                        help="only print the table of an earlier run")
    args = parser.parse_args()
    if args.steps < 1 or args.every < 1:
        parser.error(f"--steps = {args.steps}, --every = {args.every}; both must be at least 1")
    if not args.table_only:
        cmd = [sys.executable, "ppo.py", "--beta", "0", "--steps", str(args.steps),
               "--eval_every", str(args.every), "--log_every", str(args.every),
               "--eval_n", str(args.eval_n), "--out", args.out, "--seed", str(args.seed)]
        print(" ".join(cmd[1:]))
        subprocess.run(cmd, check=True, cwd=ROOT)
    path = os.path.join(ROOT, args.out, "ppo", "metrics.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"{path} not found: run without --table_only first")
    rows = [json.loads(line) for line in open(path)]
    rows = [r for r in rows if "eval_accuracy" in r]
    rows[0]["kl"] = rows[0].get("kl", 0.0)  # step 0 is the SFT policy itself
    print(table(rows))


if __name__ == "__main__":
    main()
