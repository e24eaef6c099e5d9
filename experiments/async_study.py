"""
What asynchrony buys and what staleness costs: async_grpo.py against grpo.py on the same machine and
budget, then async_grpo.py across --max_lag and --is_correction.

    throughput   grpo.py (one process, --threads torch threads) against async_grpo.py (1 actor + 1
                 learner, one thread each), the same 50 steps of 32 prompts x 8 samples from the
                 same SFT policy: completions per second, held-out accuracy, and accuracy against
                 wall-clock time (a figure).
    staleness    async_grpo.py with --actors K (default 2: together they sample faster than the
                 learner trains, so that admission, not speed, bounds the lag) at --max_lag 0, 1, 2,
                 4, 8 and --is_correction none, truncate, mask: the lag reached, the importance
                 weights, the tokens outside [1/C, C], held-out accuracy (a table and a figure).
    Both report the sampler/learner log-prob gap at lag 0 (the correction's other use: numerics
    alone).

Every run is a subprocess with its own folder under --out (re-running skips finished runs); the
tables are printed and written, with the figures, to results/async/.

Run:
    # about 9 minutes on 2 idle CPU cores
    python experiments/async_study.py --part throughput --seeds 0 1 2
    # 15 runs a seed, about 30 minutes each
    python experiments/async_study.py --part staleness --seeds 0 1 2
    # re-print from the runs already there
    python experiments/async_study.py --table_only
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAGS = [0, 1, 2, 4, 8]
CORRECTIONS = ["none", "truncate", "mask"]


def rows_of(out, script):
    path = os.path.join(ROOT, out, script, "metrics.jsonl")
    done = os.path.exists(path) and os.path.exists(os.path.join(ROOT, out, f"{script}.pt"))
    return [json.loads(line) for line in open(path)] if done else None


def run(cmd, out, script, env, table_only):
    """The run's metrics rows, running it first unless it finished before."""
    if rows_of(out, script) is None and not table_only:
        print(" ".join(f"{k}={v}" for k, v in env.items()) + " python " + " ".join(cmd[1:]),
              flush=True)
        subprocess.run(cmd + ["--out", out], check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                       env={**os.environ, **env})
    return rows_of(out, script)


def summary(rows):
    evals = [r for r in rows if "eval_accuracy" in r]
    steps = [r for r in rows if r["step"] > 0]
    mean = lambda k: statistics.mean(r[k] for r in steps if k in r and r[k] == r[k]) if any(
        k in r and r[k] == r[k] for r in steps) else float("nan")
    return {"before": evals[0]["eval_accuracy"], "after": evals[-1]["eval_accuracy"],
            "seconds": steps[-1]["elapsed_s"], "samples": steps[-1]["samples"],
            "per_sec": steps[-1]["samples"] / steps[-1]["elapsed_s"],
            "curve": [(r.get("elapsed_s", 0.0), r["eval_accuracy"]) for r in evals],
            **{k: mean(k) for k in ("lag_mean", "is_weight_mean", "rho_outside_band",
                                    "logp_gap_lag0", "actor_busy", "learner_busy", "queue")},
            "lag_max": max((r.get("lag_max", 0) for r in steps), default=0)}


def fmt(values, f):
    values = [v for v in values if v == v]
    if not values:
        return "-"
    if len(values) == 1:
        return format(values[0], f)
    return f"{format(statistics.mean(values), f)} +- {format(statistics.stdev(values), f)}"


def throughput(args):
    # async_grpo.py with one thread per process gives each phase its own core; with two, the learner
    # (the bottleneck) also uses the core the actor leaves idle while it waits for weights, at the
    # price of oversubscribing the cores while both work.
    results = {"grpo.py": [], "async_grpo.py": [], "async_grpo.py --threads 2": []}
    for seed in args.seeds:
        common = ["--seed", str(seed), "--init", args.init, "--steps", str(args.steps)]
        for name, script, folder, threads, extra in (
                ("grpo.py", "grpo", "sync", args.threads, []),
                ("async_grpo.py", "async_grpo", "async", 1, ["--threads", "1"]),
                ("async_grpo.py --threads 2", "async_grpo", "async2", 2, ["--threads", "2"])):
            rows = run([sys.executable, f"{script}.py", *common, *extra],
                       f"{args.out}/{folder}-s{seed}", script, {"OMP_NUM_THREADS": str(threads)},
                       args.table_only)
            if rows is not None:                             # --table_only: the runs that are there
                results[name].append(summary(rows))
    results = {name: runs for name, runs in results.items() if runs}
    lines = [f"seeds {args.seeds}, {args.steps} steps of 32 prompts x 8 samples "
             f"from {args.init}; grpo.py with {args.threads} torch threads, async_grpo.py 1 "
             f"actor + 1 learner with 1 (or 2) threads each", "",
             "| script | completions / s | wall time s | held-out greedy, before -> after | "
             "lag mean (max) | actor busy | learner busy | "
             "sampler/learner gap at lag 0 (nats/token) |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for name, runs in results.items():
        c = lambda k, f: fmt([r[k] for r in runs], f)
        lag = (f"{c('lag_mean', '.2f')} ({max(r['lag_max'] for r in runs)})"
               if name != "grpo.py" else "0")
        lines.append(f"| `{name}` | {c('per_sec', '.1f')} | {c('seconds', '.0f')} | "
                     f"{c('before', '.3f')} -> **{c('after', '.3f')}** | {lag} | "
                     f"{c('actor_busy', '.2f')} | {c('learner_busy', '.2f')} | "
                     f"{c('logp_gap_lag0', '.1e')} |")
    figure(args, "throughput.png", {n: [r["curve"] for r in runs] for n, runs in results.items()},
           "wall-clock seconds (training only)", "held-out greedy accuracy")
    return lines


def staleness(args):
    lines = [f"seeds {args.seeds}, {args.steps} steps of 32 prompts x 8 samples "
             f"from {args.init}, --actors {args.actors}, one thread per process, C = 2", "",
             "| --max_lag | --is_correction | lag reached, mean (max) | mean weight | "
             "tokens with rho outside [1/C, C] | held-out greedy, before -> after |",
             "| ---: | --- | ---: | ---: | ---: | --- |"]
    curves = {c: [] for c in CORRECTIONS}        # per correction, per seed: [(lag, final accuracy)]
    for seed in args.seeds:                  # seed by seed, so that a cut-off sweep has whole seeds
        for correction in CORRECTIONS:
            curves[correction].append([])
        for lag in LAGS:
            for correction in CORRECTIONS:
                folder = f"{args.out}/lag{lag}-{correction}" + (f"-s{seed}" if seed else "")
                rows = run([sys.executable, "async_grpo.py", "--seed", str(seed),
                            "--init", args.init, "--steps", str(args.steps),
                            "--actors", str(args.actors), "--threads", "1", "--max_lag", str(lag),
                            "--is_correction", correction],
                           folder, "async_grpo", {"OMP_NUM_THREADS": "1"}, args.table_only)
                if rows is not None:
                    curves[correction][-1].append((lag, summary(rows)))
    for lag in LAGS:
        for correction in CORRECTIONS:
            runs = [r for seed_runs in curves[correction] for x, r in seed_runs if x == lag]
            if not runs:
                continue
            c = lambda k, f: fmt([r[k] for r in runs], f)
            lines.append(f"| {lag} | {correction} | {c('lag_mean', '.2f')} "
                         f"({max(r['lag_max'] for r in runs)}) | {c('is_weight_mean', '.3f')} | "
                         f"{c('rho_outside_band', '.4f')} | "
                         f"{c('before', '.3f')} -> **{c('after', '.3f')}** |")
    gaps = [r["logp_gap_lag0"] for runs in curves.values() for seed_runs in runs
            for _, r in seed_runs if r["logp_gap_lag0"] == r["logp_gap_lag0"]]
    if gaps:
        lines += ["", f"Sampler/learner log-prob gap at lag 0 (the same weights, float32): mean "
                      f"|log pi_learner - log mu_sampler| per token {statistics.mean(gaps):.1e} "
                      f"nats ({len(gaps)} runs)"]
    figure(args, "staleness.png", {c: [[(x, r["after"]) for x, r in seed_runs]
                                       for seed_runs in runs if seed_runs]
                                   for c, runs in curves.items()},
           "--max_lag", "held-out greedy accuracy")
    return lines


def figure(args, name, curves, xlabel, ylabel):
    """One line per key (a list of runs, each a list of (x, y)); nothing when matplotlib is
    missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, runs in curves.items():
        for i, points in enumerate(runs):
            ax.plot(*zip(*points), marker="o", ms=3, label=key if i == 0 else None,
                    color=f"C{list(curves).index(key)}", alpha=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    ax.grid(alpha=0.3)
    os.makedirs(args.results, exist_ok=True)
    fig.savefig(os.path.join(args.results, name), dpi=120, bbox_inches="tight")


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--part", choices=["throughput", "staleness", "both"], default="both")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="the seeds of every run")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--actors", type=int, default=2,
                   help="staleness: actors, together faster than the learner")
    p.add_argument("--threads", type=int, default=2,
                   help="throughput: grpo.py's torch threads (the cores)")
    p.add_argument("--init", default="out/sft.pt")
    p.add_argument("--out", default="out/async_study")
    p.add_argument("--results", default="results/async", help="folder for the tables and figures")
    p.add_argument("--table_only", action="store_true")
    args = p.parse_args()
    if args.steps < 1 or args.actors < 1 or args.threads < 1 or any(s < 0 for s in args.seeds):
        p.error("--steps, --actors and --threads must be at least 1, seeds at least 0")
    lines = []
    if args.part in ("throughput", "both"):
        lines += ["## Throughput", ""] + throughput(args) + [""]
    if args.part in ("staleness", "both"):
        lines += ["## Staleness", ""] + staleness(args) + [""]
    print("\n".join(lines))
    os.makedirs(args.results, exist_ok=True)
    with open(os.path.join(args.results, f"{args.part}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
