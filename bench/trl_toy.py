"""
The default GRPO and DPO steps beside TRL's on the toy, on the CPU: the same SFT policy (out/sft.pt,
and its export.py folder for TRL), the same prompts, pairs, batch, group and lengths, each side in a
process of its own with the same thread count, alternating (ours, TRL, ours, TRL, ...) so that the
machine's load falls on both alike.

    python bench/trl_toy.py --trl_python /tmp/trlenv/bin/python      # 3 rounds, GRPO and DPO

GRPO, grpo.py's defaults: P = 32 arithmetic prompts, G = 8 completions each at temperature 1 of at
most 24 tokens, the task's verifier, beta 0.04, one pass, learning rate 3e-4. Ours: its step from
metrics.jsonl (elapsed_s over --log_every 5 steps, the first 5 left out as warm-up). TRL:
GRPOConfig(per_device_train_batch_size=256, num_generations=8, max_completion_length=24, beta=0.04,
loss_type="grpo", learning_rate=3e-4, gradient_checkpointing=False: TRL's default
is True, and ours recomputes nothing), transformers' generate, a step timed by a TrainerCallback
(the first 2 left out). DPO, dpo.py's defaults: 64 pairs a step of the pairs dpo.py samples from
the SFT policy (the same file to both), beta 0.1, learning rate 3e-5; the reference log-probs
computed once before training on both sides (TRL: precompute_ref_log_probs=True). TRL runs in
--trl_python (a venv with trl; neither trl nor transformers is in requirements.txt).
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--init", default=os.path.join(ROOT, "out", "sft.pt"),
                   help="the SFT policy (python sft.py writes it)")
    p.add_argument("--trl_python", default=sys.executable, help="a Python with trl installed")
    p.add_argument("--rounds", type=int, default=3, help="alternations of the two sides")
    p.add_argument("--steps", type=int, default=25, help="steps a process (multiple of 5)")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of both sides")
    p.add_argument("--algos", default="grpo,dpo", help="grpo, dpo or both, comma-separated")
    p.add_argument("--out", default="/tmp/bench_trl_toy", help="scratch folder")
    p.add_argument("--side", default=None, help=argparse.SUPPRESS)   # a child's: ours-grpo, ...
    args = p.parse_args(argv)
    if args.steps < 10 or args.steps % 5 or args.rounds < 1 or args.threads < 1:
        p.error(f"--steps {args.steps}, --rounds {args.rounds}, --threads {args.threads}: steps a "
                f"multiple of 5 from 10, rounds and threads at least 1")
    return args


def ours(args, algo):
    """Seconds a step of grpo.py or dpo.py at its defaults, from its metrics.jsonl."""
    import dpo
    import grpo
    out = os.path.join(args.out, f"ours-{algo}")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    for name in ("pairs_train.json", "pairs_eval.json"):       # dpo.py's pairs, sampled once
        if os.path.exists(os.path.join(args.out, name)):
            shutil.copy(os.path.join(args.out, name), out)
    script = grpo if algo == "grpo" else dpo
    script.main(script.parse_args(["--init", args.init, "--out", out, "--steps", str(args.steps),
                                   "--log_every", "5", "--eval_every", "1000000",
                                   "--eval_n", "1"]))
    for name in ("pairs_train.json", "pairs_eval.json"):
        if os.path.exists(os.path.join(out, name)):
            shutil.copy(os.path.join(out, name), args.out)
    with open(os.path.join(out, algo, "metrics.jsonl")) as f:
        elapsed = [r["elapsed_s"] for r in map(json.loads, f) if "elapsed_s" in r]
    return [(b - a) / 5 for a, b in zip(elapsed, elapsed[1:])]      # the first 5 steps left out


def trl(args, algo):
    """Seconds a step of TRL's GRPOTrainer or DPOTrainer on the exported SFT policy."""
    import task
    from datasets import Dataset
    from transformers import TrainerCallback
    times = []

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, a, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)

    folder = os.path.join(args.out, "sft-hf")
    common = dict(output_dir=os.path.join(args.out, f"trl-{algo}"), use_cpu=True, bf16=False,
                  max_steps=args.steps, logging_steps=5, report_to="none", save_strategy="no",
                  seed=0, gradient_accumulation_steps=1, gradient_checkpointing=False)
    if algo == "grpo":
        from trl import GRPOConfig, GRPOTrainer
        prompts = task.sample_prompts(random.Random(0), 32 * args.steps)

        def verifier(prompts, completions, **kwargs):
            return [task.reward(p, c) for p, c in zip(prompts, completions)]

        config = GRPOConfig(per_device_train_batch_size=256, num_generations=8,
                            max_completion_length=24, beta=0.04, num_iterations=1,
                            loss_type="grpo", learning_rate=3e-4, temperature=1.0, **common)
        trainer = GRPOTrainer(model=folder, reward_funcs=verifier, args=config,
                              callbacks=[Clock()],
                              train_dataset=Dataset.from_dict({"prompt": prompts}))
    else:
        from trl import DPOConfig, DPOTrainer
        with open(os.path.join(args.out, "pairs_train.json")) as f:
            pairs = json.load(f)["pairs"]
        data = Dataset.from_dict({k: [p[k] for p in pairs] for k in ("prompt", "chosen",
                                                                      "rejected")})
        config = DPOConfig(per_device_train_batch_size=64, beta=0.1, learning_rate=3e-5,
                           precompute_ref_log_probs=True, max_length=64, **common)
        trainer = DPOTrainer(model=folder, args=config, train_dataset=data, callbacks=[Clock()])
    trainer.train()
    keep = ("reward", "completions/mean_length", "rewards/accuracies", "loss")
    print("LOGS " + json.dumps([{k: v for k, v in row.items() if k in keep}
                                for row in trainer.state.log_history]), file=sys.stderr)
    return times[2:]


def child(args):
    import torch
    torch.set_num_threads(args.threads)
    side, algo = args.side.split("-")
    times = ours(args, algo) if side == "ours" else trl(args, algo)
    print("RESULT " + json.dumps(times))


def run_child(python, side, args):
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    cmd = [python, os.path.abspath(__file__), "--side", side, *sys.argv[1:]]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode or line is None:
        sys.exit(f"{side} failed:\n{p.stdout[-2000:]}{p.stderr[-3000:]}")
    return json.loads(line[7:])


def main(args):
    import torch
    if not os.path.exists(args.init):
        sys.exit(f"no {args.init}: run `python sft.py` first")
    os.makedirs(args.out, exist_ok=True)
    folder = os.path.join(args.out, "sft-hf")
    if not os.path.isdir(folder):
        subprocess.run([sys.executable, "export.py", args.init, folder], cwd=ROOT, check=True)
    version = subprocess.run([args.trl_python, "-c", "import trl; print(trl.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo")
                if x.startswith("model name")), "?")
    print(f"{os.cpu_count()} x {cpu}, torch {torch.__version__}, TRL {version}, "
          f"OMP_NUM_THREADS={args.threads}, {args.steps} steps a process")
    for algo in args.algos.split(","):
        results = {"ours": [], "trl": []}
        for r in range(args.rounds):
            for side, python in (("ours", sys.executable), ("trl", args.trl_python)):
                results[side] += run_child(python, f"{side}-{algo}", args)
                print(f"{algo} round {r + 1} {side}: median so far "
                      f"{statistics.median(results[side]):.3f} s a step", flush=True)
        med = {s: statistics.median(t) for s, t in results.items()}
        print(f"== {algo}: this project {med['ours']:.3f} s a step, TRL {med['trl']:.3f} s; "
              f"TRL's / ours: {med['trl'] / med['ours']:.2f}x")


if __name__ == "__main__":
    a = parse_args()
    child(a) if a.side else main(a)
