"""
grpo.py beside TRL's GRPOTrainer on a real model, on the CPU: SmolLM2-135M-Instruct (the folder
gguf_to_hf.py writes), the same chat prompts, group, lengths and verifier, each side in a process of
its own, alternating (ours, TRL, ours, TRL, ...) so that the machine's load falls on both alike.

    python bench/trl_smollm2.py --init out/smollm2            # 2 rounds of 4 steps each side

Each step: P = 4 arithmetic prompts through the model's chat template, G = 8 completions each at
temperature 1 of at most 24 tokens, the task's verifier as the reward, beta 0.04, one pass, one
micro-batch, learning rate 1e-6, float32, torch's threads as the machine's cores. Ours:
`grpo.py --init F --chat`, a step's seconds from metrics.jsonl (elapsed_s, evaluation excluded).
TRL: GRPOConfig(per_device_train_batch_size=P*G, num_generations=G, max_completion_length=24,
beta=0.04, num_iterations=1, loss_type="grpo", use_cpu=True), conversational prompts (TRL applies
the chat template), transformers' generate; a step timed by a TrainerCallback. The first step of
each process warms up and is left out. Peak memory: each process's maximum resident set.
Needs trl (pip install trl), which is not in requirements.txt.
"""
import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import task  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--init", default=os.path.join(ROOT, "out", "smollm2"),
                   help="the Hugging Face folder (gguf_to_hf.py's)")
    p.add_argument("--rounds", type=int, default=2, help="alternations of the two sides")
    p.add_argument("--steps", type=int, default=4, help="steps a process (the first warms up)")
    p.add_argument("--prompts_per_step", type=int, default=4)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=24)
    p.add_argument("--out", default=os.path.join(ROOT, "out", "bench-smollm2"))
    p.add_argument("--side", choices=["ours", "trl"], help=argparse.SUPPRESS)   # a child's
    args = p.parse_args(argv)
    if args.steps < 2 or args.rounds < 1:
        p.error("allowed: --steps >= 2 (the first warms up), --rounds >= 1")
    return args


def peak_gib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20   # Linux: KiB


def ours(args):
    import grpo
    out = os.path.join(args.out, "ours")
    grpo.main(grpo.parse_args([
        "--init", args.init, "--chat", "--out", out, "--steps", str(args.steps),
        "--prompts_per_step", str(args.prompts_per_step), "--group_size", str(args.group_size),
        "--max_new_tokens", str(args.max_new_tokens), "--lr", "1e-6", "--beta", "0.04",
        "--log_every", "1", "--eval_every", "1000000", "--eval_n", "1"]))
    with open(os.path.join(out, "grpo", "metrics.jsonl")) as f:
        elapsed = [r["elapsed_s"] for r in map(json.loads, f) if "elapsed_s" in r]
    return [b - a for a, b in zip([0.0, *elapsed], elapsed)]


def trl(args):
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    task.use(argparse.Namespace(task="arithmetic", format="plain", chat=True))
    prompts = task.sample_prompts(random.Random(0), args.prompts_per_step * args.steps)
    times = []

    def verifier(prompts, completions, **kwargs):
        return [task.reward(p[-1]["content"], c[-1]["content"])
                for p, c in zip(prompts, completions)]

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, a, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)

    rows = args.prompts_per_step * args.group_size
    config = GRPOConfig(output_dir=os.path.join(args.out, "trl"), per_device_train_batch_size=rows,
                        gradient_accumulation_steps=1, num_generations=args.group_size,
                        max_completion_length=args.max_new_tokens, beta=0.04, num_iterations=1,
                        loss_type="grpo", use_cpu=True, bf16=False, learning_rate=1e-6,
                        max_steps=args.steps, logging_steps=1, report_to="none",
                        save_strategy="no", seed=0, temperature=1.0)
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts]})
    GRPOTrainer(model=args.init, reward_funcs=verifier, args=config, train_dataset=data,
                callbacks=[Clock()]).train()
    return times


def child(args):
    torch.set_num_threads(os.cpu_count())
    times = ours(args) if args.side == "ours" else trl(args)
    print("RESULT " + json.dumps({"times": times, "peak_gib": peak_gib()}))


def main(args):
    results = {"ours": [], "trl": []}
    for r in range(args.rounds):
        for side in ("ours", "trl"):
            cmd = [sys.executable, os.path.abspath(__file__), "--side", side,
                   *sys.argv[1:]]
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            if p.returncode != 0 or line is None:
                sys.exit(f"{side} failed (round {r + 1}):\n{p.stdout[-2000:]}{p.stderr[-3000:]}")
            results[side].append(json.loads(line[7:]))
            print(f"round {r + 1} {side}: " + ", ".join(f"{t:.2f}" for t in results[side][-1]
                                                          ["times"]), flush=True)
    import trl as trl_module
    med = {s: statistics.median(t for x in results[s] for t in x["times"][1:]) for s in results}
    mem = {s: max(x["peak_gib"] for x in results[s]) for s in results}
    rows = args.prompts_per_step * args.group_size
    print(f"\n== grpo.py against TRL {trl_module.__version__}'s GRPOTrainer on {args.init}: "
          f"{rows} completions of at most {args.max_new_tokens} tokens a step, CPU "
          f"({os.cpu_count()} cores), torch {torch.__version__}")
    print("command: python bench/trl_smollm2.py " + " ".join(sys.argv[1:]))
    print("| run | median step, s | peak resident GiB |\n| --- | ---: | ---: |")
    print(f"| this project, grpo.py | {med['ours']:.2f} | {mem['ours']:.2f} |")
    print(f"| TRL {trl_module.__version__} GRPOTrainer | {med['trl']:.2f} | {mem['trl']:.2f} |")
    print(f"TRL's step / this project's: {med['trl'] / med['ours']:.2f}x")
    return results


if __name__ == "__main__":
    a = parse_args()
    child(a) if a.side else main(a)
