"""
Test-time search with verifiers: spend more compute at inference by sampling N completions and
picking one, or by searching step by step with a process reward model, on the held-out prompts,
from the SFT policy.

Sample 32 completions of every held-out prompt once (T = 1). For N = 1, 2, 4, ..., 32 pick one of N
by majority vote over the final answers (self-consistency), or by the highest score of a verifier
(best-of-N): the outcome reward model (ORM), the process reward model (PRM; its step probabilities
by min or product) or reward_model.py's Bradley-Terry model; pass@N, right if any of the N is, is
the ceiling of every way of picking. Then PRM-guided beam search: grow partial solutions one step
at a time and keep those the PRM scores best. Accuracy is the verifier's on the picked completion;
cost is tokens generated. Nothing is trained here: search.py only reads checkpoints.

Self-consistency: Wang et al. 2022, arXiv 2203.11171; best-of-N with a verifier: Cobbe et al.
2021, arXiv 2110.14168; ORM, PRM and majority compared: Lightman et al. 2023, arXiv 2305.20050;
PRM beam search: Snell et al. 2024, arXiv 2408.03314. For a prompt x and samples y_1..y_N with
final answers a_i:
    majority@N    = the y_i with the most frequent non-None a_i (ties: the first to appear)
    best-of-N(v)  = y_argmax_i v(x, y_i)    v: the ORM's p, the PRM's min or prod of p_k, the RM's r
    beam search   = level 1 samples b*e first steps; then e next steps from each unfinished kept
                    path (a step runs to the next ',' or the EOS); identical paths count once; the
                    b paths with the highest PRM score at their last step are kept, finished ones
                    competing with the new; it stops when all b are finished, the answer the best

Choices the papers leave open:
- The 32 samples are drawn once; for N < 32 accuracy is the mean over the 32/N disjoint groups.
- Tokens: generated tokens per prompt, EOS included; for beam search every step sampled, kept or
  not. Re-reading prefixes (the verifiers' passes, the sampler's prompt pass) is not counted.
- Beam scores are the last step's PRM probability, as Snell et al.; the weakest step so far (min)
  would favour unfinished paths, whose min can only fall as they grow (experiments/README.md).

Run (builds out/sft.pt, out/rm.pt, out/orm.pt and out/prm.pt first where missing):
    python search.py
    python search.py --max_n 8 --beam 2 --eval_n 128       # a quick look
Writes out/search/results.json (accuracy by method and N, tokens) and out/search/search.png.
"""
import json
import math
import os
import time

import torch
import torch.nn.functional as F

import task
from hf.tokenizer import Tokenizer
from model import GPTConfig, KVCache, scores_at
from plumbing.flags import (RM_PATH, SFT_PATH, TEMPERATURE, Int, add_task_flags, parser,
                            require_arithmetic)
from plumbing.loading import (build_missing, check_fits, load_model, pick_device, read_checkpoint,
                              seed_everything)
from prm import aggregate_steps, load_verifier         # the PRM's loading and how its steps combine
from task import left_pad, pad_steps
from tasks import arithmetic

ORM_PATH, PRM_PATH = os.path.join("out", "orm.pt"), os.path.join("out", "prm.pt")


# -----------------------------------------------------------------------------
# The algorithm: how one of N is picked

def majority_vote(answers):
    """Self-consistency: answers, a list (prompts) of lists (N) of strings or None (no parsable
    answer) -> per prompt the most frequent non-None answer, ties broken by first appearance; None
    when all are None."""
    picked = []
    for row in answers:
        counts, first = {}, {}
        for i, a in enumerate(row):
            if a is not None:
                counts[a] = counts.get(a, 0) + 1
                first.setdefault(a, i)
        picked.append(min(counts, key=lambda a: (-counts[a], first[a])) if counts else None)
    return picked


def best_of_n(scores):
    """Best-of-N: scores (P, N) -> (P,) int64, the index of the highest score of each row, ties to
    the lowest index, NaN counted as the lowest score (below -inf; a row of NaN gives 0)."""
    s = torch.as_tensor(scores, dtype=torch.float64)
    if s.dim() != 2 or s.size(1) == 0:
        raise ValueError(f"best_of_n: scores of shape {tuple(s.shape)}; need (P, N) with N >= 1 "
                         f"samples to pick from")
    nan = torch.isnan(s)
    filled = torch.where(nan, float("-inf"), s)
    top = filled.max(1, keepdim=True).values                                   # (P, 1)
    # (P, N) NaN only where all are NaN
    is_top = (filled == top) & (~nan | nan.all(1, keepdim=True))
    index = torch.arange(s.size(1)).expand_as(s)
    return torch.where(is_top, index, s.size(1)).min(1).values     # the lowest index among the best


# -----------------------------------------------------------------------------
# Scoring completions with a verifier

@torch.no_grad()
def score(model, tok, kind, prompts, ids, finished=None, how=None, batch_size=512):
    """One score per completion: prompts (B,) strings, ids (B,) token-id lists (as sampled: the stop
    token last when one ended it). kind "orm" or "rm": the head's output at the last token; "prm":
    the step probabilities, aggregated by `how`. finished: (B,) bools, False for a partial path
    (read at its ','s only); default all True. Returns (B,) float32 on the CPU."""
    finished = [True] * len(ids) if finished is None else finished
    out = []
    for i in range(0, len(ids), batch_size):
        rows = range(i, min(i + batch_size, len(ids)))
        tokens, attn, _ = task.completion_batch([prompts[j] for j in rows], [ids[j] for j in rows],
                                                tok, model.head.weight.device)
        pos = [task.read_positions(tok.encode_prompt(prompts[j]), ids[j], tok,
                                   "prm" if kind == "prm" else "orm", finished[j]) for j in rows]
        positions, step_mask = pad_steps(pos, 0, torch.long, tokens.device)
        r = scores_at(model, tokens, attn, positions, step_mask).float()     # (b, S)
        out.append((aggregate_steps(torch.sigmoid(r), step_mask, how) if kind == "prm"
                    else r[:, 0]).cpu())
    return torch.cat(out)


# -----------------------------------------------------------------------------
# PRM-guided beam search

@torch.no_grad()
def sample_steps(policy, tok, prefixes, limits, temperature, generator):
    """One more step for each prefix (prompt + completion so far, token ids): sampled until a token
    that contains ',', the EOS, or `limits[i]` new tokens. Returns the new tokens of each row, the
    stop token included."""
    device = next(policy.parameters()).device
    stops = torch.tensor([t for t in range(tok.vocab_size) if t in tok.stop_ids
                          or "," in tok.decode([t])], device=device)
    idx, mask = left_pad(prefixes, tok.pad_id, device)                              # (B, Tp)
    B, L = len(prefixes), max(limits)
    limit = torch.tensor(limits, device=device)
    cache = KVCache(policy.config.n_layer, B, idx.size(1) + L, device)
    # (B, V) predicts the first new token
    logits = policy(idx, mask, cache)[:, -1]
    new = torch.full((B, L), tok.pad_id, dtype=torch.long, device=device)
    length = torch.zeros(B, dtype=torch.long, device=device)           # (B,) new tokens of each row
    done = torch.zeros(B, dtype=torch.bool, device=device)
    for t in range(L):
        nxt = torch.multinomial(F.softmax(logits.float() / temperature, -1), 1,
                                generator=generator).squeeze(1)                               # (B,)
        new[:, t] = nxt
        length += (~done).long()
        done = done | torch.isin(nxt, stops) | (t + 1 >= limit)
        if done.all():
            break
        logits = policy(nxt[:, None], None, cache)[:, -1]    # the step: all real
    return [row[:n] for row, n in zip(new.tolist(), length.tolist())]


def beam_search(policy, prm, tok, prompts, beam, expand, temperature, max_new_tokens, generator,
                how="last"):
    """PRM-guided step-level beam search (module docstring), paths ranked by the PRM's
    aggregate_steps `how` of their steps so far. Returns the picked completion of each prompt (token
    ids, its stop token last when it has one) and the tokens generated."""
    prompt_ids = [tok.encode_prompt(p) for p in prompts]
    kept = [[([], False)] for _ in prompts]           # per prompt: (completion ids, finished) paths
    tokens = [0] * len(prompts)
    level = 0
    while any(not done for paths in kept for _, done in paths):
        # 1. expand: every unfinished kept path gets `expand` sampled next steps (b*e from the
        #    prompt at level 1)
        width = beam * expand if level == 0 else expand
        jobs = [(i, ids) for i, paths in enumerate(kept) for ids, done in paths if not done
                for _ in range(width)]
        steps = sample_steps(policy, tok, [prompt_ids[i] + ids for i, ids in jobs],
                             [max_new_tokens - len(ids) for _, ids in jobs], temperature, generator)
        # finished paths compete again
        candidates = [[path for path in paths if path[1]] for paths in kept]
        for (i, ids), step in zip(jobs, steps):
            tokens[i] += len(step)
            ended = step[-1] in tok.stop_ids
            path = ids + step
            path = (path, ended or len(path) >= max_new_tokens)
            if path not in candidates[i]:                        # the same path sampled twice: once
                candidates[i].append(path)
        # 2. score every candidate with the PRM at its last step so far (Snell et al.): a path's min
        #    over its steps could only fall as it grew, which would favour unfinished paths over
        #    finished ones
        flat = [(i, path) for i, paths in enumerate(candidates) for path in paths]
        s = score(prm, tok, "prm", [prompts[i] for i, _ in flat], [p[0] for _, p in flat],
                  [p[1] for _, p in flat], how)
        # 3. keep the `beam` best candidates of each prompt (ties: the first)
        at = 0
        for i, paths in enumerate(candidates):
            order = best_first(s[at:at + len(paths)])
            kept[i] = [paths[j] for j in order[:beam]]
            at += len(paths)
        level += 1
    return [paths[0][0] for paths in kept], tokens                 # kept[i] is best first


def best_first(scores):
    """Indices of scores (N,) from the highest to the lowest, ties in index order, NaN last."""
    v = scores.tolist()
    return sorted(range(len(v)), key=lambda j: (math.isnan(v[j]), 0.0 if math.isnan(v[j]) else
                                                -v[j], j))


# -----------------------------------------------------------------------------
# Hyperparameters

def parse_args(argv=None):
    p = parser(__doc__)
    g = p.add_argument_group("search")
    g.add_argument("--max_n", type=Int(ge=1, le=256), default=32,
                   help="the largest N: N runs over 1, 2, 4, ... up to it (samples per prompt)")
    g.add_argument("--beam", type=Int(ge=1, le=64), default=8,
                   help="the largest beam: beam search runs with beams 1, 2, 4, ... up to it")
    g.add_argument("--expand", type=Int(ge=1, le=64), default=4,
                   help="beam search: next steps from each kept path")
    g.add_argument("--beam_score", choices=("last", "min"), default="last",
                   help="beam search ranks paths by the PRM at their last step (Snell et al.) or "
                        "their weakest step")
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=TEMPERATURE, default=1.0,
                   help="sampling temperature (best-of-N, beam)")
    g.add_argument("--max_new_tokens", type=Int(ge=1), default=None,
                   help="longest completion (default: the task's)")
    g = p.add_argument_group("run")
    held_out = len(arithmetic.eval_prompts())
    g.add_argument("--eval_n", type=Int(ge=1, le=held_out), default=held_out,
                   help="held-out prompts")
    g.add_argument("--init", default=SFT_PATH,
                   help="SFT policy: the sampler (built if it is the missing default)")
    g.add_argument("--rm", default=RM_PATH,
                   help="Bradley-Terry reward model (reward_model.py; built if missing)")
    g.add_argument("--orm", default=ORM_PATH,
                   help="outcome reward model (prm.py; built if the missing default)")
    g.add_argument("--prm", default=PRM_PATH,
                   help="process reward model (prm.py; built if the missing default)")
    g.add_argument("--out", default="out",
                   help="folder for search/results.json and search/search.png")
    g.add_argument("--seed", type=Int(ge=0, lt=2**32), default=0,
                   help="seeds python, numpy and torch")
    g.add_argument("--device", default=None, help="cuda, mps or cpu (default: the first available)")
    add_task_flags(p)
    args = p.parse_args(argv)
    require_arithmetic(p, args, "test-time search with process rewards (arithmetic.step_labels)")
    return args


def check_before_work(args):
    """Everything that can be refused before a prerequisite is built or a sample drawn: checkpoint
    flags (a missing one that is not its default, an unreadable one), --max_new_tokens against the
    model sft.py would build, and --out."""
    for flag, default, maker in (("init", SFT_PATH, "sft.py"), ("rm", RM_PATH, "reward_model.py"),
                                 ("orm", ORM_PATH, "prm.py"),
                                 ("prm", PRM_PATH, "prm.py --train prm")):
        path = getattr(args, flag)
        if os.path.exists(path):
            read_checkpoint(path, f"--{flag}")
        elif os.path.abspath(path) != os.path.abspath(default):
            raise SystemExit(f"error: --{flag}: no checkpoint at {path}; train one with "
                             f"`python {maker}` or pass another path")
    if not os.path.exists(args.init):
        check_fits(task.max_prompt_tokens(Tokenizer()), args.max_new_tokens, GPTConfig().block_size)
    folder = os.path.join(args.out, "search")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f".write_test{os.getpid()}"), "w"):
            pass
        os.remove(os.path.join(folder, f".write_test{os.getpid()}"))
    except OSError as e:
        raise SystemExit(f"error: cannot write to --out {args.out} ({e.strerror or e})") from None


def powers_of_two(n):
    """1, 2, 4, ... up to n, and n itself."""
    return sorted({2 ** k for k in range(int(math.log2(n)) + 1)} | {n})


def main(args):
    t0, c0 = time.time(), time.process_time()
    device = pick_device(args.device)
    seed_everything(args.seed)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))
    init = os.path.abspath(args.init)
    check_before_work(args)
    build_missing(args.init, SFT_PATH, ["sft.py"], args.device)
    build_missing(args.rm, RM_PATH, ["reward_model.py", "--init", init], args.device)
    build_missing(args.orm, ORM_PATH, ["prm.py", "--init", init], args.device)
    build_missing(args.prm, PRM_PATH, ["prm.py", "--init", init, "--train", "prm"], args.device)
    policy, tok, _ = load_model(args.init, device)
    rm = load_model(args.rm, device, "scalar", expect={"script": "reward_model"})[0]
    orm, prm = load_verifier(args.orm, device, "orm")[0], load_verifier(args.prm, device, "prm")[0]
    check_fits(task.max_prompt_tokens(tok), args.max_new_tokens, policy.config.block_size)
    prompts, N = task.eval_prompts()[:args.eval_n], args.max_n
    ns, beams = powers_of_two(N), powers_of_two(args.beam)
    print(f"search: {len(prompts)} held-out prompts, {N} samples each (N in {ns}), beam search "
          f"with beams {beams} x expand {args.expand}, on {device}", flush=True)

    with autocast:
        # 1. greedy, and N samples of every prompt, drawn once (the smaller N are sub-sampled from
        #    them)
        greedy = task.complete(policy, tok, prompts, 1, 0.0, args.max_new_tokens)
        gen = torch.Generator(device=device).manual_seed(args.seed)
        texts, ids = task.complete(policy, tok, prompts, N, args.temperature, args.max_new_tokens,
                                   generator=gen, return_ids=True)
        flat_prompts = [p for p in prompts for _ in range(N)]
        right = torch.tensor([task.reward(p, t)
                              for p, t in zip(flat_prompts, texts)]).view(-1, N)            # (P, N)
        length = torch.tensor([len(c) for c in ids],
                              dtype=torch.float).view(-1, N)               # the stop token included
        answers = [[None if a is None else str(a)
                    for a in map(arithmetic.parse_answer, texts[i * N:(i + 1) * N])]
                   for i in range(len(prompts))]

        # 2. every sample scored by every verifier
        scores = {"orm": score(orm, tok, "orm", flat_prompts, ids),
                  "rm": score(rm, tok, "rm", flat_prompts, ids),
                  "prm_min": score(prm, tok, "prm", flat_prompts, ids, how="min"),
                  "prm_prod": score(prm, tok, "prm", flat_prompts, ids, how="prod")}
        scores = {k: v.view(-1, N) for k, v in scores.items()}                         # (P, N) each

    # 3. accuracy of each way of picking one of N, averaged over the N / n disjoint groups of n
    names = {"majority": "majority vote", "orm": "best-of-N ORM", "prm_min": "best-of-N PRM (min)",
             "prm_prod": "best-of-N PRM (prod)", "rm": "best-of-N RM (Bradley-Terry)",
             "pass": "pass@N (oracle)"}
    accuracy, tokens = {k: [] for k in names}, []
    for n in ns:
        groups = [range(g * n, (g + 1) * n) for g in range(N // n)]
        acc = {k: 0.0 for k in names}
        for cols in groups:
            cols = list(cols)
            r = right[:, cols]                                                              # (P, n)
            picked = majority_vote([[row[j] for j in cols] for row in answers])
            right_answers = [a is not None and int(a) == arithmetic.answer(p)
                             for a, p in zip(picked, prompts)]
            acc["majority"] += sum(right_answers) / len(prompts)
            for k in ("orm", "prm_min", "prm_prod", "rm"):
                acc[k] += r.gather(1, best_of_n(scores[k][:, cols])[:, None]).mean().item()
            acc["pass"] += r.max(1).values.mean().item()
        for k in names:
            accuracy[k].append(acc[k] / len(groups))
        # per prompt, per group
        tokens.append(length[:, :len(groups) * n].sum().item() / len(prompts) / len(groups))

    # 4. PRM-guided beam search, for each beam width
    beam_results = []
    for b in beams:
        gen = torch.Generator(device=device).manual_seed(args.seed + 1000 + b)
        with autocast:
            picked, used = beam_search(policy, prm, tok, prompts, b, args.expand, args.temperature,
                                       args.max_new_tokens, gen, args.beam_score)
        acc = sum(task.reward(p, tok.decode([t for t in c if t not in tok.stop_ids]))
                  for p, c in zip(prompts, picked))
        acc /= len(prompts)
        beam_results.append({"beam": b, "expand": args.expand, "accuracy": acc,
                             "tokens": sum(used) / len(prompts)})

    # 5. the table, results.json, the figure
    greedy_acc = sum(task.reward(p, c) for p, c in zip(prompts, greedy)) / len(prompts)
    greedy_tokens = sum(min(len(tok.encode(c)) + 1, args.max_new_tokens)
                        for c in greedy) / len(prompts)
    results = {"prompts": len(prompts), "samples_per_prompt": N, "temperature": args.temperature,
               "seed": args.seed,
               "checkpoints": {"policy": args.init, "orm": args.orm, "prm": args.prm,
                               "rm": args.rm},
               "n": ns, "greedy": {"accuracy": greedy_acc, "tokens": greedy_tokens},
               "accuracy": accuracy, "tokens": tokens, "methods": names,
               "beam_search": beam_results,
               "wall_s": time.time() - t0, "cpu_s": time.process_time() - c0}
    print(table(results))
    os.makedirs(os.path.join(args.out, "search"), exist_ok=True)
    path = os.path.join(args.out, "search", "results.json")
    with open(f"{path}.tmp{os.getpid()}", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(f"{path}.tmp{os.getpid()}", path)                 # atomic: never a half-written file
    figure(results, os.path.join(args.out, "search", "search.png"))
    print(f"done in {results['wall_s']:.0f}s ({results['cpu_s']:.0f}s CPU) "
          f"| {len(prompts) * N:,} samples + beam search | wrote {path} "
          f"and {os.path.join(args.out, 'search', 'search.png')}")


def table(results):
    """The results as a Markdown table: accuracy by method (rows) and N (columns), the tokens per
    prompt below."""
    ns = results["n"]
    lines = ["| method | " + " | ".join(f"N={n}" for n in ns) + " |", "|---|" + "---:|" * len(ns)]
    lines.append(f"| greedy | {results['greedy']['accuracy']:.3f} (N=1) |" + " |" * (len(ns) - 1))
    for k, name in results["methods"].items():
        lines.append(f"| {name} | " + " | ".join(f"{a:.3f}" for a in results["accuracy"][k]) + " |")
    lines.append("| tokens per prompt | " + " | ".join(f"{t:.0f}" for t in results["tokens"])
                 + " |")
    lines += ["", "| PRM beam search | accuracy | tokens per prompt |", "|---|---:|---:|"]
    lines += [f"| beam {r['beam']} x expand {r['expand']} | {r['accuracy']:.3f} | "
              f"{r['tokens']:.0f} |" for r in results["beam_search"]]
    return "\n".join(lines)


def figure(results, path):
    """Accuracy against N, and against tokens generated per prompt, one line per method; written as
    PNG."""
    import matplotlib                                      # imported here: only the figure needs it
    matplotlib.use("Agg")                                  # no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.8))
    for k, name in results["methods"].items():
        style = {"linestyle": ":", "color": "grey"} if k == "pass" else {}
        left.plot(results["n"], results["accuracy"][k], marker="o", label=name, **style)
        right.plot(results["tokens"], results["accuracy"][k], marker="o", **style)
    beam = results["beam_search"]
    right.plot([r["tokens"] for r in beam], [r["accuracy"] for r in beam], marker="s",
               color="black", label=f"PRM beam search (expand {beam[0]['expand']}; "
                                    f"beam {', '.join(str(r['beam']) for r in beam)})")
    for ax in (left, right):
        ax.axhline(results["greedy"]["accuracy"], color="grey", linestyle="--", linewidth=1,
                   label="greedy" if ax is left else None)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_ylabel("held-out accuracy")
        ax.grid(alpha=0.3)
    left.set_xticks(results["n"])
    left.set_xlabel("N (samples per prompt)")
    right.set_xlabel("tokens generated per prompt")
    fig.legend(loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(f"SFT policy, {results['prompts']} held-out prompts: picking one of N, and "
                 f"PRM-guided beam search")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    tmp = f"{path}.tmp{os.getpid()}.png"
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)


if __name__ == "__main__":
    main(parse_args())
