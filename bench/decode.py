"""
The eager decode (sampler.generate off CUDA), before and after a change, side by side: the rollouts
a default `python grpo.py` makes, timed in this tree and in a checkout of --before (a commit, made
with `git worktree`), alternating --rounds times in fresh processes, and compared bit for bit.

Two rollouts of the SFT policy (--init, default out/sft.pt; a random model if it is missing, whose
rows never end): a training step's (32 prompts x 8 samples, temperature 1, 24 new tokens, the
sampler's log-probs) and the held-out evaluation's (512 prompts, greedy, 24 new tokens). Each side
reports the best of --repeats calls; the tokens, masks and log-probs must be equal bit for bit.

    python bench/decode.py --before 5d48d14                 # 2 threads, 3 rounds
    python bench/decode.py --before 5d48d14 --threads 1
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROLLOUTS = {"train": (32, 8, 1.0), "eval": (512, 1, 0.0)}   # prompts, samples, temperature


def worker(tree, init, repeats, out):
    """In `tree`'s modules: each rollout's best seconds, its outputs saved to `out`."""
    sys.path.insert(0, tree)
    import torch
    import sampler
    import task
    from hf.tokenizer import Tokenizer
    from model import GPT, GPTConfig
    from plumbing.loading import load_model
    if os.path.exists(init):
        model, tok, _ = load_model(init, "cpu")
    else:
        torch.manual_seed(0)
        model, tok = GPT(GPTConfig()).eval(), Tokenizer()
    prompts = task.eval_prompts()
    seconds, outputs = {}, {}
    for name, (n, samples, temperature) in ROLLOUTS.items():
        idx, mask = tok.encode_batch(prompts[:n], "cpu")
        best = float("inf")
        for _ in range(repeats):
            g = torch.Generator().manual_seed(0)
            t = time.perf_counter()
            got = sampler.generate(model, idx, mask, 24, tok.stop_ids, tok.pad_id,
                                   num_samples=samples, temperature=temperature, generator=g,
                                   mode="eager", return_logprobs=True)
            best = min(best, time.perf_counter() - t)
        seconds[name], outputs[name] = best, got
    torch.save(outputs, out)
    print(" ".join(f"{k}={v:.6f}" for k, v in seconds.items()))


def run_side(tree, args, out):
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    p = subprocess.run([sys.executable, __file__, "--worker", tree, "--init", args.init,
                        "--repeats", str(args.repeats), "--save", out], env=env,
                       capture_output=True, text=True, cwd=tree)
    if p.returncode:
        raise SystemExit(f"the worker failed in {tree}:\n{p.stderr[-2000:]}")
    return {k: float(v) for k, v in (kv.split("=") for kv in p.stdout.split()[-2:])}


def main():
    p = argparse.ArgumentParser(description="the eager decode, before and after")
    p.add_argument("--before", default=None, help="the commit to compare with (git worktree)")
    p.add_argument("--init", default=os.path.join(ROOT, "out", "sft.pt"),
                   help="the policy (default out/sft.pt; a random model if missing)")
    p.add_argument("--rounds", type=int, default=3, help="alternations of before, after")
    p.add_argument("--repeats", type=int, default=3, help="calls a side times (best is kept)")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of both sides")
    p.add_argument("--out", default="/tmp/bench_decode", help="scratch folder")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--save", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.init = os.path.abspath(args.init)
    if args.worker:
        return worker(args.worker, args.init, args.repeats, args.save)
    if not args.before or args.rounds < 1 or args.repeats < 1 or args.threads < 1:
        p.error(f"--before {args.before}, --rounds {args.rounds}, --repeats {args.repeats}, "
                f"--threads {args.threads}: a commit, and rounds, repeats, threads at least 1")
    import torch
    before = os.path.join(args.out, "before")
    if not os.path.isdir(before):
        subprocess.run(["git", "worktree", "add", "--detach", before, args.before], cwd=ROOT,
                       check=True, capture_output=True)
    else:
        subprocess.run(["git", "checkout", "--detach", "-q", args.before], cwd=before, check=True)
    policy = args.init if os.path.exists(args.init) else "a random model (no out/sft.pt)"
    print(f"policy {policy}; {args.threads} thread(s), torch {torch.__version__}")
    times = {"before": [], "after": []}
    saved = {}
    for r in range(args.rounds):
        for side, tree in (("before", before), ("after", ROOT)):
            saved[side] = os.path.join(tempfile.gettempdir(), f"bench_decode_{side}.pt")
            got = run_side(tree, args, saved[side])
            times[side].append(got)
            print(f"round {r} {side:6s} " + "  ".join(f"{k} {v * 1e3:7.1f} ms"
                                                      for k, v in got.items()), flush=True)
    old, new = (torch.load(saved[s]) for s in ("before", "after"))
    for name, (n, samples, _) in ROLLOUTS.items():
        b, a = (statistics.median(t[name] for t in times[s]) for s in ("before", "after"))
        same = all(torch.equal(x, y) for x, y in zip(old[name], new[name]))
        rows, mask = n * samples, new[name][1]
        print(f"{name}: {rows} rows, {int(mask.sum())} tokens in {mask.size(1)} steps: before "
              f"{b * 1e3:.1f} ms, after {a * 1e3:.1f} ms, {b / a:.2f}x; tokens, mask and "
              f"log-probs {'equal bit for bit' if same else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
