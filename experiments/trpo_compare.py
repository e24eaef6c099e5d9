"""
TRPO against PPO and GRPO on the same batch: seconds per update, KL(pi_old || pi_new) per update,
and held-out accuracy after the same number of updates. "Mathematically heavy" made concrete.

Same batch: 256 completions per update for all three. TRPO and GRPO draw 32 prompts x 8 samples; PPO
draws 256 prompts x 1 (`--batch_size 256`) with `--reward verifier`, so that all three train on the
verifier's reward (PPO's critic then starts from the SFT policy). Everything else is each script's
default, but for TRPO's trust region, --max_kl 0.02 (the default was 0.02 when the study ran; it is
0.01 now, with twice the batch): 10 conjugate-gradient iterations; GRPO's one AdamW step per batch;
PPO's 4 epochs x 2 minibatches of AdamW steps per batch.

For each algorithm:
1. One run of N updates (`--log_every 1`, evaluated on the 512 held-out problems after the last).
   Seconds per
   update: the median over updates 1..N-1 of the time between consecutive log lines (the N-th
   includes the evaluation and is left out), rollout included. The rollout alone: TRPO logs it
   (t_rollout); for GRPO and PPO the bench times task.rollout of the SFT policy on the same shapes
   (median of 3), and "update only" is the step minus that.
2. The same N updates again, one per process (`--steps k --resume`, k = 1..N; resume is bit-exact,
   so these are the same updates: the bench checks that the last one's weights equal run 1's),
   keeping each checkpoint. The bench then measures every update's KL(pi_old || pi_new) exactly and
   the same way for all three: 256 training prompts (fixed), one completion each sampled from pi_old
   at temperature 1, the exact KL over the vocabulary (kernels.kl) at every completion token,
   averaged over tokens: the quantity TRPO's constraint bounds, measured on fresh samples rather
   than on the update's own batch.
Beside it, the KL each script logs: TRPO's kl_step (exact, on the update's own batch: at most max_kl
by construction); PPO's approx_kl (the k3 estimate of KL(old || current) on each minibatch before
its gradient step, averaged over the minibatches and epochs: it misses the move of the last step, so
it runs below the update's KL); GRPO at --mu 1 logs none (its approx_kl is taken before its only
step, where the ratio is 1: 0).

Run:
    # N = 10 updates each, seed 0: about 10 minutes on 2 CPU cores
    python experiments/trpo_compare.py
    # print the table again from the runs in out/trpo_compare
    python experiments/trpo_compare.py --table_only
Writes out/trpo_compare/<algorithm>/ (runs, checkpoints) and out/trpo_compare/table.md.
"""
import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import task  # noqa: E402
from hf.checkpoint import load_checkpoint  # noqa: E402
from kernels import kl  # noqa: E402
from model import completion_logits  # noqa: E402
from plumbing.loading import load_model  # noqa: E402

ALGORITHMS = {  # name -> (script, flags): 256 completions per update each
    "TRPO": ("trpo.py", ["--prompts_per_step", "32", "--group_size", "8", "--max_kl", "0.02"]),
    "GRPO": ("grpo.py", ["--prompts_per_step", "32", "--group_size", "8"]),
    "PPO": ("ppo.py", ["--batch_size", "256", "--reward", "verifier"]),
}
# the KL(old || new) each script logs
SCRIPT_KL = {"TRPO": "kl_step", "GRPO": None, "PPO": "approx_kl"}


def init_path(args):
    return os.path.join(ROOT, args.init)                   # relative to the repository, or absolute


def run(cmd, log):
    print("python " + " ".join(cmd[1:]), flush=True)
    with open(log, "a") as f:
        if subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode != 0:
            raise SystemExit(f"error: `{' '.join(cmd[1:])}` failed; its output is in {log}")


def rows(out, script):
    return [json.loads(line) for line in open(os.path.join(out, script[:-3], "metrics.jsonl"))]


def train(name, args):
    """Run 1 (straight) and run 2 (one update per process, checkpoints kept) for one algorithm."""
    script, flags = ALGORITHMS[name]
    base = os.path.join(ROOT, args.out, name.lower())
    common = [sys.executable, script, *flags, "--seed", str(args.seed), "--init", init_path(args)]
    straight, chained = os.path.join(base, "straight"), os.path.join(base, "chained")
    for d in (straight, chained):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    run(common + ["--steps", str(args.updates), "--log_every", "1",
                  "--eval_every", str(args.updates), "--out", straight],
        os.path.join(base, "straight.log"))
    for k in range(1, args.updates + 1):
        run(common + ["--steps", str(k), "--log_every", "1", "--eval_every", "1", "--eval_n", "1",
                      "--out", chained] + (["--resume"] if k > 1 else []),
            os.path.join(base, "chained.log"))
        shutil.copy(os.path.join(chained, f"{script[:-3]}.pt"), os.path.join(base, f"update{k}.pt"))


@torch.no_grad()
def update_kl(old_path, new_path, prompts, seed):
    """Exact KL(pi_old || pi_new) per completion token, on completions sampled from pi_old (one per
    prompt, T = 1)."""
    old, tok, _ = load_model(old_path, "cpu")
    new, _, _ = load_model(new_path, "cpu")
    prompt, prompt_mask, tokens, mask, *_ = task.rollout(
        old, tok, prompts, 1, 1.0, generator=torch.Generator().manual_seed(seed))
    batch = (prompt, prompt_mask, tokens, mask)
    per_token = kl(completion_logits(old, *batch), completion_logits(new, *batch))      # (B, Tn)
    return (torch.where(mask > 0, per_token, 0.0).sum() / mask.sum()).item()


@torch.no_grad()
def rollout_seconds(init, P, G):
    policy, tok, _ = load_model(init, "cpu")
    prompts = task.sample_prompts(random.Random(0), P)
    times = []
    for i in range(3):
        t = time.perf_counter()
        task.rollout(policy, tok, prompts, G, 1.0, generator=torch.Generator().manual_seed(i))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(name, args):
    script, _ = ALGORITHMS[name]
    base = os.path.join(ROOT, args.out, name.lower())
    log = rows(os.path.join(base, "straight"), script)
    steps = [r for r in log if r["step"] > 0]
    # from the start of update 1 to each update's log line
    elapsed = [r["elapsed_s"] for r in steps]
    # updates 1..N-1 (N has the evaluation)
    times = [elapsed[0]] + [b - a for a, b in zip(elapsed[:-2], elapsed[1:-1])]
    a_ckpt = load_checkpoint(os.path.join(base, "straight", f"{script[:-3]}.pt"))[1]["model"]
    b_ckpt = load_checkpoint(os.path.join(base, f"update{args.updates}.pt"))[1]["model"]
    same = all(torch.equal(a_ckpt[k], b_ckpt[k]) for k in a_ckpt)
    prompts = task.sample_prompts(random.Random(1234), 256)
    paths = [init_path(args)] + [os.path.join(base, f"update{k}.pt")
                                 for k in range(1, args.updates + 1)]
    kls = [update_kl(a, b, prompts, args.seed) for a, b in zip(paths, paths[1:])]
    logged = [r.get(SCRIPT_KL[name]) for r in steps] if SCRIPT_KL[name] else None
    result = {"step_s": statistics.median(times), "kl": kls, "logged_kl": logged,
              "same_weights": same, "before": log[0]["eval_accuracy"],
              "after": steps[-1]["eval_accuracy"], "samples": steps[-1]["samples"]}
    if name == "TRPO":
        result["rollout_s"] = statistics.median(r["t_rollout"] for r in steps[:-1])
        result["cg_s"] = statistics.median(r["t_cg"] for r in steps[:-1])
        result["ls_s"] = statistics.median(r["t_linesearch"] for r in steps[:-1])
        result["backtracks"] = statistics.mean(r["backtracks"] for r in steps)
        result["violations"] = steps[-1]["violations"]
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--updates", type=int, default=10, help="N: updates per algorithm")
    p.add_argument("--seed", type=int, default=0, help="--seed of every run")
    p.add_argument("--init", default="out/sft.pt",
                   help="the SFT policy every run starts from (built first if missing)")
    p.add_argument("--out", default="out/trpo_compare", help="folder for the runs and the table")
    p.add_argument("--only", nargs="+", choices=list(ALGORITHMS), default=list(ALGORITHMS),
                   help="algorithms to run")
    p.add_argument("--table_only", action="store_true",
                   help="print the table from the runs already there")
    args = p.parse_args()
    if args.updates < 3 or args.seed < 0:
        p.error(f"--updates {args.updates}, --seed {args.seed}: updates must be at least 3 and "
                f"the seed at least 0")
    if not os.path.exists(init_path(args)) and init_path(args) != os.path.join(ROOT, "out",
                                                                               "sft.pt"):
        # the default is built by the first script if missing
        p.error(f"--init {args.init} does not exist")
    started = time.time()
    if not args.table_only:
        for name in args.only:
            os.makedirs(os.path.join(ROOT, args.out, name.lower()), exist_ok=True)
            train(name, args)
    torch.set_grad_enabled(False)
    results = {name: measure(name, args) for name in args.only}
    rollout = {"GRPO": rollout_seconds(init_path(args), 32, 8),
               "PPO": rollout_seconds(init_path(args), 256, 1)}
    fmt_kl = lambda xs: f"{statistics.median(xs):.4f} (max {max(xs):.4f})"
    lines = [f"N = {args.updates} updates of 256 completions each, seed {args.seed}, "
             f"from {args.init}; `python experiments/trpo_compare.py"
             f"{'' if args.updates == 10 else f' --updates {args.updates}'}`", "",
             "| algorithm | s per update (rollout included) | rollout s | "
             "update s (without rollout) | "
             "exact KL(pi_old \\|\\| pi_new) per token, median over updates (max) "
             "| the script's own logged KL, median (max) | "
             f"held-out greedy accuracy, before -> after {args.updates} updates |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in results.items():
        roll = r.get("rollout_s", rollout.get(name))
        own = "none (0 by construction at --mu 1)" if r["logged_kl"] is None else \
            f"{SCRIPT_KL[name]} {fmt_kl(r['logged_kl'])}"
        lines.append(f"| {name} | {r['step_s']:.2f} | {roll:.2f} | {r['step_s'] - roll:.2f} | "
                     f"{fmt_kl(r['kl'])} | {own} | {r['before']:.3f} -> **{r['after']:.3f}** |")
    if "TRPO" in results:
        r = results["TRPO"]
        lines += ["", f"TRPO's update, median seconds: conjugate gradient (11 Fisher-vector "
                      f"products with the KL's graph) {r['cg_s']:.2f}, line "
                      f"search {r['ls_s']:.2f}; backtracks per update {r['backtracks']:.1f} "
                      f"(mean); trust-region violations {r['violations']}."]
    lines += ["", "Bit-exact replays (run 2's last weights equal run 1's): "
              + ", ".join(f"{n} {'yes' if r['same_weights'] else 'NO'}" for n, r in results.items())
              + f". Bench wall time {time.time() - started:.0f} s."]
    table = "\n".join(lines)
    print("\n" + table)
    with open(os.path.join(ROOT, args.out, "table.md"), "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    main()
