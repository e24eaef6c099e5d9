"""
Results you can trust: every algorithm's default command over several seeds, with mean, spread and
learning curves.

For each seed s (default 0, 1 and 2) it trains the seed's own SFT policy, then runs every training
script that starts from it, each with its default settings, all into one folder per seed,
D = results/runs/seed<s>:

    python sft.py --seed s --out D
    python reward_model.py --seed s --init D/sft.pt --out D        the reward model (for --rm)
    python X.py --seed s --init D/sft.pt --out D [--rm D/rm.pt]    every other algorithm X

Which scripts: every top-level *.py whose parse_args has an --init flag defaulting to flags.SFT_PATH
(it starts from the SFT policy), except prm.py and search.py (test-time tools with outputs of their
own). A new algorithm file is picked up without editing this one. A script with an --rm flag is
given the seed's reward model, which is trained first.

Resumable: a run is done when its checkpoint is at the script's step limit and its metrics log ends
with an evaluation at that step; done runs are skipped. A run cut short (Ctrl-C, a kill, a crash)
that left a checkpoint continues from it with the script's --resume (bit-exact on CPU); one that
left none starts afresh. Ctrl-C stops the run in progress the way the scripts do (the step finishes,
a checkpoint is written), then the sweep. If a seed's SFT policy is (re)trained, every run of that
seed starts afresh from it.

Reproducible on CPU: every run gets OMP_NUM_THREADS=--threads (default 1). On a CPU the thread count
changes the order of float reductions, and an RL run that differs in one bit can end elsewhere: each
row's command, with its thread count, reproduces its number. The thread count, device and torch
version are recorded with every run.

Outputs, in results/ (results/quick/ with --quick):
    results.json              every run (its command, starting and final metrics, curve, wall and
                              CPU time) and, per algorithm, mean, std, min and max over the seeds
    results.md                the markdown table for the README
    accuracy_vs_step.png      held-out greedy accuracy against step, one line per algorithm: the
                              mean over seeds, the min-max range shaded
    accuracy_vs_samples.png   the same against completions sampled
Each process's output goes to D/<name>.log; its wall and CPU time (all attempts) to
D/<name>.time.json.

Run:
    # 3 seeds x every script: about 40 minutes on 2 CPU cores
    python experiments/results.py
    # one seed, one script (and the SFT policy it starts from)
    python experiments/results.py --seeds 0 --only grpo
    # rebuild the table and figures from the runs already there
    python experiments/results.py --table_only
    # redraw the figures from results.json alone (no runs needed)
    python experiments/results.py --figures_only
    # the pipeline on tiny settings, into results/quick/ (~3 min)
    python experiments/results.py --quick
"""
import argparse
import importlib
import inspect
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# start from the SFT policy but are test-time tools, with outputs of their own
NOT_ALGORITHMS = {"prm", "search"}
ORDER = ["sft", "reward_model", "grpo", "async_grpo", "rloo", "reinforce", "trpo", "ppo",
         "expert_iteration", "dpo", "ipo", "online_dpo", "kto", "simpo", "orpo"]
LABELS = {"sft": "SFT", "reward_model": "Reward model", "grpo": "GRPO", "rloo": "RLOO",
          "reinforce": "REINFORCE++", "trpo": "TRPO", "ppo": "PPO (reward model)",
          "expert_iteration": "Expert iteration", "dpo": "DPO", "ipo": "IPO",
          "async_grpo": "Async GRPO (1 actor)", "online_dpo": "Online DPO", "kto": "KTO",
          "simpo": "SimPO", "orpo": "ORPO"}
# the stem of a script's checkpoint and log, where it is not the script's name
FILES = {"reward_model": "rm"}
# --quick: tiny settings. The run flags every script has (flags.add_run_flags), then flags passed to
# the scripts that declare them; the SFT policy is tiny too.
QUICK_RUN = ["--eval_n", "32", "--eval_every", "2", "--log_every", "2"]
QUICK = {"--steps": "4", "--rounds": "2", "--epochs": "1", "--n_train": "128", "--n_pairs": "128",
         "--prompts_per_step": "8", "--prompts_per_round": "16", "--n_examples": "128"}
QUICK_SFT = ["--steps", "200", "--n_layer", "2", "--n_head", "2", "--n_embd", "64", "--lr", "3e-3",
             "--batch_size", "32",
             "--eval_n", "32", "--eval_every", "100", "--log_every", "50"]


# -----------------------------------------------------------------------------
# Which scripts, and the command of each

def discover(root=ROOT):
    """{script name: imported module} of the algorithms to run, in ORDER and then alphabetically:
    sft, and every top-level script whose parse_args has an --init flag defaulting to
    flags.SFT_PATH, except NOT_ALGORITHMS. A file that fails to import is left out with a warning
    (it may be half-written)."""
    from plumbing.flags import SFT_PATH
    found = {}
    for file in sorted(os.listdir(root)):
        name = file[:-3]
        if not file.endswith(".py") or name in NOT_ALGORITHMS:
            continue
        with open(os.path.join(root, file)) as f:
            source = f.read()
        if "\ndef parse_args" not in source or (name != "sft" and '"--init"' not in source):
            continue                                                # cheap filter before importing
        try:
            module = importlib.import_module(name)
            init = getattr(module.parse_args([]), "init", None)
        except (Exception, SystemExit) as e:
            print(f"warning: {file} left out: it does not import or parse "
                  f"({type(e).__name__}: {e})", file=sys.stderr)
            continue
        if name == "sft" or init == SFT_PATH:
            found[name] = module
    rank = lambda name: (ORDER.index(name) if name in ORDER else len(ORDER), name)
    return {name: found[name] for name in sorted(found, key=rank)}


def has_flag(module, flag):
    """True when the script declares `flag` (its source holds the string "--flag")."""
    return f'"{flag}"' in inspect.getsource(module)


def quick_flags(module, name):
    """The --quick flags this script takes."""
    if name == "sft":
        return list(QUICK_SFT)
    return QUICK_RUN + [x for flag, value in QUICK.items() if has_flag(module, flag)
                        for x in (flag, value)]


def command(module, name, seed, folder, quick=False, extra=()):
    """The argv (after `python`) of one run; extra: this script's share of the sweep's --task and
    --flags."""
    argv = [f"{name}.py", "--seed", str(seed), "--out", folder, *extra]
    if name != "sft":
        argv += ["--init", os.path.join(folder, "sft.pt")]
        if has_flag(module, "--rm"):
            argv += ["--rm", os.path.join(folder, "rm.pt")]
    return argv + (quick_flags(module, name) if quick else [])


def step_limit(module, argv):
    """The script's number of steps (args.steps, derived by parse_args where it comes from other
    flags)."""
    return module.parse_args(argv[1:]).steps


# -----------------------------------------------------------------------------
# Reading runs (pure functions, tested in tests/test_experiments.py)

def read_metrics(path):
    """The rows of a metrics.jsonl (a list of dicts); a last line cut short by a kill is dropped; []
    if no file."""
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    break
    return rows


def is_done(rows, checkpoint_step, steps):
    """A run is done when its checkpoint is at the step limit and its log's last row is an
    evaluation at that step."""
    if checkpoint_step != steps or not rows:
        return False
    last = rows[-1]
    return last.get("step") == steps and any(k.startswith("eval_") for k in last)


def curve(rows):
    """The evaluation rows of a log as a list of {step, samples, elapsed_s, eval_*} (samples 0 at
    step 0)."""
    out = []
    for r in rows:
        if any(k.startswith("eval_") for k in r):
            point = {"step": r["step"], "samples": r.get("samples", 0),
                     "elapsed_s": r.get("elapsed_s", 0.0)}
            out.append({**point, **{k: v for k, v in r.items() if k.startswith("eval_")}})
    return out


def spread(values):
    """mean, std (the sample std, n - 1; 0 for one value), min, max and n of a list of numbers."""
    values = [float(v) for v in values]
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "std": std, "min": min(values), "max": max(values),
            "n": len(values)}


def fmt_spread(s, f=".3f", range_=True):
    """'mean +- std [min, max]' ('mean' alone for one value)."""
    if s["n"] == 1:
        return format(s["mean"], f)
    text = f"{format(s['mean'], f)} +- {format(s['std'], f.lstrip('+'))}"
    return text + (f" [{format(s['min'], f)}, {format(s['max'], f)}]" if range_ else "")


def mean_curve(curves, x="step", y="eval_accuracy"):
    """Curves of several seeds -> (x mean, y mean, y min, y max) at the evaluation steps every seed
    has."""
    steps = sorted(set.intersection(*[{p["step"] for p in c} for c in curves]))
    at = [{p["step"]: p for p in c} for c in curves]
    xs, mean, lo, hi = [], [], [], []
    for step in steps:
        ys = [a[step][y] for a in at]
        xs.append(statistics.fmean(a[step][x] for a in at))
        mean.append(statistics.fmean(ys))
        lo.append(min(ys))
        hi.append(max(ys))
    return xs, mean, lo, hi


def summarise(runs):
    """Runs of one algorithm (dicts with before, after, seconds, process_s, samples) -> per-metric
    spread over seeds."""
    keys = {k for r in runs for k in r["after"]}
    every = lambda part: {k: spread([r[part][k] for r in runs]) for k in sorted(keys)
                          if all(k in r[part] for r in runs)}
    out = {"after": every("after"), "before": every("before"),
           "seconds": spread([r["seconds"] for r in runs]),
           "samples": spread([r["samples"] for r in runs]), "seeds": [r["seed"] for r in runs]}
    if all(r.get("process_s") is not None for r in runs):
        out["process_s"] = spread([r["process_s"] for r in runs])
    return out


def table(summaries, labels, commands):
    """The markdown table of the policies (summaries: {name: summarise(...)} of scripts evaluated by
    eval_accuracy)."""
    lines = ["| algorithm | held-out greedy accuracy, before -> after | precedence after | "
             "pass@1 after | wall time s (script / process) | completions sampled | "
             "seeds | command |", "| --- | --- | --- | --- | --- | ---: | ---: | --- |"]
    for name, s in summaries.items():
        before = fmt_spread(s["before"]["eval_accuracy"],
                            range_=False) if "eval_accuracy" in s["before"] else "-"
        after = s["after"]["eval_accuracy"]
        col = lambda key: fmt_spread(s["after"][key], range_=False) if key in s["after"] else "-"
        seconds = fmt_spread(s["seconds"], ".0f", range_=False)
        if "process_s" in s:
            seconds += f" / {fmt_spread(s['process_s'], '.0f', range_=False)}"
        samples = f"{s['samples']['mean']:,.0f}" + (
            f" +- {s['samples']['std']:,.0f}" if s["samples"]["std"] else "")
        lines.append(f"| {labels[name]} | {before} -> **{fmt_spread(after, range_=False)}** "
                     f"[{after['min']:.3f}, {after['max']:.3f}] "
                     f"| {col('eval_accuracy_precedence')} | {col('eval_pass_at_1')} | "
                     f"{seconds} | {samples} | {len(s['seeds'])} | `{commands[name]}` |")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# Running

def checkpoint_step(path):
    """The step a checkpoint was saved at, or None if there is none (or it cannot be read)."""
    import torch
    try:
        return torch.load(path, map_location="cpu", weights_only=True)["step"]
    except Exception:
        return None


def run_one(argv, log_path, time_path, resume, threads=1):
    """Run `python argv` (plus --resume) with OMP_NUM_THREADS=threads, its output appended to
    log_path; add its wall and CPU time to time_path. On Ctrl-C the script (which got the signal
    too) finishes its step and checkpoints; we wait for it, then stop. Returns the exit status."""
    argv = argv + (["--resume"] if resume else [])
    print(f"  OMP_NUM_THREADS={threads} python {' '.join(argv)}", flush=True)
    t0, c0 = time.time(), os.times()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with open(log_path, "a") as log:
        log.write(f"\n$ OMP_NUM_THREADS={threads} python {' '.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, env=env)
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            rc = proc.wait()                        # the script writes its checkpoint and exits 130
            rc = 130 if rc == 0 else rc
    c1 = os.times()
    timing = json.load(open(time_path)) if os.path.exists(time_path) else {
        "wall_s": 0.0, "cpu_s": 0.0, "attempts": []}
    wall, cpu = time.time() - t0, (c1.children_user - c0.children_user) + (c1.children_system
                                                                           - c0.children_system)
    timing["wall_s"] += wall
    timing["cpu_s"] += cpu
    timing["attempts"].append({"argv": argv, "rc": rc, "wall_s": wall, "cpu_s": cpu})
    with open(time_path, "w") as f:
        json.dump(timing, f, indent=1)
    with open(log_path) as f:
        done = [line.strip() for line in f if line.startswith("done:")]
    print(f"    {done[-1] if rc == 0 and done else f'exit status {rc} (output: {log_path})'} "
          f"[{wall:.0f} s wall, {cpu:.0f} s CPU]", flush=True)
    return rc


def sweep(scripts, seeds, runs_dir, only, quick, threads=1, extra=None):
    """Run what is not done yet, seed by seed. Returns the (seed, name) of the runs that failed."""
    needs_rm = lambda names: any(has_flag(scripts[n], "--rm") for n in names if n != "reward_model")
    wanted = [n for n in scripts if only is None or n in only or n == "sft"
              or (n == "reward_model" and needs_rm(only))]
    failed = []
    for seed in seeds:
        folder = os.path.join(os.path.relpath(runs_dir, ROOT), f"seed{seed}")
        # this seed's SFT policy was (re)trained just now
        fresh = False
        print(f"seed {seed}: {folder}", flush=True)
        for name in wanted:
            module, stem = scripts[name], FILES.get(name, name)
            argv = command(module, name, seed, folder, quick, (extra or {}).get(name, ()))
            steps = step_limit(module, argv)
            step = checkpoint_step(os.path.join(ROOT, folder, f"{stem}.pt"))
            if not fresh and is_done(read_metrics(os.path.join(ROOT, folder, stem,
                                                               "metrics.jsonl")), step, steps):
                print(f"  {name}: done (step {steps}), skipped", flush=True)
                continue
            missing = [p for p in ["sft"]
                       + ["reward_model"] * (name != "reward_model"
                                             and has_flag(module, "--rm")) if (seed, p) in failed]
            if name != "sft" and missing:
                print(f"  {name}: not run, {' and '.join(missing)} of seed {seed} failed",
                      flush=True)
                continue
            resume = step is not None and 0 < step < steps and not fresh   # else: a fresh start
            os.makedirs(os.path.join(ROOT, folder), exist_ok=True)
            rc = run_one(argv, os.path.join(ROOT, folder, f"{stem}.log"),
                         os.path.join(ROOT, folder, f"{stem}.time.json"), resume, threads)
            if rc == 130:
                raise SystemExit("stopped; run the same command again to continue where it stopped")
            if rc != 0:
                failed.append((seed, name))
            fresh = fresh or name == "sft"
    return failed


# -----------------------------------------------------------------------------
# Collecting, table, figures

def collect(scripts, seeds, runs_dir, quick, extra=None):
    """{name: [run, ...]} for the done runs (by their logs); a run: seed, command, before, after,
    curve, seconds, samples, process_s, cpu_s."""
    results = {}
    for name, module in scripts.items():
        for seed in seeds:
            folder = os.path.join(os.path.relpath(runs_dir, ROOT), f"seed{seed}")
            stem, argv = FILES.get(name, name), command(module, name, seed, folder, quick,
                                                        (extra or {}).get(name, ()))
            rows = read_metrics(os.path.join(ROOT, folder, stem, "metrics.jsonl"))
            points = curve(rows)
            if (not rows or not points or points[-1]["step"] != step_limit(module, argv)
                    or points[0]["step"] != 0):
                continue                                                 # not run, or not finished
            time_path = os.path.join(ROOT, folder, f"{stem}.time.json")
            timing = json.load(open(time_path)) if os.path.exists(time_path) else {}
            last = rows[-1]
            results.setdefault(name, []).append({
                "seed": seed, "command": "python " + " ".join(argv),
                "before": {k: v for k, v in points[0].items() if k.startswith("eval_")},
                "after": {k: v for k, v in points[-1].items() if k.startswith("eval_")},
                "seconds": last.get("elapsed_s", 0.0), "samples": last.get("samples", 0),
                "setting": {k: rows[0][k] for k in ("device", "threads", "torch") if k in rows[0]},
                "process_s": timing.get("wall_s"), "cpu_s": timing.get("cpu_s"), "curve": points})
    return results


def figures(results, labels, out_dir):
    """accuracy_vs_step.png (SFT on its own panel: its 1500 steps would squash the others) and
    accuracy_vs_samples.png (SFT samples no completions: left out): the mean over seeds, min-max
    shaded."""
    import matplotlib
    matplotlib.use("Agg")                                                # no display needed
    import matplotlib.pyplot as plt
    policies = {n: runs for n, runs in results.items() if "eval_accuracy" in runs[0]["after"]}
    written = []
    for x, file in (("step", "accuracy_vs_step.png"), ("samples", "accuracy_vs_samples.png")):
        panels = [(["sft"], "SFT, from random init",
                   "SFT step")] if x == "step" and "sft" in policies else []
        panels.append(([n for n in policies if n != "sft"], "from the SFT policy",
                       "step (an RL step, a DPO/IPO batch, an "
                       "expert-iteration round)" if x == "step" else "completions sampled from a "
                                                                     "policy (DPO/IPO/RM: the "
                                                                     "pairs' 4 per prompt)"))
        fig, axes = plt.subplots(1, len(panels), figsize=(5 + 5 * len(panels), 4.8), squeeze=False,
                                 gridspec_kw={"width_ratios": [1, 2][-len(panels):]})
        for ax, (names, title, xlabel) in zip(axes[0], panels):
            for name in names:
                xs, mean, lo, hi = mean_curve([r["curve"] for r in policies[name]], x=x)
                line, = ax.plot(xs, mean, marker="o", markersize=3,
                                label=f"{labels[name]} ({plural(len(policies[name]), 'seed')})")
                ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
            ax.set(title=title, xlabel=xlabel, ylabel="held-out greedy accuracy")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="best")
        fig.suptitle("held-out greedy accuracy: mean over seeds, min-max shaded (python "
                     "experiments/results.py)", fontsize=10)
        fig.tight_layout()
        path = os.path.join(out_dir, file)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def setting(results, threads):
    """What the numbers depend on beyond the flags: the thread count the harness set, and the
    device, thread count and torch version each run recorded in its step-0 row (absent from runs
    made before the runs recorded it)."""
    recorded = sorted({(r["setting"].get("device"), r["setting"].get("threads"),
                        r["setting"].get("torch")) for runs in results.values()
                       for r in runs if r.get("setting")}, key=str)
    return {"threads": threads, "recorded": [dict(zip(("device", "threads", "torch"), x))
                                             for x in recorded]}


def report(scripts, seeds, runs_dir, out_dir, quick, threads=1, extra=None, regenerate=""):
    extra = extra or {}
    results = collect(scripts, seeds, runs_dir, quick, extra)
    if not results:
        raise SystemExit(f"error: no finished runs in {runs_dir} for seeds {seeds}; run without "
                         f"--table_only first")
    labels = {n: LABELS.get(n) or _label(scripts[n], n) for n in scripts}
    commands = {n: f"OMP_NUM_THREADS={threads} python "
                + " ".join([f"{n}.py", *extra.get(n, ())]
                           + (quick_flags(scripts[n], n) if quick else [])) for n in scripts}
    summaries = {n: summarise(runs) for n, runs in results.items()}
    policies = {n: s for n, s in summaries.items() if "eval_accuracy" in s["after"]}
    md = table(policies, labels, commands)
    notes = []
    for name, s in summaries.items():
        if name not in policies and "eval_pair_accuracy" in s["after"]:
            notes.append(f"{labels[name]} (`{commands[name]}`, the reward model of the PPO "
                         f"row), over {plural(len(s['seeds']), 'seed')}: held-out pair "
                         f"accuracy {fmt_spread(s['after']['eval_pair_accuracy'])}, mean "
                         f"margin {fmt_spread(s['after']['eval_margin'], '+.2f', range_=False)}, "
                         f"{fmt_spread(s['seconds'], '.0f', range_=False)} s.")
    with_rm = " and ".join(f"{n}.py" for n in results if n != "reward_model"
                           and has_flag(scripts[n], "--rm"))
    seeds_run = ", ".join(map(str, sorted({x for s in summaries.values() for x in s["seeds"]})))
    on = setting(results, threads)
    seen = "; ".join(f"{r['device']}, {r['threads']} thread(s), torch {r['torch']}"
                     for r in on["recorded"])
    import evaluation
    decoding = "; ".join(sorted({evaluation.name(r["after"]) for runs in results.values()
                                 for r in runs if "eval_accuracy" in r["after"]}))
    header = (f"Held-out decoding: {decoding} (pass@1: 4 samples at temperature 1). "
              f"Seeds {seeds_run}, each with its own SFT policy; mean +- std over seeds (sample "
              f"std), [min, max] of the final accuracy. Each command ran as "
              f"`OMP_NUM_THREADS={threads} python "
              f"X.py {''.join(x + ' ' for x in extra.get('sft', ()))}--seed S --init D/sft.pt "
              f"--out D`{f' ({with_rm} also `--rm D/rm.pt`)' if with_rm else ''} (sft.py: "
              f"`--seed S --out D`), D = {os.path.relpath(runs_dir, ROOT)}/seedS: on a CPU the "
              f"thread count changes the float reductions, so it is part of the "
              f"command{f' (recorded by the runs: {seen})' if seen else ''}. Wall time: the "
              f"script's own (first step to last evaluation) / the whole process (start-up and "
              f"step-0 evaluation included; every attempt of a resumed run, while the script's "
              f"own counts from its last resume). Regenerate: `python "
              f"experiments/results.py{regenerate}`.")
    text = "\n\n".join([header, md] + notes) + "\n"
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"seeds": seeds, "setting": on, "runs": results, "summary": summaries}, f,
                  indent=1)
    written = figures(results, labels, out_dir)
    print("\n" + text)
    print("wrote " + ", ".join([os.path.join(out_dir, "results.md"),
                                os.path.join(out_dir, "results.json"), *written]))


def plural(n, word):
    return f"{n} {word}{'' if n == 1 else 's'}"


def _label(module, name):
    """A new script's label: its docstring's first words before ':' when short, else its name."""
    head = (module.__doc__ or "").strip().split("\n")[0].split(":")[0]
    return head if 0 < len(head) <= 24 else name


def main():
    parser = argparse.ArgumentParser(description="Every algorithm's default command over several "
                                                 "seeds: a table with mean and spread, and "
                                                 "learning curves")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="seeds (each with its own SFT policy)")
    parser.add_argument("--only", nargs="+", default=None,
                        help="run only these scripts (names without .py; the SFT policy, and the "
                             "reward model where needed, are trained too); the table shows every "
                             "finished run")
    parser.add_argument("--table_only", action="store_true",
                        help="only rebuild the table and figures from the runs there")
    parser.add_argument("--figures_only", action="store_true",
                        help="only redraw the figures from the folder's results.json")
    parser.add_argument("--quick", action="store_true",
                        help="tiny settings (a smoke test of the pipeline), in results/quick/")
    parser.add_argument("--dir", default=None,
                        help="output folder (default results/, or results/quick/ with --quick); "
                             "the runs go to <dir>/runs/seed<s>/")
    parser.add_argument("--task", default="arithmetic", choices=["arithmetic", "countdown"],
                        help="the generated task every script runs on (their --task); default "
                             "folder results/<task>/ for any but arithmetic")
    parser.add_argument("--flags", default="",
                        help="more flags for the --only scripts (every script without --only), "
                             "as one string (e.g. --only grpo --flags '--steps 500'); they "
                             "appear in the commands")
    parser.add_argument("--threads", type=int, default=1,
                        help="OMP_NUM_THREADS of every run (1, as the README's table; it changes "
                             "CPU results)")
    args = parser.parse_args()
    if any(s < 0 or s >= 2**32 for s in args.seeds):
        parser.error(f"--seeds {args.seeds}: each seed must be in [0, 2**32)")
    if args.threads < 1:
        parser.error(f"--threads {args.threads}: at least 1")
    task = [] if args.task == "arithmetic" else [args.task]
    out_dir = os.path.abspath(args.dir or os.path.join(ROOT, "results", *task,
                                                       "quick" if args.quick else ""))
    try:                                             # a folder it cannot write: said now, not later
        os.makedirs(os.path.join(out_dir, "runs"), exist_ok=True)
        with open(os.path.join(out_dir, f".write_test{os.getpid()}"), "w"):
            pass
        os.remove(os.path.join(out_dir, f".write_test{os.getpid()}"))
    except OSError as e:
        parser.error(f"--dir {out_dir}: cannot write there ({e.strerror or e})")
    scripts = discover()
    if args.figures_only:
        with open(os.path.join(out_dir, "results.json")) as f:
            runs = json.load(f)["runs"]
        labels = {n: LABELS.get(n) or _label(scripts[n], n) for n in runs}
        print("wrote " + ", ".join(figures(runs, labels, out_dir)))
        return
    flags = shlex.split(args.flags)                        # for the --only scripts (all without it)
    extra = {n: (["--task", args.task] if task else [])
             + (flags if args.only is None or n in args.only else []) for n in scripts}
    if args.only is not None:
        unknown = sorted(set(args.only) - set(scripts))
        if unknown:
            parser.error(f"--only {' '.join(unknown)}: not an algorithm script here; "
                         f"allowed: {', '.join(scripts)}")
    runs_dir = os.path.join(out_dir, "runs")
    print(f"scripts: {', '.join(scripts)}; seeds {args.seeds}; runs in {runs_dir}", flush=True)
    failed = [] if args.table_only else sweep(scripts, args.seeds, runs_dir, args.only, args.quick,
                                              args.threads, extra)
    regenerate = "".join([" --quick" * args.quick, f" --task {args.task}" * bool(task),
                          f" --only {' '.join(args.only)}" if args.only else "",
                          f" --flags {shlex.quote(args.flags)}" * bool(args.flags)])
    report(scripts, args.seeds, runs_dir, out_dir, args.quick, args.threads, extra, regenerate)
    if failed:
        raise SystemExit(f"error: {len(failed)} run(s) failed: "
                         + ", ".join(f"{n} (seed {s})" for s, n in failed)
                         + "; their output is in <runs>/seed<s>/<name>.log")


if __name__ == "__main__":
    main()
