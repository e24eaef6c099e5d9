"""
How many torch threads a GRPO step should use here: the same steps of grpo.py in this process at
each --threads count in turn, alternating --rounds times, idle or beside --load busy processes
(a shared machine: every OpenMP parallel region waits at its barrier for a descheduled thread).

Prints each run's seconds a step (the median of its logged steps' elapsed_s differences, the last
step, which evaluates, left out) and, for each count, the median over rounds.

    python bench/threads.py                                  # the toy's default step, idle
    python bench/threads.py --load 2                         # beside two busy processes
    python bench/threads.py --init out/smollm2 --chat --prompts_per_step 8 --steps 3 --rounds 2
"""
import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import grpo  # noqa: E402


def busy():
    while True:
        pass


def seconds_a_step(argv, threads):
    set_before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)    # else the run picks its own (pick_threads)
    torch.set_num_threads(threads)
    out = tempfile.mkdtemp(prefix="threads-")
    try:
        grpo.main(grpo.parse_args(argv + ["--out", out]))
        rows = [json.loads(line) for line in open(os.path.join(out, "grpo", "metrics.jsonl"))]
    finally:
        shutil.rmtree(out, ignore_errors=True)
        if set_before is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = set_before
    times = [r["elapsed_s"] for r in rows if r["step"] > 0][:-1]     # the evaluating last left out
    return statistics.median(b - a for a, b in zip([0.0] + times, times))


def main():
    p = argparse.ArgumentParser(description="grpo.py's step at each thread count, alternating")
    p.add_argument("--init", default=os.path.join(ROOT, "out", "sft.pt"),
                   help="the policy (default: the first run's out/sft.pt)")
    p.add_argument("--chat", action="store_true", help="grpo.py --chat (a real model's template)")
    p.add_argument("--prompts_per_step", type=int, default=32)
    p.add_argument("--steps", type=int, default=6, help="steps a run (the last one evaluates)")
    p.add_argument("--rounds", type=int, default=3, help="alternations of the thread counts")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--load", type=int, default=0, help="busy processes beside the runs")
    args = p.parse_args()
    if args.steps < 3 or args.rounds < 1 or min(args.threads) < 1 or args.load < 0:
        p.error(f"--steps {args.steps}, --rounds {args.rounds}, --threads {args.threads}, --load "
                f"{args.load}: steps at least 3, rounds and threads at least 1, load at least 0")
    if not os.path.exists(args.init):
        p.error(f"--init {args.init}: not there (python sft.py builds out/sft.pt)")
    argv = ["--init", args.init, "--steps", str(args.steps), "--prompts_per_step",
            str(args.prompts_per_step), "--log_every", "1", "--eval_every", str(args.steps),
            "--eval_n", "8"] + (["--chat"] if args.chat else [])
    loaders = [multiprocessing.Process(target=busy, daemon=True) for _ in range(args.load)]
    for proc in loaders:
        proc.start()
    got = {t: [] for t in args.threads}
    try:
        for r in range(args.rounds):
            for t in args.threads:
                got[t].append(seconds_a_step(argv, t))
                print(f"round {r}: {t} thread(s) {got[t][-1]:.3f} s a step", flush=True)
    finally:
        for proc in loaders:
            proc.kill()
    print(f"\n{os.cpu_count()} cores, torch {torch.__version__}, load {args.load}, "
          f"{args.prompts_per_step} prompts x 8, medians of {args.rounds} round(s):")
    best = min(args.threads, key=lambda t: statistics.median(got[t]))
    for t in args.threads:
        m = statistics.median(got[t])
        print(f"  {t} thread(s): {m:.3f} s a step ({statistics.median(got[best]) / m:.2f}x the "
              f"fastest's speed)")


if __name__ == "__main__":
    main()
