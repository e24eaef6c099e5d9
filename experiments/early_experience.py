"""
Early experience, measured: why every RL script here starts from the SFT policy, and what imitation
does not give.

Sections (each prints a markdown table and writes it, with its raw numbers, under
out/early_experience/):

  cold_start          GRPO with its default budget from a randomly initialised policy against from
                      the SFT policy: reward, share of groups with any reward at all, held-out
                      accuracy over the steps. From scratch no completion is ever right, every
                      advantage is 0, and nothing is learnt (the cold-start problem); SFT puts the
                      policy where rewards happen.
  distribution_shift  The policy in states the demonstrations never visit: the prompt written with
                      spaces; an unusual but valid first step forced on a+b+c (b+c first); an
                      arithmetic slip forced into the first step (does the policy carry the wrong
                      value on, or recover the right answer?); and the parenthesised problems
                      (a+b)*c, never seen. For the SFT policy, the GRPO policy and, when
                      expert_iteration.py exists, the expert-iteration policy.
  hindsight           expert_iteration.py with and without --hindsight (a failed a+b*c attempt kept
                      as a correct demonstration of (a+b)*c), at the same number of samples:
                      accuracy on plain and on parenthesised held-out problems.
  warm_buffer         expert_iteration.py with and without --demos (a share of expert demonstrations
                      in each round's data): accuracy on precedence problems and on the others
                      (forgetting).

Run:
    # about 2 minutes (+ SFT if missing)
    python experiments/early_experience.py --section cold_start
    # builds the GRPO (and EI) policies if missing
    python experiments/early_experience.py --section distribution_shift
    # two expert-iteration runs, about 3 minutes
    python experiments/early_experience.py --section hindsight
    # three expert-iteration runs (one shared)
    python experiments/early_experience.py --section warm_buffer
    # every section
    python experiments/early_experience.py
"""
import argparse
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import task  # noqa: E402
from hf.checkpoint import save_checkpoint  # noqa: E402
from plumbing.flags import SFT_PATH  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from plumbing.loading import build_missing, load_model, pick_device, read_checkpoint  # noqa: E402
from tasks import arithmetic  # noqa: E402

OUT = os.path.join("out", "early_experience")


def run(cmd):
    print("python " + " ".join(cmd), flush=True)
    subprocess.run([sys.executable, *cmd], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def metrics(path):
    return [json.loads(line) for line in open(path)]


def write(name, text, data):
    os.makedirs(os.path.join(ROOT, OUT), exist_ok=True)
    with open(os.path.join(ROOT, OUT, f"{name}.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(ROOT, OUT, f"{name}.json"), "w") as f:
        json.dump(data, f, indent=1)
    print(text)


# -----------------------------------------------------------------------------
# 1. Cold start

def cold_start(args):
    sft = os.path.join(ROOT, args.sft)
    build_missing(sft, os.path.join(ROOT, SFT_PATH), ["sft.py"])
    random_init = os.path.join(ROOT, OUT, "random_init.pt")
    if not os.path.exists(random_init):     # the SFT policy's architecture and tokenizer, untrained
        _, tok, ckpt = load_model(sft, "cpu")
        torch.manual_seed(args.seed)
        save_checkpoint(random_init, GPT(GPTConfig(**ckpt["config"])), tok.name)
    rows = {}
    for name, init in (("random init", random_init), ("SFT", sft)):
        out = os.path.join(OUT, "cold_start", "random" if name == "random init" else "sft")
        log = os.path.join(ROOT, out, "grpo", "metrics.jsonl")
        if not (os.path.exists(log) and os.path.exists(os.path.join(ROOT, out, "grpo.pt"))):
            run(["grpo.py", "--init", init, "--out", out, "--seed", str(args.seed),
                 "--log_every", "5", "--eval_every", "10"])
        rows[name] = metrics(log)
    lines = ["| start | step | reward (mean) | groups with any reward | zero-variance groups "
             "| held-out greedy accuracy |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, log in rows.items():
        for r in log:
            if r["step"] % 10 == 0:
                f = lambda k, fmt: format(r[k], fmt) if k in r else ""
                lines.append(f"| {name} | {r['step']} | {f('reward_mean', '.3f')} | "
                             f"{f('reward_groups', '.2f')} | {f('zero_var_groups', '.2f')} | "
                             f"{f('eval_accuracy', '.3f')} |")
    write("cold_start", "\n".join(lines), rows)


# -----------------------------------------------------------------------------
# 2. Distribution shift

def slip(step):
    """'4*2=8' -> '4*2=9': the first step with its result off by one."""
    lhs, value = step.split("=")
    return f"{lhs}={int(value) + 1}"


def shifted_cases(n):
    """[(name, [(model input, the canonical prompt, the forced prefix of the completion)])]: the
    held-out problems, as in training and shifted."""
    held = task.eval_prompts()
    prec = [p for p in held if task.is_precedence(p)][:n]
    # a+b+c: the order does not matter
    plain = [p for p in held if p[1] == "+" and p[3] == "+"][:n] or held[:n]
    cases = [
        ("held-out prompts, as in training", [(p, p, "") for p in held[:n]]),
        ("prompt with spaces: '3 + 4 * 2 ='", [(" ".join(p[:-1]) + " =", p, "") for p in held[:n]]),
        ("a+b+c with b+c forced first",
         [(p + f"{p[2:5]}={arithmetic._apply(int(p[2]), p[3], int(p[4]))},", p,
           f"{p[2:5]}={arithmetic._apply(int(p[2]), p[3], int(p[4]))},") for p in plain]),
        ("a+b*c with a slip forced into step 1",
         [(p + slip(arithmetic.solve(p)[0][0]) + ",", p, slip(arithmetic.solve(p)[0][0]) + ",")
          for p in prec]),
        ("(a+b)*c, never seen", [(p, p, "") for p in arithmetic.paren_eval_prompts()[:n]]),
    ]
    return cases


@torch.no_grad()
def shifted_accuracy(model, tok, items):
    """Share of greedy completions, after the forced prefix, whose final answer is right for the
    canonical prompt; and, for a forced slip, the share that carried the wrong value on to the
    answer it implies."""
    inputs = [x for x, _, _ in items]
    completions = task.complete(model, tok, inputs, temperature=0.0)
    right = [task.reward(p, prefix + c) for (_, p, prefix), c in zip(items, completions)]
    carried = []                             # a+b*c with 'b*c=v+1,' forced: did the answer use v+1?
    for (_, p, prefix), c in zip(items, completions):
        if prefix and task.is_precedence(p):
            wrong = int(prefix.split("=")[1].rstrip(","))
            carried.append(float(
                arithmetic.parse_answer(prefix + c) == arithmetic._apply(int(p[0]), p[1], wrong)))
    return sum(right) / len(right), (sum(carried) / len(carried) if carried else None)


def distribution_shift(args):
    device = pick_device(args.device)
    policies = {"SFT": args.sft, "GRPO": args.grpo}
    if os.path.exists(os.path.join(ROOT, "expert_iteration.py")):
        policies["expert iteration"] = args.ei
    build_missing(os.path.join(ROOT, args.sft), os.path.join(ROOT, SFT_PATH), ["sft.py"])
    for name, path, script in (("GRPO", args.grpo, "grpo.py"),
                               ("expert iteration", args.ei, "expert_iteration.py")):
        if name in policies:
            build_missing(os.path.join(ROOT, path), os.path.join(ROOT, path),
                          [script, "--init", os.path.join(ROOT, args.sft)])
    results = {}
    for name, path in policies.items():
        model, tok, _ = load_model(os.path.join(ROOT, path), device, "gpt")
        results[name] = {case: shifted_accuracy(model, tok, items)
                         for case, items in shifted_cases(args.n)}
    names = list(policies)
    lines = ["| state (held-out problems, greedy) | problems | " + " | ".join(names) + " |",
             "| --- | ---: | " + " | ".join("---:" for _ in names) + " |"]
    for case, items in shifted_cases(args.n):
        cells = []
        for name in names:
            acc, carried = results[name][case]
            cells.append(f"{acc:.3f}" + (f" (carried the slip "
                                         f"on: {carried:.3f})" if carried is not None else ""))
        lines.append(f"| {case} | {len(items)} | " + " | ".join(cells) + " |")
    write("distribution_shift", "\n".join(lines),
          {k: {c: list(v) for c, v in r.items()} for k, r in results.items()})


# -----------------------------------------------------------------------------
# 3. and 4. Hindsight relabelling and a warm buffer: expert_iteration.py with and without them

def ei_runs(args, variants):
    """{name: (metrics log, final policy path)} of expert_iteration.py runs from the SFT policy, one
    per variant (name, extra flags), with the same seed and rounds, so the same number of
    completions sampled."""
    build_missing(os.path.join(ROOT, args.sft), os.path.join(ROOT, SFT_PATH), ["sft.py"])
    runs = {}
    for name, slug, flags in variants:
        out = os.path.join(OUT, "expert_iteration", slug)
        log = os.path.join(ROOT, out, "expert_iteration", "metrics.jsonl")
        ckpt = os.path.join(ROOT, out, "expert_iteration.pt")
        if not (os.path.exists(log) and os.path.exists(ckpt)):
            run(["expert_iteration.py", "--init", os.path.join(ROOT, args.sft), "--out", out,
                 "--seed", str(args.seed), *flags])
        runs[name] = (metrics(log), ckpt)
    return runs


def greedy_accuracy(model, tok, prompts):
    completions = task.complete(model, tok, prompts, temperature=0.0)
    return sum(task.reward(p, c) for p, c in zip(prompts, completions)) / len(prompts)


def hindsight(args):
    runs = ei_runs(args, [("expert iteration", "plain", []),
                          ("expert iteration --hindsight", "hindsight", ["--hindsight"])])
    device = pick_device(args.device)
    paren = arithmetic.paren_eval_prompts()
    sft, tok, _ = load_model(os.path.join(ROOT, args.sft), device, "gpt")
    rows = {"SFT policy": {"plain": runs["expert iteration"][0][0]["eval_accuracy"],
                           "paren": greedy_accuracy(sft, tok, paren), "samples": 0,
                           "relabelled": 0}}
    for name, (log, ckpt) in runs.items():
        model, tok, _ = load_model(ckpt, device, "gpt")
        rows[name] = {"plain": log[-1]["eval_accuracy"],
                      "paren": greedy_accuracy(model, tok, paren), "samples": log[-1]["samples"],
                      "relabelled": sum(r.get("relabelled", 0) for r in log[1:])}
    lines = ["| policy | completions sampled | relabelled examples fine-tuned on | "
             "held-out a+b*c etc. (512) | " f"held-out (a+b)*c, never asked ({len(paren)}) |",
             "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {n} | {r['samples']:,} | {r['relabelled']:,} | {r['plain']:.3f} | "
              f"{r['paren']:.3f} |" for n, r in rows.items()]
    write("hindsight", "\n".join(lines), rows)


def warm_buffer(args):
    runs = ei_runs(args, [("no demonstrations", "plain", []),
                          ("--demos 0.25", "demos25", ["--demos", "0.25"]),
                          ("--demos 0.5", "demos50", ["--demos", "0.5"])])
    first = next(iter(runs.values()))[0][0]
    lines = ["| expert iteration | demonstrations fine-tuned on | "
             "held-out precedence: start -> end | held-out others: start -> lowest -> end | "
             "held-out all: end |", "| --- | ---: | ---: | ---: | ---: |"]
    rows = {}
    for name, (log, _) in runs.items():
        evals = [r for r in log if "eval_accuracy" in r]
        rows[name] = {"demos": sum(r.get("demos", 0) for r in log[1:]),
                      "precedence": [r["eval_accuracy_precedence"] for r in evals],
                      "other": [r["eval_accuracy_other"] for r in evals],
                      "all": evals[-1]["eval_accuracy"]}
        r = rows[name]
        lines.append(f"| {name} | {r['demos']:,} | {first['eval_accuracy_precedence']:.3f} "
                     f"-> {r['precedence'][-1]:.3f} | {first['eval_accuracy_other']:.3f} "
                     f"-> {min(r['other']):.3f} -> {r['other'][-1]:.3f} | {r['all']:.3f} |")
    write("warm_buffer", "\n".join(lines), rows)


SECTIONS = {"cold_start": cold_start, "distribution_shift": distribution_shift,
            "hindsight": hindsight, "warm_buffer": warm_buffer}


def main():
    parser = argparse.ArgumentParser(description="Early experience: cold start, distribution "
                                                 "shift, hindsight, warm buffer")
    parser.add_argument("--section", choices=sorted(SECTIONS), action="append",
                        help="run these sections (default: all)")
    parser.add_argument("--sft", default=SFT_PATH,
                        help="the SFT policy (built if it is the missing default)")
    parser.add_argument("--grpo", default=os.path.join("out", "grpo.pt"),
                        help="a GRPO policy (built with grpo.py if missing)")
    parser.add_argument("--ei", default=os.path.join("out", "expert_iteration.pt"),
                        help="an expert-iteration policy")
    parser.add_argument("--n", type=int, default=256,
                        help="held-out problems per distribution-shift case")
    parser.add_argument("--seed", type=int, default=0, help="seed of the runs this bench starts")
    parser.add_argument("--device", default=None,
                        help="cuda, mps or cpu (default: the first available)")
    args = parser.parse_args()
    if args.n < 1 or args.seed < 0:
        parser.error(f"--n {args.n}, --seed {args.seed}: n must be at least 1 and seed at least 0")
    pick_device(args.device)                                 # a device this machine lacks: said now
    for path, flag in ((args.sft, "--sft"), (args.grpo, "--grpo"), (args.ei, "--ei")):
        if os.path.exists(os.path.join(ROOT, path)):
            read_checkpoint(os.path.join(ROOT, path), flag)        # unreadable: one line now
    try:                                        # the folder it writes: said now, not after the runs
        os.makedirs(os.path.join(ROOT, OUT), exist_ok=True)
        with open(os.path.join(ROOT, OUT, f".write_test{os.getpid()}"), "w"):
            pass
        os.remove(os.path.join(ROOT, OUT, f".write_test{os.getpid()}"))
    except OSError as e:
        parser.error(f"cannot write to {os.path.join(ROOT, OUT)} ({e.strerror or e})")
    for name in args.section or list(SECTIONS):
        print(f"\n## {name}\n", flush=True)
        SECTIONS[name](args)


if __name__ == "__main__":
    main()
