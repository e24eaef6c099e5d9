"""
TRL's GRPOTrainer beside grpo.py, in one process, on one folder at one set of shapes: each one's
step time and peak memory and their ratio, a command anyone with a GPU can rerun (issue 49's
side-by-side).

    python bench/trl_grpo.py                      # GPU: the README recipe's shapes
    python bench/trl_grpo.py --device cpu --tiny  # toy shapes, a check of the code
                                                  # (tests/test_trl_bench.py)

Both train the Qwen2.5-0.5B-shaped random folder bench/recipe.py writes (--tiny: its 2-layer twin)
on the same prompts (the Countdown task in the R1 format) for --steps optimizer steps of P prompts x
G completions of at most --max_new_tokens, in micro-batches of --micro_batch rows, learning rate
1e-6, beta 0.04, one pass, with gradient checkpointing and bf16 on a GPU:
- this project: bench/recipe.run, grpo.py with the README recipe's flags, its own sampler and the
  task's verifier;
- TRL: GRPOConfig(per_device_train_batch_size=micro, gradient_accumulation_steps=P*G/micro,
  num_generations=G, max_completion_length, beta=0.04, num_iterations=1, loss_type="grpo",
  gradient_checkpointing, bf16, learning_rate=1e-6), the folder's path as the model (TRL loads it in
  float32, its default, under bf16 autocast), transformers' generate (no vLLM), random 0/1 rewards
  (a random model's answers are all wrong: the verifier would give TRL's groups no variance). Each
  optimizer step timed between device syncs by a TrainerCallback.
A random model rarely samples its EOS: both run every completion to --max_new_tokens. Steps after
the first are the comparison (the first compiles and warms up). Peak memory:
torch.cuda.max_memory_allocated, reset between the two. Where trl is not installed the TRL half is
skipped with one line.
"""
import argparse
import os
import random
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import recipe  # noqa: E402
import task  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--device", default="cuda",
                   help="cuda (the measurement) or cpu (--tiny, a check of the code)")
    p.add_argument("--tiny", action="store_true",
                   help="bench/recipe.py's 2-layer folder and small shapes")
    p.add_argument("--steps", type=int, default=3,
                   help="optimizer steps each (the first is warm-up)")
    p.add_argument("--prompts_per_step", type=int, default=None, help="P (default 16; --tiny 2)")
    p.add_argument("--group_size", type=int, default=None, help="G (default 8; --tiny 4)")
    p.add_argument("--micro_batch", type=int, default=None,
                   help="rows a forward (default 8; --tiny 4)")
    p.add_argument("--max_new_tokens", type=int, default=None,
                   help="completion length (default 1024; --tiny 16)")
    p.add_argument("--out", default=os.path.join(ROOT, "out", "bench"),
                   help="folder for the model and the runs")
    args = p.parse_args(argv)
    for name, full, tiny in (("prompts_per_step", 16, 2), ("group_size", 8, 4),
                             ("micro_batch", 8, 4), ("max_new_tokens", 1024, 16)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)}; allowed: at least 1")
    rows = args.prompts_per_step * args.group_size
    if args.steps < 2 or rows % args.micro_batch:
        p.error(f"--steps {args.steps} --micro_batch {args.micro_batch}: allowed: --steps >= 2 "
                f"(the first is warm-up) and a micro-batch dividing P x G = {rows}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda, but CUDA is not available here; use --device cpu --tiny")
    return args


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak(device):
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def reset(device):
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def ours(args, folder):
    """grpo.py through bench/recipe.run at these shapes: each step's seconds, and the peak."""
    rows = args.prompts_per_step * args.group_size
    a = recipe.parse_args(["--steps", str(args.steps), "--max_new_tokens", str(args.max_new_tokens),
                           "--device", args.device, "--out", args.out,
                           *(["--tiny"] if args.tiny else []),
                           "--extra", "--prompts_per_step", str(args.prompts_per_step),
                           "--group_size", str(args.group_size),
                           "--grad_accum", str(rows // args.micro_batch)])
    reset(args.device)
    result = recipe.run(a)
    return [s["step_s"] for s in result["steps"]], result["peak_gib"]   # sampling, scoring, update


def trl(args, folder, prompts):
    """TRL's GRPOTrainer at these shapes: each optimizer step's seconds and the peak; None
    without trl."""
    try:
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        print(f"TRL skipped: {e.name} is not installed (pip install trl)")
        return None
    rng, times, cuda = random.Random(0), [], args.device.startswith("cuda")

    def random_reward(completions, **kwargs):              # 0/1 at random: every group has variance
        return [float(rng.random() < 0.5) for _ in completions]

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kwargs):
            sync(args.device)
            self.start = time.perf_counter()

        def on_step_end(self, a, state, control, **kwargs):
            sync(args.device)
            times.append(time.perf_counter() - self.start)

    rows = args.prompts_per_step * args.group_size
    config = GRPOConfig(output_dir=os.path.join(args.out, "trl-run"),
                        per_device_train_batch_size=args.micro_batch,
                        gradient_accumulation_steps=rows // args.micro_batch,
                        num_generations=args.group_size, max_completion_length=args.max_new_tokens,
                        beta=0.04, num_iterations=1, loss_type="grpo", gradient_checkpointing=True,
                        bf16=cuda, use_cpu=not cuda, learning_rate=1e-6, max_steps=args.steps,
                        logging_steps=1, report_to="none", save_strategy="no", seed=0,
                        temperature=1.0)
    data = Dataset.from_dict({"prompt": prompts})
    reset(args.device)
    trainer = GRPOTrainer(model=folder, reward_funcs=random_reward, args=config, train_dataset=data,
                          callbacks=[Clock()])
    trainer.train()
    return times, peak(args.device)


def main(args):
    folder = recipe.write_folder(
        os.path.join(args.out, "tiny-qwen2-shaped" if args.tiny else "qwen2.5-0.5b-shaped"),
        recipe.TINY if args.tiny else recipe.QWEN, 65000 if args.tiny else recipe.ORDINARY)
    ours_times, ours_peak = ours(args, folder)
    task.use(argparse.Namespace(task="countdown", format="r1", countdown_numbers=3, data=None))
    prompts = task.sample_prompts(random.Random(0), 4 * args.prompts_per_step * args.steps)
    theirs = trl(args, folder, prompts)
    rows = args.prompts_per_step * args.group_size
    print(f"\n== grpo.py against TRL's GRPOTrainer, {rows} rows of at most {args.max_new_tokens} "
          f"new tokens a step, micro-batches of {args.micro_batch}, {args.device}, "
          f"torch {torch.__version__}"
          + (f", {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""))
    print("command: python bench/trl_grpo.py " + " ".join(sys.argv[1:]))
    print("| run | each step, s | median after the first, s | peak allocated GiB |")
    print("| --- | --- | ---: | ---: |")
    show = lambda ts: ", ".join(f"{t:.2f}" for t in ts)
    gib = lambda x: f"{x:.2f}" if x is not None else "-"
    mine = statistics.median(ours_times[1:])
    print(f"| this project, grpo.py (bench/recipe.py) | {show(ours_times)} | {mine:.2f} | "
          f"{gib(ours_peak)} |")
    out = {"ours": ours_times, "ours_peak_gib": ours_peak}
    if theirs is not None:
        import trl as trl_module
        their = statistics.median(theirs[0][1:])
        print(f"| TRL {trl_module.__version__} GRPOTrainer | {show(theirs[0])} | {their:.2f} | "
              f"{gib(theirs[1])} |")
        print(f"TRL's step / this project's: {their / mine:.2f}x")
        out.update({"trl": theirs[0], "trl_peak_gib": theirs[1], "ratio": their / mine})
    return out


if __name__ == "__main__":
    main(parse_args())
