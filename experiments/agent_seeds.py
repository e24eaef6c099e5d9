"""
agent.py over seeds: does the default run learn on every seed, and does self-correction (SCoRe)
learn?

Every seed has its own SFT policy (sft.py --task toolcalc --seed s): seed 0's is
out/toolcalc/sft.pt, the one `python agent.py` builds; seed s > 0's is out/toolcalc/seed<s>/sft.pt,
built here first when missing.
--part seeds: `python agent.py` (30 steps, --scale_rewards batch, its default) and the same run with
    GRPO's per-group std (--scale_rewards group), seeds 0-4.
--part chat: `python agent.py --chat --tools calculator` (the toy's chat template, bytes-chat;
    out/toolcalc_tools/), seeds 0-2.
--part score: --turns 2 for 40 steps, seeds 0-2: the naive objective (each attempt on its own
    right-or-wrong reward, no stage I, no bonus: --shaping 0), SCoRe's stage II alone (the bonus,
    alpha 1) and SCoRe (20 steps of stage I, then 20 of stage II). Held-out greedy: each attempt's
    accuracy, Delta(i->c) and Delta(c->i), at the end and at step 20 (where stage I ends).
--part attempts: no training; each SFT policy's two-attempt episodes at temperature 1 (the episodes
    stage I starts from), 256 held-out problems x 8: per attempt and kind, accuracy, the share that
    calls, accuracy with a call and malformed calls per episode.
A finished run is read, not run again; a stopped one is resumed (--resume: the same result as
uninterrupted).

Run:
    # about 6 minutes on 2 CPU cores, + 25 for the SFTs
    python experiments/agent_seeds.py --part seeds --jobs 2
    # about 15 minutes
    python experiments/agent_seeds.py --part score --jobs 2
    # agent.py's seeds 0-4 from one SFT policy
    python experiments/agent_seeds.py --part seeds --same_sft 1 --jobs 2
    # the chat protocol from one SFT policy
    python experiments/agent_seeds.py --part chat --same_sft 0 --jobs 2
    # seconds
    python experiments/agent_seeds.py --part attempts
    python experiments/agent_seeds.py --part seeds --table_only
Outputs: results/agent/seeds.md, score.md, attempts.md (the tables) and seeds.json, score.json.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import task  # noqa: E402
from hf.checkpoint import load_checkpoint  # noqa: E402
from hf.tokenizer import Tokenizer  # noqa: E402

STAGE1 = 20   # SCoRe's stage I steps in --part score (of 40)
PARTS = {  # part -> (seeds, {run name: agent.py flags beyond --seed, --init and --out})
    "seeds": ([0, 1, 2, 3, 4], {"default (batch std)": [],
                                "--scale_rewards group": ["--scale_rewards", "group"]}),
    "chat": ([0, 1, 2], {"chat protocol (--chat --tools calculator)":
                         ["--chat", "--tools", "calculator"]}),
    "score": ([0, 1, 2], {"naive (no stage I, no bonus)":
                          ["--turns", "2", "--steps", "40", "--shaping", "0"],
                          "stage II alone (alpha 1)": ["--turns", "2", "--steps", "40"],
                          "SCoRe (stage I 20, stage II 20)":
                          ["--turns", "2", "--steps", "40", "--stage1_steps", str(STAGE1)]}),
}


def sft_path(seed, part=None):
    """Seed s's SFT policy: out/toolcalc/sft.pt for seed 0 (out/toolcalc_tools/ for --part chat)."""
    folder = "toolcalc_tools" if part == "chat" else "toolcalc"
    return os.path.join("out", folder,
                        "sft.pt" if seed == 0 else os.path.join(f"seed{seed}", "sft.pt"))


def run_all(commands, jobs):
    """Run the commands, `jobs` at a time, one torch thread each; stop at the first failure."""
    env, waiting, running = {**os.environ, "OMP_NUM_THREADS": "1"}, list(commands), []
    while waiting or running:
        while waiting and len(running) < jobs:
            cmd, log = waiting.pop(0)
            print(" ".join(["python", *cmd[1:]]), f"> {log}", flush=True)
            os.makedirs(os.path.dirname(os.path.join(ROOT, log)), exist_ok=True)
            running.append((subprocess.Popen(cmd, cwd=ROOT, env=env,
                                             stdout=open(os.path.join(ROOT, log), "w"),
                                             stderr=subprocess.STDOUT), log))
        time.sleep(1)
        for p, log in list(running):
            if p.poll() is not None:
                running.remove((p, log))
                if p.returncode:
                    raise SystemExit(f"error: exit {p.returncode}; see {log}")


def finished(out, flags):
    """Whether the run in `out` reached its --steps (30 unless the flags say): a stopped one is
    resumed instead."""
    steps = int(flags[flags.index("--steps") + 1]) if "--steps" in flags else 30
    path = os.path.join(out, "agent", "metrics.jsonl")
    if not os.path.exists(os.path.join(out, "agent.pt")) or not os.path.exists(path):
        return False
    return any(json.loads(line).get("step") == steps for line in open(path))


def read(out):
    rows = [json.loads(line) for line in open(os.path.join(out, "agent", "metrics.jsonl"))]
    evals = [r for r in rows if "eval_accuracy" in r]
    return {"before": evals[0], "after": evals[-1], "evals": {r["step"]: r for r in evals},
            "seconds": rows[-1].get("elapsed_s", 0.0),
            "kl": [r["kl_exact"] for r in rows if "kl_exact" in r][-1],
            "calls": {r["step"]: r["calls"] for r in rows if "calls" in r}}


def spread(values, f=".3f"):
    m = statistics.mean(values)
    sd = statistics.pstdev(values) if len(values) > 1 else 0.0
    return f"{m:{f}} +- {sd:{f}} [{min(values):{f}}, {max(values):{f}}]"


def seeds_table(results, seeds, command="python agent.py", own_sft=True):
    lines = [f"`{command}` (30 steps of 32 prompts x 8 episodes, call cost 0.1)"
             + ", each seed from its own SFT policy" * own_sft
             + "; held-out greedy, 512 problems (256 hard, 256 easy).", "",
             "| run | seed | accuracy, before -> after | hard | easy | calls per episode | "
             "training calls, step 5 / 15 / 30 | KL at the end | wall s |",
             "| --- | ---: | --- | --- | --- | --- | --- | ---: | ---: |"]
    for name, by_seed in results.items():
        for s in seeds:
            r = by_seed.get(s)
            if r is None:
                continue
            b, a, c = r["before"], r["after"], r["calls"]
            lines.append(f"| {name} | {s} | {b['eval_accuracy']:.3f} -> "
                         f"**{a['eval_accuracy']:.3f}** | {b['eval_accuracy_precedence']:.3f} "
                         f"-> {a['eval_accuracy_precedence']:.3f} "
                         f"| {b['eval_accuracy_other']:.3f} -> {a['eval_accuracy_other']:.3f} "
                         f"| {b['eval_calls']:.2f} -> {a['eval_calls']:.2f} | "
                         + " / ".join(f"{c[k]:.2f}" if k in c else "-" for k in (5, 15, 30))
                         + f" | {r['kl']:.3f} | {r['seconds']:.0f} |")
    lines += ["", "| run | seeds | after: mean +- std [min, max] | "
                  "gain in points: mean +- std [min, max] |", "| --- | --- | --- | --- |"]
    for name, by_seed in results.items():
        runs = [by_seed[s] for s in seeds if s in by_seed]
        after = [r["after"]["eval_accuracy"] for r in runs]
        gain = [100 * (r["after"]["eval_accuracy"] - r["before"]["eval_accuracy"]) for r in runs]
        lines.append(f"| {name} | {len(runs)} | {spread(after)} | {spread(gain, '.1f')} |")
    return "\n".join(lines) + "\n"


def score_table(results, seeds):
    lines = ["`python agent.py --turns 2 --steps 40` and its settings, each seed from its own "
             "SFT policy; held-out greedy, 512 problems. Delta(i->c), Delta(c->i): shares of "
             "problems the second attempt turned from incorrect to correct and from correct "
             "to incorrect.", "", "| run | seed | attempt 1, before -> after | attempt 2 | "
                                  "attempt 2 - attempt 1 | Delta(i->c) | Delta(c->i) | wall s |",
             "| --- | ---: | --- | --- | ---: | --- | --- | ---: |"]
    key = lambda r, k: f"{r['before'][k]:.3f} -> **{r['after'][k]:.3f}**"
    for name, by_seed in results.items():
        for s in seeds:
            r = by_seed.get(s)
            if r is None:
                continue
            a = r["after"]
            lines.append(f"| {name} | {s} | {key(r, 'eval_accuracy')} | "
                         f"{key(r, 'eval_accuracy_turn2')} | "
                         f"{100 * (a['eval_accuracy_turn2'] - a['eval_accuracy']):+.1f} "
                         f"| {key(r, 'eval_wrong_to_right')} | "
                         f"{key(r, 'eval_right_to_wrong')} | {r['seconds']:.0f} |")
    for title, at in (("At the end (step 40):", None),
                      (f"At step {STAGE1}, where SCoRe's stage I ends:", STAGE1)):
        lines += ["", title, "", "| run | seeds | attempt 1 | attempt 2 | "
                                 "attempt 2 - attempt 1, points | Delta(i->c) | Delta(c->i) |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for name, by_seed in results.items():
            runs = [by_seed[s]["after"] if at is None else by_seed[s]["evals"].get(at)
                    for s in seeds if s in by_seed]
            if not all(runs):
                continue
            col = lambda k: spread([a[k] for a in runs])
            gap = spread([100 * (a["eval_accuracy_turn2"] - a["eval_accuracy"]) for a in runs],
                         ".1f")
            lines.append(f"| {name} | {len(runs)} | {col('eval_accuracy')} | "
                         f"{col('eval_accuracy_turn2')} | {gap} | "
                         f"{col('eval_wrong_to_right')} | {col('eval_right_to_wrong')} |")
    return "\n".join(lines) + "\n"


def attempts_table(seeds):
    """The SFT policies' two-attempt episodes at temperature 1, per attempt and kind of problem."""
    task.use(argparse.Namespace(task="toolcalc", format="plain", countdown_numbers=3, data=None,
                                chat=False))
    prompts, G = task.eval_prompts()[:256], 8
    hard = torch.tensor([task.is_precedence(p) for p in prompts]).repeat_interleave(G)      # (B,)
    lines = ["Each seed's SFT policy, two attempts (`--turns 2`) at temperature 1, 256 held-out "
             "problems x 8 episodes: what stage I starts from.", "",
             "| seed | attempt | problems | accuracy | share with a call | "
             "accuracy with a call | malformed calls per episode |",
             "| ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for s in seeds:
        model, ckpt = load_checkpoint(os.path.join(ROOT, sft_path(s)))
        e = task.episodes(model.eval(), Tokenizer(ckpt["tokenizer"]), prompts, G, 1.0, None, None,
                          2, generator=torch.Generator().manual_seed(s))
        for k in range(2):
            right, called = e.correct[:, k], e.calls[:, k] > 0
            for kind, sel in (("hard", hard), ("easy", ~hard)):
                c = called[sel]
                lines.append(f"| {s} | {k + 1} | {kind} | {right[sel].mean():.3f} | "
                             f"{c.float().mean():.3f} | {right[sel][c].mean():.3f} | "
                             f"{e.malformed[sel, k].mean():.3f} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description="agent.py over seeds: the default run, and "
                                                 "self-correction (SCoRe)")
    parser.add_argument("--part", required=True, choices=[*PARTS, "attempts"], help="which study")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default: the part's")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at a time (one torch thread each)")
    parser.add_argument("--same_sft", type=int, default=None,
                        help="every run from this seed's SFT policy (only agent.py's seed "
                             "varies); its own tables")
    parser.add_argument("--out", default="out/agent_seeds", help="folder for the runs")
    parser.add_argument("--results", default="results/agent",
                        help="folder for the tables and numbers")
    parser.add_argument("--table_only", action="store_true",
                        help="only print the tables of the runs already there")
    args = parser.parse_args()
    seeds, runs = PARTS.get(args.part, ([0, 1, 2], {}))
    seeds = args.seeds or seeds
    sft = (lambda s: sft_path(args.same_sft, args.part)) if args.same_sft is not None else \
        (lambda s: sft_path(s, args.part))
    part = args.part + ("" if args.same_sft is None else f"_sft{args.same_sft}")
    if args.part == "attempts":
        text = attempts_table(seeds)
        os.makedirs(os.path.join(ROOT, args.results), exist_ok=True)
        with open(os.path.join(ROOT, args.results, "attempts.md"), "w") as f:
            f.write(text)
        print(text + f"\nwrote {args.results}/attempts.md")
        return
    if not args.table_only:
        chat = ["--chat", "--tools", "calculator"] if args.part == "chat" else []
        sfts = [([sys.executable, "sft.py", "--task", "toolcalc", "--format", "plain",
                  "--countdown_numbers", "3", *chat, "--seed", str(s),
                  "--out", os.path.dirname(sft(s))],
                 os.path.join(args.out, f"sft_{args.part}_seed{s}.log"))
                for s in sorted({args.same_sft} if args.same_sft is not None else seeds)
                if not os.path.exists(os.path.join(ROOT, sft(s)))]
        run_all(sfts, args.jobs)
        todo = []
        for name, flags in runs.items():
            for s in seeds:
                out = os.path.join(args.out, part, name.split(" (")[0].replace(" ", "_").strip("-"),
                                   f"seed{s}")
                if not finished(os.path.join(ROOT, out), flags):
                    resume = ["--resume"] if os.path.exists(os.path.join(ROOT, out,
                                                                         "agent.pt")) else []
                    todo.append(([sys.executable, "agent.py", *flags, "--seed", str(s),
                                  "--init", sft(s), "--out", out, *resume], out + ".log"))
        run_all(todo, args.jobs)
    results = {}
    for name, flags in runs.items():
        for s in seeds:
            out = os.path.join(ROOT, args.out, part,
                               name.split(" (")[0].replace(" ", "_").strip("-"), f"seed{s}")
            if finished(out, flags):
                results.setdefault(name, {})[s] = read(out)
    if not results:
        raise SystemExit(f"error: no finished runs in {args.out}/{part}; run without "
                         f"--table_only first")
    if args.part == "score":
        text = score_table(results, seeds)
    else:
        text = seeds_table(results, seeds, "python agent.py"
                           + " --chat --tools calculator" * (args.part == "chat"),
                           args.same_sft is None)
    if args.same_sft is not None:
        text = (f"Every run from seed {args.same_sft}'s SFT policy; "
                "the seed column is agent.py's.\n\n" + text)
    folder = os.path.join(ROOT, args.results)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{part}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(folder, f"{part}.json"), "w") as f:
        json.dump({n: {str(s): {k: r[k] for k in ("before", "after", "evals", "seconds", "kl")}
                       for s, r in by.items()} for n, by in results.items()}, f, indent=1)
    print("\n" + text)
    print(f"wrote {args.results}/{part}.md and {part}.json")


if __name__ == "__main__":
    main()
