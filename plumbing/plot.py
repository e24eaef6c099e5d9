"""
A run's curves from its own folder: `python -m plumbing.plot out/grpo` reads out/grpo/metrics.jsonl
and writes out/grpo/plot.png, reward, KL to the reference, completion length and held-out accuracy
against step (the panels the run logged; the accuracy's decoding settings in its title).
"""
import argparse
import json
import os
import sys

import evaluation

PANELS = (("reward (sampled, mean)", ("reward_mean", "turn_reward")),
          ("KL(pi || pi_ref) per token", ("kl_exact",)),
          ("completion length (tokens)", ("completion_len", "env_tokens")),
          ("held-out accuracy", ("eval_accuracy",)))


def plot(folder):
    """(the PNG's path, the panels drawn); ValueError naming what is missing."""
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"{folder}: no metrics.jsonl (give a run's folder, e.g. out/grpo)")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    panels = []
    for title, keys in PANELS:
        key = next((k for k in keys if any(k in r for r in rows)), None)
        if key is not None:
            panels.append((title, key, [(r["step"], r[key]) for r in rows if key in r]))
    if not panels:
        raise ValueError(f"{path}: none of {', '.join(k for _, ks in PANELS for k in ks)} logged")
    import matplotlib
    matplotlib.use("Agg")                                                # no display needed
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4), squeeze=False)
    for ax, (title, key, points) in zip(axes[0], panels):
        if key == "eval_accuracy":
            title = f"held-out {evaluation.name(next(r for r in rows if key in r))}"
        ax.plot(*zip(*points), marker="o", markersize=3)
        ax.set(title=title, xlabel="step")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{os.path.abspath(folder)} (python -m plumbing.plot {folder})", fontsize=9)
    fig.tight_layout()
    out = os.path.join(folder, "plot.png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out, [key for _, key, _ in panels]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m plumbing.plot", description=__doc__.strip())
    parser.add_argument("folder", help="a run's metrics folder, e.g. out/grpo")
    args = parser.parse_args(argv)
    try:
        out, keys = plot(args.folder)
    except ValueError as e:
        parser.error(str(e))
    print(f"wrote {out} ({', '.join(keys)})")


if __name__ == "__main__":
    sys.exit(main())
