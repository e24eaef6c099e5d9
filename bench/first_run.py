"""
The first run a newcomer makes, before and after a change, side by side: `python grpo.py` with no
arguments (sft.py builds out/sft.pt, then 50 GRPO steps) in a fresh folder, once from a checkout of
--before (a commit, made with `git worktree`) and once from this tree, alternating --rounds times,
each with --threads torch threads and, with --load N, N busy processes beside it.

Prints each run's wall time (the whole command; sft.py's and grpo.py's from their `done:` lines)
and held-out figures, then the medians and the speed-up. Both sides must end at the same held-out
figures (a change of schedule that changed them would be said here); metrics.jsonl's rows are
compared too, times aside.

    python bench/first_run.py --before 47d4fe0                 # idle, 2 rounds
    python bench/first_run.py --before 47d4fe0 --threads 1 --load 1
    python bench/first_run.py --before HEAD --sft_steps 50 --steps 4 --rounds 1    # a quick look
"""
import argparse
import json
import multiprocessing
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMES = ("elapsed_s", "tokens_per_sec", "completions_per_sec")


def busy():
    while True:
        pass


def first_run(tree, out, args):
    """`python grpo.py` in `tree` with a fresh out/ (a link to `out`): wall seconds, sft's and
    grpo's `done:` lines, and both metrics.jsonl's rows without their times."""
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    link = os.path.join(tree, "out")
    if os.path.islink(link):
        os.remove(link)
    if os.path.exists(link):
        raise SystemExit(f"{link} exists: run the bench from a tree without an out/ folder")
    os.symlink(out, link)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    extra = [] if args.steps is None else ["--steps", str(args.steps)]
    t = time.time()
    try:
        if args.sft_steps is not None:      # a shorter start, built first (grpo.py would build it)
            subprocess.run([sys.executable, "sft.py", "--steps", str(args.sft_steps)], cwd=tree,
                           env=env, check=True, capture_output=True, text=True)
        p = subprocess.run([sys.executable, "grpo.py", *extra], cwd=tree, env=env,
                           capture_output=True, text=True)
    finally:
        os.remove(link)
    seconds = time.time() - t
    if p.returncode:
        raise SystemExit(f"python grpo.py failed in {tree}:\n{p.stderr[-2000:]}")
    rows = {}
    for script in ("sft", "grpo"):
        path = os.path.join(out, script, "metrics.jsonl")
        rows[script] = [{k: v for k, v in json.loads(line).items() if k not in TIMES}
                        for line in open(path)]
    done = re.findall(r"^done: (\d+) steps in (\d+)s.*$", p.stdout, re.M)   # sft.py's, grpo.py's
    return {"seconds": seconds, "rows": rows, "done": re.findall(r"^done: .*$", p.stdout, re.M),
            "script_s": [float(s) for _, s in done]}


def main():
    p = argparse.ArgumentParser(description="python grpo.py's first run, before and after")
    p.add_argument("--before", required=True, help="the commit to compare with (git worktree)")
    p.add_argument("--rounds", type=int, default=2, help="alternations of before, after")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of both sides")
    p.add_argument("--load", type=int, default=0, help="busy processes beside the runs")
    p.add_argument("--sft_steps", type=int, default=None, help="a shorter SFT start")
    p.add_argument("--steps", type=int, default=None, help="grpo.py --steps (default its 50)")
    p.add_argument("--out", default="/tmp/first_run", help="scratch folder")
    args = p.parse_args()
    if args.rounds < 1 or args.threads < 1 or args.load < 0:
        p.error(f"--rounds {args.rounds}, --threads {args.threads}, --load {args.load}: rounds "
                "and threads at least 1, load at least 0")
    before = os.path.join(args.out, "before")
    if not os.path.isdir(before):
        subprocess.run(["git", "worktree", "add", "--detach", before, args.before], cwd=ROOT,
                       check=True, capture_output=True)
    else:
        subprocess.run(["git", "checkout", "--detach", "-q", args.before], cwd=before, check=True)
    loaders = [multiprocessing.Process(target=busy, daemon=True) for _ in range(args.load)]
    for proc in loaders:
        proc.start()
    runs = {"before": [], "after": []}
    try:
        for r in range(args.rounds):
            for side, tree in (("before", before), ("after", ROOT)):
                got = first_run(tree, os.path.join(args.out, f"{side}-out"), args)
                runs[side].append(got)
                parts = " + ".join(f"{s:.0f}" for s in got["script_s"])
                print(f"round {r} {side:6s} {got['seconds']:6.0f} s (scripts' own: {parts}) | "
                      f"{got['done'][-1] if got['done'] else ''}", flush=True)
    finally:
        for proc in loaders:
            proc.kill()
    b, a = (statistics.median(x["seconds"] for x in runs[s]) for s in ("before", "after"))
    print(f"\n{args.threads} thread(s), load {args.load}, {args.rounds} round(s): before "
          f"{args.before} {b:.0f} s, after {a:.0f} s: {b / a:.2f}x faster")
    for script in ("sft", "grpo"):
        old, new = runs["before"][-1]["rows"][script], runs["after"][-1]["rows"][script]
        greedy = lambda rows: [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy"
                               in r]
        same = "the same" if greedy(old) == greedy(new) else "DIFFERENT"
        print(f"{script}.py held-out greedy accuracy at each evaluation: {same} "
              f"(last: {greedy(old)[-1][1]:.3f} -> {greedy(new)[-1][1]:.3f})")


if __name__ == "__main__":
    main()
