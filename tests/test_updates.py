"""One exact update per training script: what each loop feeds its loss, not only the loss.

Each script runs through tests/ddp_worker.py: fixed completions (a function of the prompt and the
sample's index; agent.py's episodes planned so, the environment answering), plain SGD in place of
AdamW, and a record of what each step was fed (the prompts, the batches) and of each optimiser
step's gradient. The test rebuilds every sequence from the recorded prompts and texts alone (its own
tokens, one sequence at a time with no padding, its own position slices, its own rewards and
labels), writes the loss again from the paper's equation in float64 on a float64 copy of the
starting weights, and asks for the same gradient at every optimiser step and the same weights at the
end (SGD: w - lr (g + wd w), with the learning rate of the test's own schedule).

The first step of an RL run starts with the policy equal to the reference and the ratio at 1: there
the KL terms have no gradient and the clip never acts. So every RL case runs a second pass or a
second step, simulated here too, with a non-default temperature and beta: a flipped KL sign or a
dropped temperature changes the update. Each flag under test is shown to take effect: the script's
update is also compared with what the equation gives with that flag at its default (or with a
planted mistake: a KL of the wrong sign, a score read one token off), and must be far from it.
"""
import contextlib
import copy
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import task
from conftest import ROOT, run_script, task_args
from ddp_worker import (fixed_chat_episode, fixed_completion, fixed_episode,
                        fixed_guess_episode)
from hf.checkpoint import load_checkpoint, save_checkpoint
from hf.tokenizer import Tokenizer
from model import GPT, GPTConfig
from tasks import arithmetic, guess, toolcalc

WORKER = os.path.join(ROOT, "tests", "ddp_worker.py")
TOK = Tokenizer()
EOS = TOK.eos_id
SGD_LR = 0.02      # the worker's SGD learning rate, where the script does not set one each step
GRAD_TOL = 3e-4    # float32 gradient against float64: relative error (norm over all parameters); a
                   # later step starts from float32 weights rounded at every earlier one (1.2e-4
                   # seen at a third step on one CPU), still 3x below FAR
WEIGHT_TOL = 3e-4  # the same for the weights' change (float32 weights rounded)
FAR = 1e-3         # an update with a flag ignored is at least this far (relative)
MARGIN = 1e-5      # a float64 value this close to a threshold the update decides on (a clip's
                   # 1 + eps) may fall on the threshold's other side in the float32 run (seen:
                   # 1.9e-7, a wrong side)


# -----------------------------------------------------------------------------
# Running a script, and what it recorded

class Result:
    def __init__(self, out, name, start, events):
        self.out, self.start, self.events = out, start, events
        self.model, self.ckpt = load_checkpoint(os.path.join(out, f"{name}.pt"))
        self.steps = [e for e in events if e["kind"] == "step"]
        with open(os.path.join(out, name, "metrics.jsonl")) as f:
            self.metrics = [json.loads(line) for line in f]

    def of(self, kind):
        return [e for e in self.events if e["kind"] == kind]

    def weights(self):
        return [p.detach() for p in self.model.parameters()]


def train(script, flags, out, name=None, lr=SGD_LR):
    """Run `script` (a ddp_worker name) with `flags` in one process, SGD at `lr` where the script
    does not set the learning rate: its Result (checkpoint `name`.pt)."""
    os.makedirs(out, exist_ok=True)
    start, log = os.path.join(out, "start.pt"), os.path.join(out, "log.pt")
    env = {"OMP_NUM_THREADS": "1", "DDP_WORKER_INIT": start, "DDP_WORKER_LOG": log,
           "DDP_WORKER_LR": str(lr)}
    p = run_script(WORKER, [script, *flags, "--log_every", "1", "--eval_n", "1", "--out", out],
                   env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return Result(out, name or script, torch.load(start), torch.load(log))


# -----------------------------------------------------------------------------
# float64 models, their gradients and SGD steps, and the comparisons

_decisions = None              # the distances noted by decided() while margins() is open


def decided(values, *thresholds, where=None):
    """Note how close `values` (a tensor; where: the entries that matter) come to each threshold,
    for margins()."""
    values = values.detach() if where is None else values.detach()[where]
    if _decisions is not None and values.numel():
        _decisions.extend(float((values - t).abs().min()) for t in thresholds)


@contextlib.contextmanager
def margins():
    """The expected update computed inside decides each threshold as the float32 run must: every
    value decided() saw is at least MARGIN from its threshold. The starting weights are the same on
    every machine (tests/fixtures), so this holds everywhere or nowhere; where it fails, the test's
    data must change, not its tolerance."""
    global _decisions
    _decisions = []
    try:
        yield
        closest = min(_decisions, default=1.0)
        assert closest > MARGIN, (f"a decision {closest:.1e} from its threshold: "
                                  "too close to call in float32")
    finally:
        _decisions = None

def f64(model, weights=None):
    """A float64 copy of `model` in eval mode (no dropout), its parameters set to `weights` if
    given."""
    m = copy.deepcopy(model).double().eval()
    if weights is not None:
        with torch.no_grad():
            for p, w in zip(m.parameters(), weights):
                p.copy_(w)
    return m


def frozen(model):
    return copy.deepcopy(model).requires_grad_(False)


def grad_of(loss, model):
    params = list(model.parameters())
    return [torch.zeros_like(p) if g is None else g
            for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True))]


def sgd_step(model, grads, lr, weight_decay=0.0):
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p.sub_(lr * (g + weight_decay * p))


def clip(grads, max_norm):
    """torch.nn.utils.clip_grad_norm_'s rule: scale by max_norm / (norm + 1e-6) when that is below
    1."""
    norm = torch.sqrt(sum((g ** 2).sum() for g in grads)).item()
    return [g * min(1.0, max_norm / (norm + 1e-6)) for g in grads]


def rel_err(got, want):
    """|got - want| / |want|, the norms over every tensor of the lists."""
    num = sum(((g.double() - w.detach().double()) ** 2).sum() for g, w in zip(got, want))
    return math.sqrt(float(num / sum((w.detach().double() ** 2).sum() for w in want)))


def check_grads(result, expected, group=0, far=()):
    """Each optimiser step's recorded gradient (of parameter group `group`) is the expected one.
    far: (name, the gradients of a wrong update), each at least FAR away from the recorded ones at
    some step."""
    got = [s["grads"][group] for s in result.steps]
    assert len(got) == len(expected), f"{len(got)} optimiser steps, {len(expected)} expected"
    for i, (g, w) in enumerate(zip(got, expected)):
        err = rel_err(g, w)
        assert err < GRAD_TOL, f"step {i + 1}: gradient off by {err:.2e} (relative)"
    for name, wrong in far:
        if len(wrong) != len(got):
            continue                                             # told apart by the number of steps
        err = max(rel_err(g, w) for g, w in zip(got, wrong))
        assert err > FAR, f"the update does not tell {name} apart ({err:.2e})"


def weight_change_error(result, model, start=None):
    start = result.start if start is None else start
    return rel_err([w - s for w, s in zip(result.weights(), start)],
                   [w - s.double() for w, s in zip(model.parameters(), start)])


def check_weights(result, model, far=()):
    """The checkpoint's weights are the simulated model's (their change from the start); far: (name,
    the model of a wrong update), each at least FAR away."""
    err = weight_change_error(result, model)
    assert err < WEIGHT_TOL, f"the weights' change is off by {err:.2e} (relative)"
    for name, wrong in far:
        err = weight_change_error(result, wrong)
        assert err > FAR, f"the weights do not tell {name} apart ({err:.2e})"


# -----------------------------------------------------------------------------
# One sequence at a time: logits, token log-probs, scalar scores

def logits_of(gpt, ids):
    """(L, V) float64 logits of one unpadded sequence: row t predicts ids[t + 1]. The LM head
    written here."""
    h = gpt.hidden(torch.tensor([ids]), torch.ones(1, len(ids)))[0]
    return h @ gpt.lm_head.weight.T


def completion_logits(gpt, prompt_ids, completion_ids, temperature=1.0):
    """(n, V) logits / temperature predicting each of the n completion tokens, after the prompt and
    those before."""
    seq = list(prompt_ids) + list(completion_ids)
    return logits_of(gpt, seq)[len(prompt_ids) - 1:len(seq) - 1] / temperature


def token_logp(logits, ids):
    return logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None])[:, 0]


class Rows:
    """Completions as the test builds them, one row each: prompt ids, completion ids with the EOS,
    the text, and the verifier's reward of the text for its own prompt. G: rows per prompt (a
    prompt's G on consecutive rows)."""

    def __init__(self, items, G=1):
        self.prompts, self.texts = [p for p, _ in items], [t for _, t in items]
        self.prompt_ids = [TOK.encode(p) for p in self.prompts]
        self.ids = [TOK.encode(t) + [EOS] for t in self.texts]
        self.rewards = torch.tensor([task.reward(p, t) for p, t in items], dtype=torch.float64)
        self.well_formed = torch.tensor([float(arithmetic.is_well_formed(t)) for t in self.texts],
                                        dtype=torch.float64)
        self.G = G

    @classmethod
    def fixed(cls, prompts, G):
        """The worker's fixed completions: G for each prompt."""
        return cls([(p, fixed_completion(p, j)) for p in prompts for j in range(G)], G)

    def __len__(self):
        return len(self.ids)

    def logits(self, gpt, temperature=1.0):
        return [completion_logits(gpt, p, c, temperature)
                for p, c in zip(self.prompt_ids, self.ids)]

    def logp(self, gpt, temperature=1.0):
        return [token_logp(z, c) for z, c in zip(self.logits(gpt, temperature), self.ids)]


def scores_of(scalar, ids):
    """(L,) float64 outputs of a ScalarGPT along one unpadded sequence. The head written here."""
    h = scalar.backbone.hidden(torch.tensor([ids]), torch.ones(1, len(ids)))[0]
    return h @ scalar.head.weight[0] + scalar.head.bias[0]


def kl_estimate(logp, ref_logp, estimator, clamp=None):
    """Schulman's estimators of KL(pi || pi_ref) on a token sampled from pi; log r = log pi_ref -
    log pi."""
    log_r = ref_logp - logp
    if clamp is not None:
        decided(log_r, -clamp, clamp)
        log_r = log_r.clamp(-clamp, clamp)
    return {"k1": -log_r, "k2": log_r ** 2 / 2, "k3": torch.exp(log_r) - 1 - log_r}[estimator]


def exact_kl(logits_p, logits_q):
    """KL(softmax(p) || softmax(q)) at each position, over the vocabulary: (n, V), (n, V) ->
    (n,)."""
    lp, lq = logits_p.log_softmax(-1), logits_q.log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1)


def entropy(logits):
    lp = logits.log_softmax(-1)
    return -(lp.exp() * lp).sum(-1)


def lr_schedule(step, lr, warmup, total):
    """sft.py's, reward_model.py's and prm.py's: linear warm-up to lr over `warmup` steps, then
    cosine to lr / 10 at `total` (step 0-based)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (0.1 + 0.45 * (
        1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup)))))


# -----------------------------------------------------------------------------
# GRPO (DeepSeekMath eq. 3) and its family

def group_advantages(rewards, G, std="population", scale=True):
    out = torch.zeros_like(rewards)
    for g in range(len(rewards) // G):
        r = rewards[g * G:(g + 1) * G]
        if (r == r[0]).all():
            continue                                             # no signal: A = 0
        dev = r - r.mean()
        sd = torch.sqrt((dev ** 2).sum() / (G if std == "population" else G - 1))
        out[g * G:(g + 1) * G] = dev / (sd + 1e-6) if scale else dev
    return out


def grpo_expected(gpt, rows, c, ref=None):
    """mu SGD passes on GRPO's loss (negated eq. 3) and its family, c the settings: (model after,
    gradients). ref: pi_ref, if not gpt (the policy at the step's start)."""
    ref, model = frozen(gpt if ref is None else ref), copy.deepcopy(gpt)
    rewards = rows.rewards.clone()
    if c["overlong"]:                                    # DAPO eq. 13, on the length (EOS included)
        L, start = torch.tensor([len(x) for x in rows.ids],
                                dtype=torch.float64), c["max_new"] - c["overlong"]
        rewards += torch.where(L <= start, 0.0,
                               torch.where(L <= c["max_new"], (start - L) / c["overlong"], -1.0))
    if c["adv"] == "maxrl":                  # MaxRL: (r_i - p) / p, p the group's pass rate
        r = rewards.view(-1, rows.G)
        p = r.mean(1, keepdim=True)
        A = torch.where((r == r[:, :1]).all(1, keepdim=True), 0.0, (r - p) / (p + 1e-6)).view(-1)
    else:
        A = group_advantages(rewards, rows.G, c["std"], c["scale"])
    with torch.no_grad():
        old, ref_lp = rows.logp(gpt, c["T"]), rows.logp(ref, c["T"])
    lo, hi = c["clip"], c["eps_high"] or c["clip"]
    n_tokens, grads = sum(len(x) for x in rows.ids), []
    for _ in range(c["mu"]):
        total = 0.0
        for i, lp in enumerate(rows.logp(model, c["T"])):
            log_ratio = lp - old[i]
            ratio = (torch.exp(log_ratio) if c["ratio"] == "token"
                     else torch.exp(log_ratio.mean()).expand_as(lp))
            if c["loss"] in ("clip", "cispo"):
                decided(ratio, 1 - lo, 1 + hi, where=(A[i] != 0).expand_as(ratio))
            if c["loss"] == "clip":
                pg = -torch.min(ratio * A[i], ratio.clamp(1 - lo, 1 + hi) * A[i])
            elif c["loss"] == "cispo":                   # CISPO: -sg(clip(ratio)) A log pi
                pg = -ratio.clamp(1 - lo, 1 + hi).detach() * A[i] * lp
            elif c["loss"] == "sapo":                    # SAPO: -sigma(tau (r - 1)) 4 / tau A
                tau = c["tau_pos"] if A[i] > 0 else c["tau_neg"]
                pg = -torch.sigmoid(c["gate_sign"] * tau * (ratio - 1)) * 4 / tau * A[i]
            else:                                        # DPPO: -M r A, M from a binary divergence
                p, q = lp.detach().exp(), old[i].exp()
                if c["divergence"] == "tv":
                    D = (p - q).abs()
                elif c["divergence"] == "kl":            # KL(Bernoulli(q) || Bernoulli(p))
                    D = q * torch.log(q / p) + (1 - q) * torch.log((1 - q) / (1 - p))
                else:                                    # the planted mistake: KL(p || q)
                    D = p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))
                away = (p > q) if A[i] > 0 else (p < q)  # moved the way A pushes
                away = away | (c["mask"] == "symmetric")  # the planted mistake: either way
                decided(D, c["delta"], where=away & (A[i] != 0))
                pg = -torch.where((D > c["delta"]) & away, 0.0, ratio * A[i])
            per_token = pg + c["beta"] * kl_estimate(lp, ref_lp[i], c["kl"], c["kl_clamp"])
            total = total + {"seq": per_token.mean() / len(rows),
                             "token": per_token.sum() / n_tokens,
                             "dr_grpo": per_token.sum() / (len(rows) * c["max_new"])}[c["agg"]]
        g = grad_of(total, model)
        grads.append(g)
        sgd_step(model, g, c["lr"])
    return model, grads


def dynamic_sampling_rows(rollouts, P, G):
    """DAPO's dynamic sampling over the rounds drawn: the groups with 0 < #correct < G, in order,
    the first P."""
    kept = []
    for r in rollouts:
        rows = Rows.fixed(r["prompts"], G)
        for g in range(P):
            n = int(rows.rewards[g * G:(g + 1) * G].sum())
            if 0 < n < G:
                kept += [(rows.prompts[i], rows.texts[i]) for i in range(g * G, (g + 1) * G)]
    return Rows(kept[:P * G], G), len(kept)


GRPO = {"lr": SGD_LR, "T": 0.7, "beta": 0.3, "clip": 0.1, "eps_high": None, "kl": "k3",
        "kl_clamp": None, "mu": 2, "agg": "seq", "std": "population", "scale": True,
        "ratio": "token", "loss": "clip", "overlong": 0, "max_new": 24, "dynamic": False,
        "adv": "grpo", "tau_pos": 1.0, "tau_neg": 1.05, "gate_sign": 1, "divergence": "tv",
        "delta": 0.15, "mask": "directional"}
GRPO_FLAGS = ["--steps", "1", "--mu", "2", "--prompts_per_step", "4", "--group_size", "4",
              "--precedence_share", "1", "--temperature", "0.7", "--beta", "0.3",
              "--clip_eps", "0.1", "--grad_clip", "1e9"]
# name: (flags, settings, the defaults of the flags under test: each must change the update)
GRPO_CASES = {
    "grpo": ([], {}, {"T": 1.0, "beta": 0.04, "clip": 0.2}),
    "--std sample --loss_agg token --eps_high --kl_estimator k1 --kl_clamp": (
        ["--std", "sample", "--loss_agg", "token", "--eps_high", "0.3", "--kl_estimator", "k1",
         "--kl_clamp", "0.05"],
        {"std": "sample", "agg": "token", "eps_high": 0.3, "kl": "k1", "kl_clamp": 0.05},
        {"std": "population", "agg": "seq", "eps_high": None, "kl": "k3", "kl_clamp": None}),
    "Dr. GRPO --kl_estimator k2 --overlong_buffer": (
        ["--no_std_scaling", "--loss_agg", "dr_grpo", "--kl_estimator", "k2",
         "--overlong_buffer", "16"],
        {"scale": False, "agg": "dr_grpo", "kl": "k2", "overlong": 16},
        {"scale": True, "agg": "seq", "kl": "k3", "overlong": 0}),
    # GSPO: after the first pass the sequence ratios of A > 0 rows are about 1.1 (SGD at 0.02), so
    # eps_high 0.5 keeps them where 1 + clip_eps would clip them all
    "GSPO": (["--ratio_level", "sequence", "--clip_eps", "0.02", "--eps_high", "0.5"],
             {"ratio": "sequence", "clip": 0.02, "eps_high": 0.5},
             {"ratio": "token", "eps_high": None}),
    "CISPO": (["--loss_type", "cispo", "--loss_agg", "token", "--clip_eps", "0.05",
               "--eps_high", "0.05"],
              {"loss": "cispo", "agg": "token", "clip": 0.05, "eps_high": 0.05},
              {"loss": "clip", "clip": 0.2}),
    # SAPO at temperatures far apart, so that swapping them (or the gate's sign) shows
    "SAPO": (["--loss_type", "sapo", "--tau_pos", "3", "--tau_neg", "12"],
             {"loss": "sapo", "tau_pos": 3.0, "tau_neg": 12.0},
             {"loss": "clip", "tau_pos": 12.0, "tau_neg": 3.0, "gate_sign": -1}),
    # DPPO: bounds small enough that the second pass masks some tokens and keeps others; the KL
    # bound falls between KL(q || p) and KL(p || q) on some tokens
    "DPPO tv": (["--loss_type", "dppo", "--delta", "0.01"],
                {"loss": "dppo", "delta": 0.01},
                {"loss": "clip", "delta": 0.15, "mask": "symmetric"}),
    "DPPO kl": (["--loss_type", "dppo", "--divergence", "kl", "--delta", "0.012"],
                {"loss": "dppo", "divergence": "kl", "delta": 0.012},
                {"divergence": "kl(p||q)", "delta": 0.05}),
    "MaxRL": (["--maxrl"], {"adv": "maxrl"}, {"adv": "grpo"}),
    "DAPO --dynamic_sampling": (["--dynamic_sampling", "--precedence_share", "0.5",
                                 "--loss_agg", "token",
                                 "--eps_high", "0.3"],
                                {"dynamic": True, "agg": "token", "eps_high": 0.3},
                                {"dynamic": False}),
}


@pytest.mark.parametrize("case", list(GRPO_CASES))
def test_grpo_update(case, tiny_sft, tmp_path):
    flags, settings, defaults = GRPO_CASES[case]
    c = {**GRPO, **settings}
    result = train("grpo", ["--init", tiny_sft, *GRPO_FLAGS, *flags], str(tmp_path))
    rollouts = result.of("rollout")
    gpt = f64(result.model, result.start)
    if c["dynamic"]:
        rows, n_kept = dynamic_sampling_rows(rollouts, 4, 4)
        assert (len(rollouts) == 4
                or n_kept >= 16 > dynamic_sampling_rows(rollouts[:-1], 4, 4)[1])    # rounds: enough
        assert 0 < len(rows) < len(rollouts) * 16                  # some groups dropped, some kept
        first = Rows.fixed(rollouts[0]["prompts"], 4)     # --dynamic_sampling ignored
        wrong = [("--dynamic_sampling", grpo_expected(gpt, first, c)[1])]
    else:
        (rollout,) = rollouts
        rows = Rows.fixed(rollout["prompts"], 4)
        wrong = []
    with margins():
        model, grads = grpo_expected(gpt, rows, c)
    wrong += [(f"{k} {v}", grpo_expected(gpt, rows, {**c, k: v})[1])
              for k, v in defaults.items() if k != "dynamic"]
    wrong.append(("a flipped KL sign", grpo_expected(gpt, rows, {**c, "beta": -c["beta"]})[1]))
    check_grads(result, grads, far=wrong)                 # --mu 2: two steps, else a count mismatch
    check_weights(result, model)


class LoRA64(torch.nn.Module):
    """A float64 GPT whose trained parameters are LoRA's A and B alone (Hu et al. 2021): each
    adapted weight read as W + (alpha / r) B A, written here (a parametrization of the frozen W: the
    merged weight, row blocks per part of a fused projection) rather than lora.py's W x + s B (A x).
    parameters(): [A, B] per projection in lora.adapters' order (blocks in order; c_attn, c_proj,
    then the MLP's first and second linear)."""

    class Delta(torch.nn.Module):
        def __init__(self, A, B, scale):
            super().__init__()
            self.A, self.B, self.scale = A, B, scale

        def forward(self, W):
            return W + self.scale * self.B @ self.A                 # (out, in)

    def __init__(self, gpt, start, rank, alpha):
        super().__init__()
        self.ab = torch.nn.ParameterList([torch.nn.Parameter(t.double().clone()) for t in start])
        # not a submodule: parameters() are A and B
        object.__setattr__(self, "gpt", gpt.requires_grad_(False))
        sites = [layer for b in gpt.blocks
                 for layer in (b.attn.c_attn, b.attn.c_proj, b.mlp[0], b.mlp[2])]
        assert len(sites) * 2 == len(start)
        for i, layer in enumerate(sites):
            torch.nn.utils.parametrize.register_parametrization(
                layer, "weight", LoRA64.Delta(self.ab[2 * i], self.ab[2 * i + 1], alpha / rank))

    def hidden(self, *args):
        return self.gpt.hidden(*args)

    @property
    def lm_head(self):
        return self.gpt.lm_head

    def merged(self, names):
        """The tensors `names` (state_dict names of the GPT without adapters) as they are now: W +
        (alpha / r) B A for an adapted weight, as a merged checkpoint holds it."""
        out = []
        for name in names:
            module, attr = name.rsplit(".", 1)
            out.append(getattr(self.gpt.get_submodule(module), attr).detach())
        return out


def test_grpo_update_with_lora(tiny_sft, tmp_path):
    """--lora_rank: the gradient reaches A and B only, through W + (alpha / r) B A; the reference is
    the weights without the adapters (B = 0 there: the start), and the checkpoint loads as the
    merged weights."""
    c = GRPO
    flags = [*GRPO_FLAGS, "--steps", "2", "--lora_rank", "4", "--lora_alpha", "8"]
    result = train("grpo", ["--init", tiny_sft, *flags], str(tmp_path))
    base = f64(load_checkpoint(tiny_sft)[0])
    start = result.start
    # B = 0
    assert len(start) == 2 * 4 * base.config.n_layer and all((b == 0).all() for b in start[1::2])

    def two_steps(gpt, c, moving_ref=False):
        """Two steps of mu passes; pi_ref the start (the adapters off), or with moving_ref the
        policy at each step."""
        grads = []
        for rollout in result.of("rollout"):
            rows = Rows.fixed(rollout["prompts"], 4)
            after, g = grpo_expected(gpt, rows, c, ref=gpt if moving_ref else start_model)
            gpt, grads = after, grads + g
        return gpt, grads

    start_model = LoRA64(f64(base), start, rank=4, alpha=8.0)
    with margins():
        model, grads = two_steps(start_model, c)
    wrong = [("alpha / r at its default", two_steps(LoRA64(f64(base), start, 4, 32.0), c)[1]),
             ("a flipped KL sign", two_steps(start_model, {**c, "beta": -c["beta"]})[1]), (
        "the reference moving with the adapters", two_steps(start_model, c, moving_ref=True)[1])]
    check_grads(result, grads, far=wrong)
    # the adapters alone are optimised
    assert all(g is not None for s in result.steps for g in s["grads"][0])
    assert result.ckpt["lora"] == {"rank": 4, "alpha": 8.0, "targets": ["qkv", "o", "up", "down"]}
    names = list(base.state_dict())
    start_w = [w.detach() for w in base.state_dict().values()]
    got = [result.model.state_dict()[n] for n in names]
    err = rel_err([g - w0 for g, w0 in zip(got, start_w)],
                  [w - w0 for w, w0 in zip(model.merged(names), start_w)])
    assert err < WEIGHT_TOL, f"the merged weights' change is off by {err:.2e} (relative)"


# -----------------------------------------------------------------------------
# RLOO and REINFORCE: the KL to the reference in the reward, one step per batch; two steps (the KL
# is 0 at the first)

def reinforce_expected(gpt, rounds, c):
    """One SGD step per batch of rows on -1/B sum_i sum_t A_it log pi (Williams; RLOO; REINFORCE++):
    (model, grads)."""
    ref, model = frozen(gpt), copy.deepcopy(gpt)
    moving_average, grads = None, []
    for rows in rounds:
        with torch.no_grad():
            old, ref_lp = rows.logp(model, c["T"]), rows.logp(ref, c["T"])
        kl_t = [kl_estimate(o, r, c["kl"]) for o, r in zip(old, ref_lp)]
        r = rows.rewards + c["format"] * rows.well_formed                         # the format bonus
        R = r - c["beta"] * torch.stack([k.sum() for k in kl_t])      # R_i = r_i - beta sum_t KL_it
        if c["baseline"] == "rloo":
            Rg = R.view(-1, rows.G)
            # minus the others' mean
            A = (Rg - (Rg.sum(1, keepdim=True) - Rg) / (rows.G - 1)).view(-1)
        elif c["baseline"] == "reinforce_pp":                           # REINFORCE++: returns-to-go
            returns = []
            for i, k in enumerate(kl_t):
                r_t = -c["beta"] * k
                r_t[-1] += r[i]                                      # the outcome on the last token
                returns.append(r_t.flip(0).cumsum(0).flip(0))
            every = torch.cat(returns)
            mean, std = every.mean(), every.std(unbiased=False)      # over every token of the batch
            A = [(x - mean) / (std + 1e-8) for x in returns]
        else:
            b = {"none": 0.0, "batch_mean": R.mean(), "moving_average": moving_average
                 or 0.0}[c["baseline"]]
            A = R - b
            m = R.mean().item()
            moving_average = (m if moving_average is None
                              else c["decay"] * moving_average + (1 - c["decay"]) * m)
        loss = -sum((A[i] * lp).sum() for i, lp in enumerate(rows.logp(model, c["T"]))) / len(rows)
        g = grad_of(loss, model)
        grads.append(g)
        sgd_step(model, g, c["lr"])
    return model, grads


PG_FLAGS = ["--prompts_per_step", "4", "--group_size", "4", "--precedence_share", "1",
            "--temperature", "0.7", "--beta", "0.3", "--grad_clip", "1e9"]
PG_CASES = {   # name: (script, flags, settings, the defaults of the flags under test)
    "rloo": ("rloo", ["--steps", "2", "--kl_estimator", "k2"], {"baseline": "rloo", "kl": "k2"},
             {"T": 1.0, "beta": 0.04, "kl": "k1"}),
    "reinforce++": ("reinforce", ["--steps", "2", "--kl_estimator", "k3"],
                    # a smaller step: the whitened token advantages give a larger gradient
                    {"baseline": "reinforce_pp", "kl": "k3", "lr": 0.002},
                    {"T": 1.0, "beta": 0.04, "kl": "k1"}),
    "reinforce none --format_weight": ("reinforce",
                                       ["--steps", "2", "--baseline", "none",
                                        "--format_weight", "0.5"],
                                       {"baseline": "none", "format": 0.5},
                                       {"baseline": "batch_mean", "T": 1.0, "format": 0.0}),
    "reinforce batch_mean": ("reinforce", ["--steps", "2", "--baseline", "batch_mean"],
                             {"baseline": "batch_mean"},
                             {"baseline": "none", "beta": 0.04}),
    "reinforce moving_average": ("reinforce",
                                 ["--steps", "3", "--baseline", "moving_average",
                                  "--ema_decay", "0.5"],
                                 {"baseline": "moving_average", "decay": 0.5},
                                 {"baseline": "none", "decay": 0.9}),
}


@pytest.mark.parametrize("case", list(PG_CASES))
def test_rloo_and_reinforce_update(case, tiny_sft, tmp_path):
    script, flags, settings, defaults = PG_CASES[case]
    c = {"lr": SGD_LR, "T": 0.7, "beta": 0.3, "kl": "k1", "decay": 0.9, "format": 0.0, **settings}
    result = train(script, ["--init", tiny_sft, *PG_FLAGS, *flags], str(tmp_path), lr=c["lr"])
    rounds = [Rows.fixed(r["prompts"], 4) for r in result.of("rollout")]
    gpt = f64(result.model, result.start)
    model, grads = reinforce_expected(gpt, rounds, c)
    wrong = [(f"{k} {v}", reinforce_expected(gpt, rounds, {**c, k: v})[1])
             for k, v in defaults.items()]
    wrong.append(("a flipped KL sign", reinforce_expected(gpt, rounds,
                                                          {**c, "beta": -c["beta"]})[1]))
    check_grads(result, grads, far=wrong)
    check_weights(result, model)


# -----------------------------------------------------------------------------
# The reward model (Bradley-Terry, InstructGPT eq. 1): its update, and the checkpoint ppo.py and
# expert iteration use

def pair_ids(pair, side):
    """A pair's side as (prompt ids, completion ids): as sampled, with the EOS that ended it and
    none where it ran out of tokens (a demonstration's with its EOS)."""
    return TOK.encode(pair["prompt"]), list(pair[f"{side}_ids"])


def plain(ids):
    """The text of sampled ids, the EOS that ended them dropped (what the verifier reads)."""
    return TOK.decode([t for t in ids if t != EOS])


def rm_expected(scalar, batches, c):
    """SGD on -mean log sigmoid(r_c - r_r - margin), r read at each sequence's EOS (its last
    token)."""
    model, grads = copy.deepcopy(scalar), []
    for step, pairs in enumerate(batches):
        read = -1 - c["read_early"]
        score = lambda pair, side: scores_of(model, sum(pair_ids(pair, side), []))[read]
        loss = sum(-F.logsigmoid(score(p, "chosen") - score(p, "rejected") - c["margin"])
                   for p in pairs) / len(pairs)
        g = grad_of(loss, model)
        grads.append(g)
        lr = lr_schedule(step, 0.3, 1, 3) if c["schedule"] else 0.3
        sgd_step(model, g, lr)
    return model, grads


@pytest.fixture(scope="module")
def reward_model_run(tiny_sft, tmp_path_factory):
    """reward_model.py for 3 steps of 8 pairs (warm-up 1, then the cosine): its Result; its rm.pt
    serves ppo.py and expert_iteration.py --select rm below."""
    out = str(tmp_path_factory.mktemp("rm"))
    return train("reward_model", ["--init", tiny_sft, "--n_train", "24", "--batch_size", "8",
                                  "--epochs", "1", "--margin", "0.5", "--lr", "0.3",
                                  "--warmup", "1", "--grad_clip", "1e9"], out, "rm")


def test_reward_model_update(reward_model_run):
    result = reward_model_run
    batches = [e["pairs"] for e in result.of("pair_batch")]
    assert len(batches) == 3 and all(len(b) == 8 for b in batches)
    for pairs in batches:                                           # chosen correct, rejected wrong
        assert all(task.reward(p["prompt"], plain(p["chosen_ids"])) == 1.0 for p in pairs)
        assert all(task.reward(p["prompt"], plain(p["rejected_ids"])) == 0.0 for p in pairs)
    scalar = f64(result.model, result.start)
    c = {"margin": 0.5, "read_early": 0, "schedule": True}
    model, grads = rm_expected(scalar, batches, c)
    wrong = [(name, rm_expected(scalar, batches, {**c, **v})[1]) for name, v in (
        ("--margin 0", {"margin": 0.0}), ("the score read one token early", {"read_early": 1}))]
    check_grads(result, grads, far=wrong)
    check_weights(result, model)
    constant = rm_expected(scalar, batches,
                           {**c, "schedule": False})[0]              # the warm-up and cosine matter
    check_weights(result, model, far=[("a constant lr", constant)])


# -----------------------------------------------------------------------------
# PPO: critic, GAE, whitening, clipped policy and value losses, minibatches, the adaptive KL
# controller

def ppo_expected(gpt, critic, rm, prompts, perms, c):
    """PPO as ppo.py's docstring writes it (Schulman et al. 2017 eqs. 7, 9; GAE eq. 16; Ziegler
    et al. eq. 2 and section 2.2): (policy, critic, policy gradients, critic gradients, beta after,
    the logged KL per step)."""
    ref, rm = frozen(gpt), frozen(rm)
    policy, critic = copy.deepcopy(gpt), copy.deepcopy(critic)
    beta, perms, grads, critic_grads, kls = c["beta"], list(perms), [], [], []
    T = c["T"]
    for batch in prompts:
        rows = Rows.fixed(batch, 1)
        seqs = [p + x for p, x in zip(rows.prompt_ids, rows.ids)]
        with torch.no_grad():
            old_logits, ref_logits = rows.logits(policy, T), rows.logits(ref, T)
            old = [token_logp(z, x) for z, x in zip(old_logits, rows.ids)]
            ref_lp = [token_logp(z, x) for z, x in zip(ref_logits, rows.ids)]
            late = c["late"]
            values = [scores_of(critic, s)[len(p) - 1 + late:len(s) - 1 + late]
                      for p, s in zip(rows.prompt_ids, seqs)]
            score = (rows.rewards if c["reward"] == "verifier"
                     else torch.stack([scores_of(rm, s)[-1] for s in seqs]))
            kls.append(torch.stack([exact_kl(a, b).sum()
                                    for a, b in zip(old_logits, ref_logits)]).mean().item())
        advantages, returns = [], []
        for i in range(len(rows)):
            r = -beta * (old[i] - ref_lp[i])             # -beta log(pi_old / pi_ref) on every token
            r[-1] += score[i]                                   # the score on the last
            A, next_A, next_V = torch.zeros_like(r), 0.0, 0.0
            for t in reversed(range(len(r))):
                delta = r[t] + c["gamma"] * next_V - values[i][t]
                A[t] = next_A = delta + c["gamma"] * c["lam"] * next_A
                next_V = values[i][t]
            advantages.append(A)
            returns.append(A + values[i])
        if c["whiten"]:
            flat = torch.cat(advantages)
            advantages = [(a - flat.mean()) / (flat.std(unbiased=False) + 1e-8) for a in advantages]
        stop = False                                            # --target_kl: the epochs stop early
        for _ in range(c["epochs"]):
            # (a wrong update may run more epochs)
            perm = perms.pop(0) if perms else torch.arange(len(rows))
            for mb in torch.tensor_split(perm, c["minibatches"]):
                mb = mb.tolist()
                n = sum(len(rows.ids[i]) for i in mb)
                loss = approx_kl = 0.0
                for i in mb:
                    logits = completion_logits(policy, rows.prompt_ids[i], rows.ids[i], T)
                    log_ratio = token_logp(logits, rows.ids[i]) - old[i]
                    ratio = torch.exp(log_ratio)
                    # k3 of KL(pi_old || pi_theta)
                    approx_kl += (ratio - 1 - log_ratio).sum().item() / n
                    A = advantages[i]
                    decided(ratio, 1 - c["clip"], 1 + c["clip"])
                    pg = -torch.min(ratio * A, ratio.clamp(1 - c["clip"], 1 + c["clip"]) * A)
                    V = scores_of(critic, seqs[i])[
                        len(rows.prompt_ids[i]) - 1 + late:len(seqs[i]) - 1 + late]
                    decided(V - values[i], -c["clip_value"], c["clip_value"])
                    V_clipped = values[i] + (V - values[i]).clamp(-c["clip_value"], c["clip_value"])
                    vf = 0.5 * torch.max((V - returns[i]) ** 2, (V_clipped - returns[i]) ** 2)
                    loss = loss + (pg + c["vf"] * vf - c["ent"] * entropy(logits)).sum() / n
                both = grad_of(loss, torch.nn.ModuleList([policy, critic]))
                g, gc = both[:len(list(policy.parameters()))], both[len(list(policy.parameters())):]
                grads.append(g)
                critic_grads.append(gc)
                sgd_step(policy, g, SGD_LR)
                sgd_step(critic, gc, SGD_LR)
                if c["target_kl"] is not None:
                    decided(torch.tensor(approx_kl), 1.5 * c["target_kl"])
                stop = c["target_kl"] is not None and approx_kl > 1.5 * c["target_kl"]
                if stop:
                    break
            if stop:
                break
        if c["adaptive"]:
            error = min(max(kls[-1] / c["target"] - 1, -0.2), 0.2)
            beta *= 1 + error * len(rows) / c["horizon"]
    return policy, critic, grads, critic_grads, beta, kls, len(perms)


PPO = {"T": 0.7, "beta": 1.0, "adaptive": True, "target": 0.05, "horizon": 8, "clip": 0.1,
       "clip_value": 0.05, "vf": 0.7, "ent": 0.05, "gamma": 0.9, "lam": 0.8, "whiten": True,
       "epochs": 2, "minibatches": 2, "late": 0, "reward": "rm", "target_kl": None}
PPO_FLAGS = ["--steps", "2", "--batch_size", "8", "--minibatches", "2", "--ppo_epochs", "2",
             "--temperature", "0.7", "--beta", "1.0", "--adaptive_kl", "--kl_target", "0.05",
             "--kl_horizon", "8", "--clip_eps", "0.1", "--clip_value", "0.05", "--vf_coef", "0.7",
             "--ent_coef", "0.05", "--gamma", "0.9", "--gae_lambda", "0.8", "--grad_clip", "1e9"]
PPO_CASES = {   # name: (flags, settings, the defaults of the flags under test)
    "reward model, critic from it": ([], {}, {"T": 1.0, "beta": 0.3, "adaptive": False,
                                              "clip": 0.2, "clip_value": 0.2, "vf": 0.5, "ent": 0.0,
                                              "gamma": 1.0, "lam": 0.95, "late": 1}),
    "verifier, --no_whiten, --target_kl, critic from SFT": (
        ["--reward", "verifier", "--no_whiten", "--target_kl", "5e-4"],
        {"reward": "verifier", "whiten": False, "target_kl": 5e-4},
        {"reward": "rm", "whiten": True, "target_kl": None}),
}


@pytest.mark.parametrize("case", list(PPO_CASES))
def test_ppo_update(case, reward_model_run, tmp_path):
    flags, settings, defaults = PPO_CASES[case]
    c = {**PPO, **settings}
    rm_path = os.path.join(reward_model_run.out, "rm.pt")
    init = reward_model_run.ckpt["args"]["init"]
    result = train("ppo", ["--init", init, "--rm", rm_path, *PPO_FLAGS, *flags], str(tmp_path))
    # not the evaluation's
    prompts = [e["prompts"] for e in result.of("ppo_rollout") if len(e["prompts"]) == 8]
    perms = [e["perm"] for e in result.of("randperm")]
    assert len(prompts) == 2
    gpt = f64(result.model, result.start)
    rm = f64(load_checkpoint(rm_path)[0])
    critic = rm
    if c["reward"] == "verifier":                                        # --critic_init sft: head 0
        critic = f64(rm, [*gpt.parameters(), torch.zeros_like(rm.head.weight),
                          torch.zeros_like(rm.head.bias)])
    with margins():
        policy, critic_after, grads, critic_grads, beta, kls, unused = ppo_expected(
            gpt, critic, rm, prompts, perms, c)
    assert unused == 0                                                   # one permutation per epoch
    wrong = {k: ppo_expected(gpt, critic, rm, prompts, perms, {**c, k: v})
             for k, v in defaults.items()}
    wrong["a flipped KL sign"] = ppo_expected(gpt, critic, rm, prompts, perms,
                                              {**c, "beta": -c["beta"]})
    check_grads(result, grads, 0, far=[(k, w[2]) for k, w in wrong.items()])
    check_grads(result, critic_grads, 1)
    check_weights(result, policy)
    critic_start = [p.detach() for p in critic.parameters()]
    got = [result.ckpt["critic"][k] for k, _ in critic_after.named_parameters()]
    assert rel_err([g - s for g, s in zip(got, critic_start)],
                   [w - s for w, s in zip(critic_after.parameters(), critic_start)]) < 1e-4
    rows = [r for r in result.metrics if r["step"] > 0]
    # exact KL(pi_old || pi_ref)
    assert [r["kl"] for r in rows] == pytest.approx(kls, rel=1e-3, abs=1e-7)
    assert result.ckpt["beta"] == pytest.approx(beta, rel=1e-6)
    if c["adaptive"]:
        assert abs(beta - c["beta"]) > 1e-3 * c["beta"]                    # the controller moved it


# -----------------------------------------------------------------------------
# TRPO: the natural gradient by conjugate gradient on Fisher-vector products computed here another
# way (forward- then reverse-mode: F v = J^T (diag p - p p^T) J v / N, J the Jacobian of the logits
# / T), and the line search

class CompletionLogits(torch.nn.Module):
    """(sum_i n_i, V) logits / T of every completion token of `rows` under `gpt`, as a module for
    torch.func."""

    def __init__(self, gpt, rows, T):
        super().__init__()
        self.gpt, self.rows, self.T = gpt, rows, T

    def forward(self):
        return torch.cat(self.rows.logits(self.gpt, self.T))


def flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def conjugate_gradient(Fv, b, iters):
    """Hestenes and Stiefel's conjugate gradient from x = 0 (stopping when r.r <= 1e-10 b.b, as
    trpo.py)."""
    x, r = torch.zeros_like(b), b.clone()
    p, rr = r.clone(), r @ r
    for _ in range(iters):
        if rr <= 1e-10 * (b @ b):
            break
        Fp = Fv(p)
        alpha = rr / (p @ Fp)
        x, r = x + alpha * p, r - alpha * Fp
        rr, p = r @ r, r + (r @ r) / rr * p
    return x


def trpo_step(model, ref, rows, c):
    """Schulman et al. 2015, appendix C: one update on a batch, the reward and baseline of RLOO:
    (the model after, the step's metrics as trpo.py logs them)."""
    model = copy.deepcopy(model)
    module = CompletionLogits(model, rows, c["T"])
    names = [n for n, _ in module.named_parameters()]
    theta = {n: p.detach().clone() for n, p in module.named_parameters()}
    unflat = lambda v: {n: t.view_as(theta[n])
                        for n, t in zip(names, v.split([t.numel() for t in theta.values()]))}
    logits_at = lambda params: torch.func.functional_call(module, params, ())
    with torch.no_grad():
        old_logits = module()                                  # (N, V) at theta_old, / T
        ref_logits = torch.cat(rows.logits(ref, c["T"]))
    n_i = [len(x) for x in rows.ids]
    targets = torch.tensor(sum(rows.ids, []))
    old, ref_lp = token_logp(old_logits, targets.tolist()), token_logp(ref_logits, targets.tolist())
    R = rows.rewards - c["beta"] * torch.stack(
        [k.sum() for k in kl_estimate(old, ref_lp, c["kl"]).split(n_i)])
    Rg = R.view(-1, rows.G)
    A = (Rg - (Rg.sum(1, keepdim=True) - Rg) / (rows.G
                                                - 1)).view(-1).repeat_interleave(torch.tensor(n_i))
    N = len(A)
    surrogate = lambda logits: (torch.exp(token_logp(logits, targets.tolist()) - old) * A).sum() / N
    g = flat(torch.func.grad(lambda params: surrogate(logits_at(params)))(theta).values())
    p_old = old_logits.softmax(-1)
    with sdpa_kernel(SDPBackend.MATH):                         # forward-mode AD: the math attention
        _, pullback = torch.func.vjp(logits_at, theta)

        def Fv(v):                                                  # (F + damping) v
            _, u = torch.func.jvp(logits_at, (theta,), (unflat(v),))    # J v, (N, V)
            hessian_u = p_old * u - p_old * (p_old * u).sum(-1, keepdim=True)
            return flat(pullback(hessian_u / N)[0].values()) + c["damping"] * v

        x = conjugate_gradient(Fv, g, c["cg_iters"])
        step = torch.sqrt(2 * c["max_kl"] / (x @ Fv(x))) * x
    theta0 = flat(theta.values())
    for j in range(c["backtracks"] + 1):
        with torch.no_grad():
            trial = unflat(theta0 + 0.5 ** j * step)
            logits = logits_at(trial)
            kl = exact_kl(old_logits, logits).mean().item()
            gain = (surrogate(logits) - A.sum() / N).item()
        if kl <= c["max_kl"] and gain > 0:
            with torch.no_grad():
                for p, t in zip(model.parameters(), trial.values()):
                    p.copy_(t)
            return model, {"kl_step": kl, "backtracks": j, "improvement": gain,
                           "grad_norm": g.norm().item(), "step_norm": 0.5 ** j * step.norm().item(),
                           "expected_improvement": 0.5 ** j * (g @ step).item()}
    raise AssertionError("the line search found no step: choose settings where it does")


TRPO = {"T": 0.7, "beta": 2.0, "kl": "k2", "max_kl": 0.02, "damping": 0.5, "cg_iters": 2,
        "backtracks": 4}
TRPO_FLAGS = ["--steps", "2", "--prompts_per_step", "4", "--group_size", "4",
              "--precedence_share", "1", "--temperature", "0.7", "--beta", "2.0",
              "--kl_estimator", "k2", "--max_kl", "0.02", "--damping", "0.5", "--cg_iters", "2",
              "--backtracks", "4"]
TRPO_LOGGED = ("grad_norm", "step_norm", "expected_improvement", "improvement", "kl_step")


def test_trpo_update(tiny_sft, tmp_path):
    """Two TRPO updates: each step's logged gradient norm, step length, gains and KL, and the
    weights after both. The reference's KL enters the reward at the second step only
    (beta, --kl_estimator); the rest shows at the first. Beta shows only through groups whose
    verifier rewards differ: where they are equal the advantages are beta times the KL terms, and
    the step, scaled to the trust region, does not depend on their scale (hence 4 prompts, not
    2)."""
    result = train("trpo", ["--init", tiny_sft, *TRPO_FLAGS], str(tmp_path))
    rows = [Rows.fixed(r["prompts"], 4) for r in result.of("rollout")]
    gpt = f64(result.model, result.start)
    ref = frozen(gpt)
    logged = [r for r in result.metrics if r["step"] > 0]
    after_1, m1 = trpo_step(gpt, ref, rows[0], TRPO)
    after_2, m2 = trpo_step(after_1, ref, rows[1], TRPO)
    for got, want in zip(logged, (m1, m2)):
        assert got["backtracks"] == want["backtracks"] and got["accepted"] == 1.0
        assert [got[k] for k in TRPO_LOGGED] == pytest.approx([want[k] for k in TRPO_LOGGED],
                                                              rel=1e-4, abs=1e-9)
    check_weights(result, after_2)
    # at the first step
    for k, v in {"T": 1.0, "max_kl": 0.01, "damping": 0.1, "cg_iters": 1}.items():
        wrong = trpo_step(gpt, ref, rows[0], {**TRPO, k: v})[1]
        assert max(abs(logged[0][m] / wrong[m] - 1) for m in TRPO_LOGGED) > FAR, k
    for k, v in {"beta": 0.04, "kl": "k1", "a flipped KL sign": -2.0}.items():       # at the second
        wrong = trpo_step(after_1, ref, rows[1], {**TRPO, "beta" if k.startswith("a") else k: v})[0]
        check_weights(result, after_2, far=[(k, wrong)])


# -----------------------------------------------------------------------------
# DPO (Rafailov et al. eq. 7) and IPO (Azar et al. section 5): the reference log-probs, beta / tau,
# the warm-up

def preference_expected(gpt, batches, c):
    """SGD on DPO's or IPO's loss per batch of pairs against the frozen reference (c["ref_follows"]:
    a wrong one, the policy of the step before standing in for the reference)."""
    ref, model, grads = frozen(gpt), copy.deepcopy(gpt), []

    def seq_logp(m, pair, side):
        prompt, ids = pair_ids(pair, side)
        lp = token_logp(completion_logits(m, prompt, ids), ids)
        return lp.mean() if c["mean"] else lp.sum()
    for step, pairs in enumerate(batches):
        if c.get("ref_follows") and step > 0:
            ref = frozen(model)
        loss = 0.0
        for p in pairs:
            with torch.no_grad():
                ref_c, ref_r = seq_logp(ref, p, "chosen"), seq_logp(ref, p, "rejected")
            h = (seq_logp(model, p, "chosen") - ref_c) - (seq_logp(model, p, "rejected") - ref_r)
            loss = loss + (-F.logsigmoid(c["beta"] * h) if c["loss"] == "dpo"
                           else (h - 1 / (2 * c["beta"])) ** 2)
        g = grad_of(loss / len(pairs), model)
        grads.append(g)
        sgd_step(model, g, c["lr"] * min(1.0, (step + 1) / max(c["warmup"], 1)), c["wd"])
    return model, grads


PREFERENCE_FLAGS = ["--steps", "2", "--batch_size", "4", "--n_pairs", "8", "--lr", "0.5",
                    "--warmup", "3", "--grad_clip", "1e9"]
PREFERENCE_CASES = {   # name: (script, flags, settings, the defaults of the flags under test)
    "dpo": ("dpo", ["--beta", "0.5"], {"loss": "dpo", "beta": 0.5}, {"beta": 0.1, "warmup": 0}),
    "dpo --seq_logp mean --weight_decay": (
        "dpo", ["--beta", "0.5", "--seq_logp", "mean", "--weight_decay", "0.2"],
        {"loss": "dpo", "beta": 0.5, "mean": True, "wd": 0.2}, {"mean": False, "wd": 0.0}),
    "ipo": ("ipo", ["--tau", "0.5"], {"loss": "ipo", "beta": 0.5}, {"beta": 0.1}),
}


@pytest.mark.parametrize("case", list(PREFERENCE_CASES))
def test_dpo_and_ipo_update(case, tiny_sft, tmp_path):
    script, flags, settings, defaults = PREFERENCE_CASES[case]
    c = {"lr": 0.5, "warmup": 3, "mean": False, "wd": 0.0, **settings}
    result = train(script, ["--init", tiny_sft, *PREFERENCE_FLAGS, *flags], str(tmp_path))
    batches = [e["pairs"] for e in result.of("pair_batch")]
    assert [len(b) for b in batches] == [4, 4]
    gpt = f64(result.model, result.start)
    model, grads = preference_expected(gpt, batches, c)
    wrong = [(f"{k} {v}", preference_expected(gpt, batches, {**c, k: v}))
             for k, v in defaults.items()]
    check_grads(result, grads, far=[(k, g) for k, (_, g) in wrong if k != "warmup 0"
                                    and not k.startswith("wd")])
    check_weights(result, model, far=[(k, m) for k, (m, _) in wrong])


def test_online_dpo_update(tiny_sft, tmp_path):
    """Online DPO (Guo et al. 2024): two steps of DPO's loss on the pairs it samples and judges (the
    fixed completions here: best and worst by the verifier), against the frozen reference at both
    steps. The reference taken from the policy after step 1 (a planted bug once survived) is told
    apart, as are beta and the warm-up."""
    flags = ["--steps", "2", "--batch_size", "4", "--group_size", "3", "--precedence_share", "1",
             "--lr", "0.5", "--warmup", "3", "--grad_clip", "1e9", "--beta", "0.5"]
    result = train("online_dpo", ["--init", tiny_sft, *flags], str(tmp_path))
    batches = [e["pairs"] for e in result.of("pair_batch")]
    assert len(batches) == 2 and all(len(b) >= 1 for b in batches)
    c = {"loss": "dpo", "beta": 0.5, "lr": 0.5, "warmup": 3, "mean": False, "wd": 0.0}
    gpt = f64(result.model, result.start)
    model, grads = preference_expected(gpt, batches, c)
    wrong = [(name, preference_expected(gpt, batches, {**c, **w})) for name, w in [
        ("the reference following the policy", {"ref_follows": True}), ("beta 0.1", {"beta": 0.1}),
        ("no warm-up", {"warmup": 0}), ("--seq_logp mean", {"mean": True})]]
    check_grads(result, grads, far=[(k, g) for k, (_, g) in wrong if k != "no warm-up"])
    check_weights(result, model, far=[(k, m) for k, (m, _) in wrong])


def reference_free_expected(gpt, batches, c):
    """SGD on SimPO's (Meng et al. 2024, eq. 6) or ORPO's (Hong et al. 2024, eq. 6) loss per batch
    of pairs, on each side's average token log-prob (c["sum"]: a wrong one, the sum)."""
    model, grads = copy.deepcopy(gpt), []

    def avg_logp(pair, side):
        prompt, ids = pair_ids(pair, side)
        lp = token_logp(completion_logits(model, prompt, ids), ids)
        return lp.sum() if c.get("sum") else lp.mean()
    log_odds = lambda a: a - torch.log(-torch.expm1(a))     # log p / (1 - p), p = exp(a)
    for step, pairs in enumerate(batches):
        loss = 0.0
        for p in pairs:
            a_c, a_r = avg_logp(p, "chosen"), avg_logp(p, "rejected")
            if c["loss"] == "simpo":                        # -log sigmoid(beta (a_w - a_l) - gamma)
                loss = loss - F.logsigmoid(c["beta"] * (a_c - a_r) - c["gamma"])
            else:                                           # NLL of the chosen + lam L_OR
                loss = loss - a_c - c["lam"] * F.logsigmoid(log_odds(a_c) - log_odds(a_r))
        g = grad_of(loss / len(pairs), model)
        grads.append(g)
        sgd_step(model, g, c["lr"] * min(1.0, (step + 1) / max(c["warmup"], 1)))
    return model, grads


REFERENCE_FREE = {   # name: (flags, settings, the defaults of the flags under test, wrong updates)
    "simpo": (["--beta", "3.0", "--gamma", "0.5"], {"loss": "simpo", "beta": 3.0, "gamma": 0.5},
              {"beta": 2.0, "gamma": 1.0}),
    "orpo": (["--lam", "0.5"], {"loss": "orpo", "lam": 0.5}, {"lam": 0.1}),
}


@pytest.mark.parametrize("script", list(REFERENCE_FREE))
def test_simpo_and_orpo_update(script, tiny_sft, tmp_path):
    """Two steps of SimPO's and ORPO's losses on the recorded pairs, no reference; each flag moves
    the update, and so does a loss fed summed log-probs where it wants their average (a planted bug
    once survived)."""
    flags, settings, defaults = REFERENCE_FREE[script]
    c = {"lr": 0.5, "warmup": 3, **settings}
    common = ["--steps", "2", "--batch_size", "4", "--n_pairs", "8", "--lr", "0.5", "--warmup", "3",
              "--grad_clip", "1e9"]
    result = train(script, ["--init", tiny_sft, *common, *flags], str(tmp_path))
    batches = [e["pairs"] for e in result.of("pair_batch")]
    assert [len(b) for b in batches] == [4, 4]
    gpt = f64(result.model, result.start)
    model, grads = reference_free_expected(gpt, batches, c)
    wrong = [(f"{k} {v}", reference_free_expected(gpt, batches, {**c, k: v}))
             for k, v in defaults.items()]
    wrong.append(("summed log-probs", reference_free_expected(gpt, batches, {**c, "sum": True})))
    check_grads(result, grads, far=[(k, g) for k, (_, g) in wrong])
    check_weights(result, model, far=[(k, m) for k, (m, _) in wrong])


def kto_expected(gpt, batches, c):
    """SGD on KTO's loss (Ethayarajh et al. 2024, eq. 8) per batch of (prompt, completion ids)
    examples: the mean of lambda_y - v(x, y), r = log pi(y|x) - log pi_ref(y|x), z0 = max(0, the
    mean r of the batch's mismatched pairs (prompt k, completion k+1), no gradient), desirable = the
    verifier's right answer."""
    ref, model, grads, estimates = frozen(gpt), copy.deepcopy(gpt), [], []

    def seq_logp(m, prompt, ids):                                 # ids as sampled, the EOS included
        lp = token_logp(completion_logits(m, TOK.encode(prompt), ids), ids)
        return lp.mean() if c["mean"] else lp.sum()
    for step, (prompts, completions) in enumerate(batches):
        n = len(prompts)
        with torch.no_grad():
            mismatched = [(prompts[k], completions[(k + 1) % n]) for k in range(n)]
            estimates.append(sum(seq_logp(model, *x) - seq_logp(ref, *x)
                                 for x in mismatched).item() / n)
            z0 = max(0.0, estimates[-1])
        loss = 0.0
        for prompt, ids in zip(prompts, completions):
            with torch.no_grad():
                ref_lp = seq_logp(ref, prompt, ids)
            r = seq_logp(model, prompt, ids) - ref_lp
            if task.reward(prompt, plain(ids)) == 1.0:                   # desirable
                loss = loss + c["lambda_d"] - c["lambda_d"] * torch.sigmoid(c["beta"] * (r - z0))
            else:
                loss = loss + c["lambda_u"] - c["lambda_u"] * torch.sigmoid(c["beta"] * (z0 - r))
        g = grad_of(loss / n, model)
        grads.append(g)
        sgd_step(model, g, c["lr"] * min(1.0, (step + 1) / max(c["warmup"], 1)))
    return model, grads, estimates


def test_kto_update(tiny_sft, tmp_path):
    """Two steps of KTO on the recorded examples (the fixed completions: right and wrong ones), the
    KL estimate behind z0 from the mismatched pairs at each step (prompt k, completion k+1; 0 at the
    first, where the policy is the reference, and the logged one at the second: negative here, so z0
    = max(0, it) = 0); beta and lambda_U move the update. Seed 4 puts both kinds of example in the
    first batch (the examples and their order come from Python's random alone): there r = 0, so
    lambda_U's weight shows whatever the starting policy (an undesirable example seen only later can
    sit where its sigmoid is flat)."""
    flags = ["--steps", "2", "--batch_size", "4", "--n_examples", "8", "--lr", "0.5",
             "--warmup", "3", "--grad_clip", "1e9", "--beta", "0.5", "--lambda_u", "1.5",
             "--seed", "4"]
    result = train("kto", ["--init", tiny_sft, *flags], str(tmp_path))
    batches = [(e["prompts"], e["completions"]) for e in result.of("completion_batch")]
    assert ([len(b[0]) for b in batches] == [4, 4]
            and all(y[-1] == EOS for b in batches for y in b[1]))  # ended
    labels = [[task.reward(p, plain(y)) == 1.0 for p, y in zip(*b)] for b in batches]
    assert any(labels[0]) and not all(labels[0])                   # both kinds of example at step 1
    c = {"lr": 0.5, "warmup": 3, "beta": 0.5, "lambda_d": 1.0, "lambda_u": 1.5, "mean": False}
    gpt = f64(result.model, result.start)
    model, grads, estimates = kto_expected(gpt, batches, c)
    logged = [m["kl_estimate"] for m in result.metrics if "kl_estimate" in m]
    assert (estimates[0] == 0 and logged[-1] == pytest.approx(estimates[1], rel=1e-4)
            and abs(estimates[1]) > 1e-2)
    wrong = [(name, kto_expected(gpt, batches, {**c, **w})[:2])
             for name, w in [("beta 0.1", {"beta": 0.1}), ("lambda_U 1.0", {"lambda_u": 1.0}),
                             ("--seq_logp mean", {"mean": True})]]
    check_grads(result, grads, far=[(k, g) for k, (_, g) in wrong])
    check_weights(result, model, far=[(k, m) for k, (m, _) in wrong])


def distill_expected(student, teacher, rollouts, c):
    """SGD on on-policy distillation's loss (Agarwal et al. 2024; Thinking Machines' recipe) per
    batch of the student's samples: the mean over completion tokens of the exact KL(student ||
    teacher) over the vocabulary at temperature T, minus w (r_i - mean r) log p_student(y_t) (the
    optional verifier term). c["forward"]: a wrong one, KL(teacher || student)."""
    model, teacher, grads = copy.deepcopy(student), frozen(teacher), []
    for rows in rollouts:
        s_logits, t_logits = rows.logits(model, c["T"]), rows.logits(teacher, c["T"])
        n = sum(len(ids) for ids in rows.ids)
        adv = rows.rewards - rows.rewards.mean()                        # r_i - mean_j r_j
        loss = 0.0
        for i, (s, t, ids) in enumerate(zip(s_logits, t_logits, rows.ids)):
            loss = loss + (exact_kl(t, s) if c.get("forward") else exact_kl(s, t)).sum()
            loss = loss - c["w"] * adv[i] * token_logp(s, ids).sum()
        g = grad_of(loss / n, model)
        grads.append(g)
        sgd_step(model, g, SGD_LR)
    return model, grads


def test_distill_update(tiny_sft, tmp_path):
    """Two steps of on-policy distillation on the student's (fixed) samples, a teacher whose weights
    differ from the student's everywhere: the exact reverse KL per token, the verifier term, the
    temperature on both sides; the forward KL, no verifier term, T = 1 and the student as its own
    teacher are told apart."""
    model, ckpt = load_checkpoint(tiny_sft)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    teacher_path = str(tmp_path / "teacher.pt")
    save_checkpoint(teacher_path, model, ckpt["tokenizer"])
    flags = ["--steps", "2", "--prompts_per_step", "4", "--group_size", "2",
             "--precedence_share", "1", "--temperature", "0.7", "--reward_weight", "0.5",
             "--grad_clip", "1e9", "--teacher", teacher_path]
    result = train("distill", ["--init", tiny_sft, *flags], str(tmp_path / "run"))
    # (not the log's)
    rollouts = [Rows.fixed(e["prompts"], 2) for e in result.of("rollout") if e["group_size"] == 2]
    assert len(rollouts) == 2
    c = {"T": 0.7, "w": 0.5}
    student, teacher = f64(result.model, result.start), f64(load_checkpoint(teacher_path)[0])
    expected, grads = distill_expected(student, teacher, rollouts, c)
    wrong = [(name, distill_expected(s, teacher if t is None else t, rollouts, {**c, **w}))
             for name, w, s, t in [("the forward KL", {"forward": True}, student, None),
                                   ("no verifier term", {"w": 0.0}, student, None),
                                   ("T = 1", {"T": 1.0}, student, None),
                                   ("the student as its teacher", {}, student, student)]]
    check_grads(result, grads, far=[(k, g) for k, (_, g) in wrong])
    check_weights(result, expected, far=[(k, m) for k, (m, _) in wrong])


def self_distill_expected(policy, rollouts, c):
    """SGD on self-distillation's loss (SDFT, OPSD) per batch of the policy's samples: the mean over
    completion tokens of the exact KL(student || teacher) at temperature T, the student reading the
    prompt x, the teacher the same weights (frozen at the step's start, no gradient) reading
    '(answer: a) ' + x, a the verified answer. c: the planted mistakes ("student": the answer in
    the student's prompt too; "teacher": not in the teacher's; "forward"; "grad": the teacher's
    logits given gradient)."""
    model, grads = copy.deepcopy(policy), []
    hint = lambda p: TOK.encode(f"(answer: {arithmetic.answer(p)}) {p}")
    for rows in rollouts:
        teacher = model if c.get("grad") else frozen(model)
        loss, n = 0.0, sum(len(ids) for ids in rows.ids)
        for p, x, ids in zip(rows.prompts, rows.prompt_ids, rows.ids):
            s = completion_logits(model, hint(p) if c.get("student") else x, ids, c["T"])
            t = completion_logits(teacher, x if c.get("teacher") else hint(p), ids, c["T"])
            loss = loss + (exact_kl(t, s) if c.get("forward") else exact_kl(s, t)).sum()
        g = grad_of(loss / n, model)
        grads.append(g)
        sgd_step(model, g, SGD_LR)
    return model, grads


def test_self_distill_update(tiny_sft, tmp_path):
    """Two steps of self-distillation on the policy's (fixed) samples: the reverse KL to itself with
    the verified answer ahead of the prompt, at the temperature; the answer leaking into the
    student's prompt, missing from the teacher's, the forward KL, T = 1 and a teacher given
    gradient are told apart."""
    flags = ["--steps", "2", "--prompts_per_step", "4", "--group_size", "2",
             "--precedence_share", "0.5", "--temperature", "0.7", "--grad_clip", "1e9"]
    result = train("self_distill", ["--init", tiny_sft, *flags], str(tmp_path / "run"))
    rollouts = [Rows.fixed(e["prompts"], 2) for e in result.of("rollout") if e["group_size"] == 2]
    assert len(rollouts) == 2
    c = {"T": 0.7}
    policy = f64(result.model, result.start)
    expected, grads = self_distill_expected(policy, rollouts, c)
    wrong = [(name, self_distill_expected(policy, rollouts, {**c, **w}))
             for name, w in [("the answer in the student's prompt", {"student": True}),
                             ("no answer in the teacher's prompt", {"teacher": True}),
                             ("the forward KL", {"forward": True}), ("T = 1", {"T": 1.0}),
                             ("a teacher with gradient", {"grad": True})]]
    check_grads(result, grads, far=[(k, g) for k, (_, g) in wrong])
    check_weights(result, expected, far=[(k, m) for k, (m, _) in wrong])


# -----------------------------------------------------------------------------
# The agent: GRPO on episodes, the environment's tokens context only, each attempt on its own reward
# (SCoRe's shaping)

class Episode:
    """One of the worker's planned episodes (ddp_worker.fixed_episode) played out by the
    environment's rules, rebuilt here from its parts: the ids after the prompt, which of them the
    policy wrote, each one's attempt, and each attempt's text, calls and whether the episode reached
    it. The rules: the policy's tokens and a tool's reply count against the attempt's budget, its
    EOS and the revision prompt (the second attempt's start) do not; the episode ends as soon as an
    attempt has used its budget."""

    def __init__(self, prompt, j, turns, budget):
        self.prompt, self.prompt_ids = prompt, TOK.encode(prompt)
        self.ids, self.policy, self.turn = [], [], []
        self.texts, self.calls, self.reached = ([""] * turns, [0] * turns,
                                                [True] + [False] * (turns - 1))
        k, used = 0, 0
        for text, who in fixed_episode(prompt, j, turns):
            if text == toolcalc.revision(prompt):
                k, used = k + 1, 0
                self.reached[k] = True
            if who == "policy" and text is not None:
                self.calls[k] += text.count("<")
            for t in [EOS] if text is None else TOK.encode(text):
                self.ids.append(t)
                self.policy.append(who == "policy")
                self.turn.append(k)
                if text is not None and text != toolcalc.revision(prompt):
                    self.texts[k] += TOK.decode([t])
                    used += 1
                    if used == budget:
                        return                                 # truncated: no EOS, no later attempt


def agent_expected(gpt, batches, c):
    """mu SGD passes per batch of episodes on agent.py's loss, c the settings: r_k = right_k - c
    calls_k, + alpha (right_2 - right_1) on the second; A per attempt over the group's episodes that
    reached it, r - the group's mean divided by the step's std of r_k over those episodes
    (c["scale"] "batch"), the group's own ("group") or 1 ("none"); in SCoRe's stage I (the first
    c["stage1"] steps) attempt 1 has no reward and KL weight c["beta2"], attempt 2 no bonus; then
    1/B sum_i 1/|o_i| sum_(t in o_i) [-min(rho A, clip(rho) A) + beta_t k3], o_i the policy's
    tokens. Planted mistakes: c["stage1_r1"] attempt 1 keeps its reward in stage I; c["env"] the
    environment's tokens in o_i; c["eos_env"] attempt 1's EOS taken for the environment's;
    c["one_reward"] the last attempt's A on every token; c["all_groups"] attempt 2's group over
    every episode; c["norm_all"] 1/|o_i| over every token of the episode."""
    ref, model, grads = frozen(gpt), copy.deepcopy(gpt), []
    for step, eps in enumerate(batches):
        B, K, G = len(eps), c["turns"], c["G"]
        stage1 = step < c.get("stage1", 0)
        right = torch.tensor([[float(task.reward(e.prompt, t) == 1.0) for t in e.texts]
                              for e in eps], dtype=torch.float64)                           # (B, K)
        r = right - c["cost"] * torch.tensor([e.calls for e in eps], dtype=torch.float64)   # (B, K)
        if K == 2 and not stage1:
            r[:, 1] += c["alpha"] * (right[:, 1] - right[:, 0])
        if stage1 and not c.get("stage1_r1"):
            r[:, 0] = 0.0
        A = torch.zeros(B, K, dtype=torch.float64)
        pop_std = lambda x: torch.sqrt(((x - x.mean()) ** 2).mean())
        for k in range(K):
            everyone = r[[i for i in range(B) if eps[i].reached[k] or c.get("all_groups")], k]
            for g in range(B // G):
                rows = [i for i in range(g * G, (g + 1) * G) if eps[i].reached[k]
                        or c.get("all_groups")]
                x = r[rows, k]
                if len(rows) and not (x == x[0]).all():
                    s = {"group": pop_std(x), "batch": pop_std(everyone), "none": 1.0}[c["scale"]]
                    A[rows, k] = (x - x.mean()) / (s + 1e-6)
        masks = []
        for e in eps:
            m = torch.tensor([1.0 if p or c.get("env") else 0.0 for p in e.policy],
                             dtype=torch.float64)
            if c.get("eos_env") and K == 2 and e.reached[1]:
                m[e.ids.index(EOS)] = 0.0                               # the first attempt's EOS
            if c.get("stop_env"):
                m[e.stops] = 0.0                                        # a call turn's stop id
            masks.append(m)
        adv = [A[i, [K - 1 if c.get("one_reward") else k for k in e.turn]]
               for i, e in enumerate(eps)]
        betas = [torch.tensor([c["beta2"] if stage1 and k == 0 else c["beta"] for k in e.turn],
                              dtype=torch.float64) for e in eps]
        logps = lambda m: [token_logp(completion_logits(m, e.prompt_ids, e.ids, c["T"]), e.ids)
                           for e in eps]
        with torch.no_grad():
            old, ref_lp = logps(model), logps(ref)
        for _ in range(c["mu"]):
            total = 0.0
            for i, lp in enumerate(logps(model)):
                ratio = torch.exp(lp - old[i])
                decided(ratio, 1 - c["clip"], 1 + c["clip"], where=(adv[i] != 0) & (masks[i] > 0))
                pg = -torch.min(ratio * adv[i], ratio.clamp(1 - c["clip"], 1 + c["clip"]) * adv[i])
                per_token = (pg + betas[i] * kl_estimate(lp, ref_lp[i], "k3")) * masks[i]
                total = (total + per_token.sum()
                         / (len(lp) if c.get("norm_all") else masks[i].sum()) / B)
            g = grad_of(total, model)
            grads.append(g)
            sgd_step(model, g, SGD_LR)
    return model, grads


AGENT = {"T": 0.7, "beta": 0.3, "clip": 0.15, "cost": 0.3, "alpha": 0.5, "mu": 2, "G": 4,
         "turns": 1, "scale": "batch", "beta2": 1.0}
AGENT_BUDGET = 34              # the longest planned attempt is 30 tokens; the run-on's 40 are cut
AGENT_FLAGS = ["--steps", "2", "--mu", "2", "--prompts_per_step", "4", "--group_size", "4",
               "--precedence_share", "0.5", "--temperature", "0.7", "--beta", "0.3",
               "--clip_eps", "0.15", "--call_cost", "0.3", "--shaping", "0.5",
               "--max_new_tokens", str(AGENT_BUDGET), "--grad_clip", "1e9"]
# name: (flags, settings, the defaults of the flags under test and the planted mistakes)
AGENT_CASES = {
    "one attempt": ([], {}, [{"T": 1.0}, {"beta": 0.04}, {"clip": 0.2}, {"cost": 0.1},
                             {"env": True}, {"norm_all": True}, {"beta": -0.3},
                             {"scale": "group"}, {"scale": "none"}]),
    "--scale_rewards group": (["--scale_rewards", "group"], {"scale": "group"},
                              [{"scale": "batch"}]),
    "--scale_rewards none": (["--scale_rewards", "none"], {"scale": "none"}, [{"scale": "batch"}]),
    "--turns 2": (["--turns", "2"], {"turns": 2},
                  [{"alpha": 1.0}, {"eos_env": True}, {"one_reward": True}, {"all_groups": True},
                   {"env": True}]),
    "--turns 2 --train_on_env_tokens": (["--turns", "2", "--train_on_env_tokens"],
                                        {"turns": 2, "env": True}, [{"env": False}]),
    "--turns 2 --stage1_steps 1 (SCoRe I, then II)": (
        ["--turns", "2", "--stage1_steps", "1", "--stage1_beta", "2.5"],
        {"turns": 2, "stage1": 1, "beta2": 2.5},
        [{"stage1": 0}, {"stage1": 2}, {"beta2": 0.3}, {"beta2": 1.0}, {"stage1_r1": True}]),
}


@pytest.mark.parametrize("case", list(AGENT_CASES))
def test_agent_update(case, tmp_path):
    """Two steps of two passes on planned episodes from random weights (a tool call answered, a
    wrong answer in the head, a call the calculator refuses, a run-on cut by the budget; with
    --turns 2 a second attempt after the revision prompt, or none): the masks, attempts, rewards and
    advantages rebuilt from the plans by the environment's rules, the loss from the docstring's
    equation. Each flag at its default and each planted mistake is told apart."""
    flags, settings, wrong = AGENT_CASES[case]
    c = {**AGENT, **settings}
    task.use(task_args("toolcalc"))
    torch.manual_seed(0)
    init = str(tmp_path / "init.pt")
    save_checkpoint(init, GPT(GPTConfig(vocab_size=TOK.vocab_size, block_size=96, n_layer=2,
                                        n_head=2, n_embd=32)), TOK.name)
    result = train("agent", ["--init", init, *AGENT_FLAGS, *flags], str(tmp_path / "run"))
    batches = [[Episode(p, j, c["turns"], AGENT_BUDGET) for p in e["prompts"]
                for j in range(e["group_size"])] for e in result.of("episodes")]
    assert (len(batches) == 2
            and {toolcalc.is_hard(e.prompt) for b in batches for e in b} == {True, False})
    assert (any(not all(e.policy) for e in batches[0])
            and any(e.ids[-1] != EOS for e in batches[0]))  # replies, cuts
    gpt = f64(result.model, result.start)
    with margins():
        model, grads = agent_expected(gpt, batches, c)
    far = [(str(w), agent_expected(gpt, batches, {**c, **w})) for w in wrong]
    check_grads(result, grads, far=[(k, g) for k, (_, g) in far])
    check_weights(result, model, far=[(k, m) for k, (m, _) in far])



class ChatEpisode:
    """A planned episode in the chat protocol (ddp_worker.fixed_chat_episode) played out by its
    rules, rebuilt from its pieces: the policy's turns and the environment's tool messages; every
    token counts against the budget but the stop id that ends the episode; the answer is the last
    turn's text; a call is a turn answered by a tool message."""

    def __init__(self, protocol, prompt, j, budget):
        self.prompt, self.prompt_ids = prompt, protocol.prompt(prompt)
        self.ids, self.policy, self.turn, self.reached, self.calls = [], [], [], [True], [0]
        self.stops, stop = [], protocol.tok.eos_id
        pieces, used, turn = fixed_chat_episode(protocol, prompt, j), 0, []
        for k, (ids, who) in enumerate(pieces):
            # a turn the environment answers
            self.calls[0] += who == "policy" and k + 1 < len(pieces)
            turn = ids if who == "policy" else turn
            for t in ids:
                if t == stop and k + 1 < len(pieces):
                    self.stops.append(len(self.ids))                # a stop id ending a call's turn
                self.ids.append(t)
                self.policy.append(who == "policy")
                self.turn.append(0)
                used += not (t == stop and k + 1 == len(pieces))
                if used == budget:
                    turn = turn[:turn.index(t) + 1] if who == "policy" else []
                    self.texts = [protocol.tok.decode(turn)]
                    return
        self.texts = [protocol.tok.decode([t for t in turn if t != stop])]


CHAT_BUDGET = 100    # a call, its reply and the answer: at most 93 tokens; the run-on's 120 are cut
CHAT_WRONG = [{"env": True}, {"stop_env": True}, {"cost": 0.1}, {"norm_all": True}, {"beta": 0.04}]


def test_agent_update_in_the_chat_protocol(tmp_path):
    """agent.py --chat --tools calculator on planned episodes in the toy's chat template
    (bytes-chat): the policy's turns as the template writes them (a JSON call in <tool_call> tags,
    its end of turn), the tool's reply as the template's tool message and the next turn's opening, a
    call the calculator refuses, a run-on cut by the budget. Planted: the tool messages in the loss,
    a call turn's stop id taken for the environment's, the call cost, the 1/|o_i| over every token,
    the KL weight; each told apart."""
    c = dict(AGENT)
    args = task_args("toolcalc", chat=True, tools="calculator")
    task.use(args)
    tok = Tokenizer("bytes-chat").use_chat("2026-01-01")
    protocol = task.chat_tools(tok)
    torch.manual_seed(2)
    init = str(tmp_path / "init.pt")
    save_checkpoint(init, GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=176, n_layer=2,
                                        n_head=2, n_embd=32, pos="rope")), tok.name,
                    chat_date="2026-01-01")
    result = train("agent", ["--init", init, *AGENT_FLAGS, "--max_new_tokens", str(CHAT_BUDGET),
                             "--chat", "--tools", "calculator"], str(tmp_path / "run"))
    batches = [[ChatEpisode(protocol, p, j, CHAT_BUDGET) for p in e["prompts"]
                for j in range(e["group_size"])] for e in result.of("episodes")]
    assert (len(batches) == 2 and any(e.stops for e in batches[0])
            and any(len(e.ids) == CHAT_BUDGET for e in batches[0]))
    gpt = f64(result.model, result.start)
    with margins():
        model, grads = agent_expected(gpt, batches, c)
    far = [(str(w), agent_expected(gpt, batches, {**c, **w})) for w in CHAT_WRONG]
    check_grads(result, grads, far=[(k, g) for k, (_, g) in far])
    check_weights(result, model, far=[(k, m) for k, (m, _) in far])



# -----------------------------------------------------------------------------
# Asynchronous GRPO: one pass per batch of groups an actor sampled with older weights, each token
# weighted by pi / mu

def async_rows(batch):
    """The learner's groups as the test reads them: (prompt ids, completion ids up to and with the
    first EOS, or the whole row of a completion that never ended, its text, the verifier's reward)
    per row."""
    rows = []
    for prompt_ids, row in zip(batch["prompts"], batch["tokens"]):
        ids = row[:row.index(EOS) + 1] if EOS in row else row
        prompt, text = TOK.decode(prompt_ids), TOK.decode([t for t in ids if t != EOS])
        rows.append((prompt_ids, ids, task.reward(prompt, text)))
    return rows


def async_expected(gpt, batches, c):
    """One SGD step per learner batch on 1/B sum_i 1/|o_i| sum_t sg(w_it) [-A_i rho'_it + beta
    k3_it], rho' = pi / sg(pi), w from rho = pi_theta / mu (mu: the actor's recorded log-probs): 1,
    min(rho, C) or 1[1/C <= rho <= C]; a masked token still counts in |o_i|. Planted mistakes:
    c["w_grad"] w not detached; c["kept"] 1/|o_i| over the kept tokens only. Returns (model,
    gradients, every step's rho)."""
    model, ref, grads, rhos = copy.deepcopy(gpt), frozen(gpt), [], []
    for batch in batches:
        rows = async_rows(batch)
        A = group_advantages(torch.tensor([r for _, _, r in rows], dtype=torch.float64), c["G"])
        total, rho_step = 0.0, []
        for i, (p, ids, _) in enumerate(rows):
            lp = token_logp(completion_logits(model, p, ids, c["T"]), ids)
            with torch.no_grad():
                ref_lp = token_logp(completion_logits(ref, p, ids, c["T"]), ids)
            rho = torch.exp((lp if c.get("w_grad") else lp.detach())
                            - batch["logp"][i, :len(ids)].double())
            rho_step.append(rho.detach())
            if c["mode"] == "mask":                       # min(rho, C) is continuous; 1[...] is not
                decided(rho, 1 / c["cap"], c["cap"])
            w = {"none": torch.ones_like(rho), "truncate": rho.clamp(max=c["cap"]),
                 "mask": ((rho >= 1 / c["cap"]) & (rho <= c["cap"])).double()}[c["mode"]]
            per_token = w * (-A[i] * torch.exp(lp - lp.detach())
                             + c["beta"] * kl_estimate(lp, ref_lp, "k3"))
            n = (w > 0).sum() if c.get("kept") else len(ids)
            total = total + per_token.sum() / n / len(rows)
        g = grad_of(total, model)
        grads.append(g)
        rhos.append(rho_step)
        sgd_step(model, g, c["lr"])
    return model, grads, rhos


ASYNC = {"T": 0.7, "beta": 0.3, "cap": 1.05, "lr": 0.1, "G": 4}
ASYNC_FLAGS = ["--steps", "2", "--prompts_per_step", "4", "--group_size", "4",
               "--precedence_share", "1", "--temperature", "0.7", "--beta", "0.3",
               "--is_cap", "1.05", "--max_lag", "1", "--sync_every", "2", "--actors", "1",
               "--threads", "1", "--grad_clip", "1e9", "--eval_every", "2"]


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_async_grpo_update(mode, tiny_sft, tmp_path):
    """Two learner steps of async_grpo.py (one actor, --max_lag 1, --sync_every 2: both steps'
    groups drawn with the starting weights, the second trained one version later; the actor sends
    the fixed completions with its policy's log-probs of them): the completions read from the token
    rows, the rewards from their text, the importance weights from the actor's own log-probs
    (checked against the starting weights'), the loss from the docstring's equation. No correction,
    T = 1, beta 0.04, a flipped KL sign and w with a gradient (truncate; an indicator has none) or
    1/|o_i| over the kept tokens (mask) are told apart."""
    c = {**ASYNC, "mode": mode}
    result = train("async_grpo", ["--init", tiny_sft, *ASYNC_FLAGS, "--is_correction", mode],
                   str(tmp_path), lr=c["lr"])
    batches = result.of("async_batch")
    # lags 0, then 1
    assert len(batches) == 2 and all(v == 0 for b in batches for v in b["version"])
    gpt = f64(result.model, result.start)
    for batch in batches:                      # mu: the actor's log-probs are the starting weights'
        assert [r for _, _, r in async_rows(batch)] == batch["rewards"]
        for i, (p, ids, _) in enumerate(async_rows(batch)):
            with torch.no_grad():
                err = (batch["logp"][i, :len(ids)].double()
                       - token_logp(completion_logits(gpt, p, ids, c["T"]), ids))
            assert err.abs().max() < 1e-4, (
                f"row {i}: the actor's log-probs off by {err.abs().max():.2e}")
    with margins():
        model, grads, rhos = async_expected(gpt, batches, c)
    rho = torch.cat(rhos[1])                             # the second step's: pi after one step / mu
    # the correction acts on both sides
    assert (rho > c["cap"]).any() and (rho < 1 / c["cap"]).any()
    wrong = [("no correction", {"mode": "none"}), ("T = 1", {"T": 1.0}),
             ("beta 0.04", {"beta": 0.04}), ("a flipped KL sign", {"beta": -c["beta"]})]
    wrong += [("1/|o_i| over the kept tokens",
               {"kept": True})] if mode == "mask" else [("w with a gradient", {"w_grad": True})]
    far = [(name, async_expected(gpt, batches, {**c, **w})) for name, w in wrong]
    check_grads(result, grads, far=[(k, g) for k, (_, g, _) in far])
    check_weights(result, model, far=[(k, m) for k, (m, _, _) in far])


# -----------------------------------------------------------------------------
# SFT and expert iteration: the mean negative log-likelihood of the completion tokens and the EOS

def nll_expected(gpt, batches, lrs, wd, max_norm=None, shift=0):
    """SGD on -1/sum|y| sum_(x, y) sum_t log pi(y_t | x, y_<t) over each batch of
    (prompt, completion) pairs, the EOS a target: a text completion (a demonstration) gets it
    appended, ids are as sampled (their EOS last); lrs: each step's learning rate; max_norm:
    gradient clipping. shift: the targets moved (a wrong mask)."""
    model, grads = copy.deepcopy(gpt), []
    for batch, lr in zip(batches, lrs):
        total, n = 0.0, 0
        for prompt, completion in batch:
            p = TOK.encode(prompt)
            ids = TOK.encode(completion) + [EOS] if isinstance(completion,
                                                               str) else list(completion)
            seq = p + ids
            lp = token_logp(logits_of(model, seq)[:-1], seq[1:])[len(p) - 1 - shift:]
            total, n = total - lp.sum(), n + len(lp)
        g = grad_of(total / n, model)
        if max_norm is not None:
            g = clip(g, max_norm)
        grads.append(g)
        sgd_step(model, g, lr, wd)
    return model, grads


def test_sft_update(tmp_path):
    """Four steps from random weights: the warm-up (2 steps), the cosine, AdamW's weight decay
    (SGD's here), and the gradient clipped to --grad_clip."""
    result = train("sft", ["--steps", "4", "--batch_size", "4", "--n_layer", "1", "--n_head", "2",
                           "--n_embd", "32", "--lr", "0.5", "--warmup", "2",
                           "--weight_decay", "0.1", "--grad_clip", "0.5"], str(tmp_path))
    batches = [list(zip(e["prompts"], e["completions"])) for e in result.of("completion_batch")]
    assert [len(b) for b in batches] == [4, 4, 4, 4]
    assert [s["lr"][0] for s in result.steps] == pytest.approx([lr_schedule(s, 0.5, 2, 4)
                                                                for s in range(4)])
    gpt = f64(result.model, result.start)
    lrs = [lr_schedule(s, 0.5, 2, 4) for s in range(4)]
    model, grads = nll_expected(gpt, batches, lrs, 0.1, 0.5)
    unclipped = nll_expected(gpt, batches, lrs, 0.1)[1][0]
    assert torch.sqrt(sum((g ** 2).sum() for g in unclipped)) > 1.0           # the clip acts
    check_grads(result, grads, far=[("--grad_clip", [unclipped]),
                                    ("the targets one token early",
                                     nll_expected(gpt, batches, lrs, 0.1, 0.5, 1)[1]),
                                    ("a flipped sign", [[-g for g in x] for x in grads])])
    check_weights(result, model, far=[
        ("--weight_decay 0", nll_expected(gpt, batches, lrs, 0.0, 0.5)[0]),
        ("a constant lr", nll_expected(gpt, batches, [0.5] * 4, 0.1, 0.5)[0])])


def test_sft_hint_share_update(tmp_path):
    """--hint_share 0.5 (self_distill.py's start): about half the demonstrations have the verified
    answer ahead of the prompt ('(answer: 11) 3+4*2='), and those are the right completion, never
    the slip; the update is the NLL of what was fed."""
    result = train("sft", ["--steps", "2", "--batch_size", "16", "--n_layer", "1", "--n_head", "2",
                           "--n_embd", "32", "--lr", "0.5", "--warmup", "0", "--weight_decay", "0",
                           "--hint_share", "0.5", "--mistake_rate", "1", "--precedence_share",
                           "1", "--grad_clip", "1e9"], str(tmp_path))
    batches = [list(zip(e["prompts"], e["completions"])) for e in result.of("completion_batch")]
    hinted = 0
    for prompt, completion in (pc for b in batches for pc in b):
        x = prompt.split(") ", 1)[-1]
        if prompt != x:
            hinted += 1
            assert prompt == f"(answer: {arithmetic.answer(x)}) {x}"
            assert completion == arithmetic.demonstration(x)                  # right
        else:
            assert completion == arithmetic.demonstration(x, left_to_right=True)   # the slip
    assert 8 <= hinted <= 24
    lrs = [lr_schedule(s, 0.5, 0, 2) for s in range(2)]
    model, grads = nll_expected(f64(result.model, result.start), batches, lrs, 0.0)
    check_grads(result, grads)
    check_weights(result, model)


def expert_iteration_data(rounds, N, scorer=None, max_per_prompt=4):
    """What a round keeps: per prompt, the distinct completions with reward 1 (scorer None; highest
    first, ties in the order sampled), or the scorer's highest (threshold none), at most
    max_per_prompt."""
    data = []
    for r in rounds:
        for p in r["prompts"]:
            texts = [fixed_completion(p, j) for j in range(N)]
            scores = [task.reward(p, t) if scorer is None else scorer(p, t) for t in texts]
            kept = []
            for j in sorted(range(N), key=lambda j: -scores[j]):
                if len(kept) == max_per_prompt or (scorer is None and scores[j] < 1.0):
                    break
                if texts[j] not in kept:
                    kept.append(texts[j])
            data += [(p, t) for t in kept]
    return data


EI_FLAGS = ["--rounds", "1", "--prompts_per_round", "6", "--samples_per_prompt", "4",
            "--batch_size", "4", "--epochs", "2", "--weight_decay", "0.05", "--grad_clip", "1e9"]


@pytest.mark.parametrize("select", ["verifier", "rm"])
def test_expert_iteration_update(select, reward_model_run, tmp_path):
    rm_path = os.path.join(reward_model_run.out, "rm.pt")
    init = reward_model_run.ckpt["args"]["init"]
    result = train("expert_iteration", ["--init", init, "--rm", rm_path, "--select", select,
                                        *EI_FLAGS], str(tmp_path))
    rounds = [e for e in result.of("complete") if len(e["prompts"]) == 6]  # not the evaluation's
    rm = f64(load_checkpoint(rm_path)[0])
    with torch.no_grad():
        rm_score = lambda p, t: scores_of(rm, TOK.encode(p) + TOK.encode(t) + [EOS])[-1].item()
        data = expert_iteration_data(rounds, 4, rm_score if select == "rm" else None,
                                     1 if select == "rm" else 4)
        other = expert_iteration_data(rounds, 4, None if select == "rm" else rm_score,
                                      4 if select == "rm" else 1)
    assert sorted(data) != sorted(other)                       # the rule decides what is kept
    batches = [list(zip(e["prompts"], e["completions"])) for e in result.of("completion_batch")]
    assert len(batches) == math.ceil(2 * len(data) / 4)        # --epochs 2 over the kept data
    assert all(c[-1] == EOS for b in batches for _, c in b)    # as sampled: each ended with its EOS
    items = [(p, plain(c)) for b in batches for p, c in b]     # two shuffled passes over the data
    assert (sorted(items[:len(data)]) == sorted(data)
            and sorted(items[len(data):2 * len(data)]) == sorted(data))
    gpt = f64(result.model, result.start)
    model, grads = nll_expected(gpt, batches, [SGD_LR] * len(batches), 0.05)
    check_grads(result, grads, far=[("a flipped sign", [[-g for g in x] for x in grads])])
    check_weights(result, model, far=[("--weight_decay 0",
                                       nll_expected(gpt, batches, [SGD_LR] * len(batches), 0)[0])])


# -----------------------------------------------------------------------------
# ORM and PRM: binary cross-entropy of the scores read at each step's end (the ORM: the EOS) against
# the labels

def verifier_expected(scalar, batches, kind, c):
    model, grads = copy.deepcopy(scalar), []
    for step, batch in enumerate(batches):
        total, n = 0.0, 0
        for prompt, ids in batch:                                   # ids as sampled, their EOS last
            p, text = TOK.encode(prompt), plain(ids)
            seq = p + list(ids)
            if kind == "orm":
                reads, labels = [len(seq) - 1], [task.reward(prompt, text)]
            else:                                                   # each ',' and the EOS
                reads = [len(p) + j
                         for j, t in enumerate(ids) if TOK.decode([t]) == ","] + [len(seq) - 1]
                assert ids[-1] == EOS
                labels = arithmetic.step_labels(prompt, text)
            assert len(reads) == len(labels)
            r = scores_of(model, seq)[torch.tensor(reads) - c["early"]]
            y = torch.tensor(labels, dtype=torch.float64)
            total = total - (y * F.logsigmoid(r) + (1 - y) * F.logsigmoid(-r)).sum()
            n += len(reads)
        g = grad_of(total / n, model)
        grads.append(g)
        sgd_step(model, g, lr_schedule(step, 0.3, 1, len(batches)))
    return model, grads


@pytest.mark.parametrize("kind", ["orm", "prm"])
def test_orm_and_prm_update(kind, tiny_sft, tmp_path):
    result = train("orm" if kind == "orm" else "prm",
                   ["--init", tiny_sft, "--n_prompts", "8", "--samples_per_prompt", "2",
                    "--batch_size", "8", "--epochs", "1", "--lr", "0.3", "--warmup", "1",
                    "--grad_clip", "1e9"] + (["--train", "prm"] if kind == "prm" else []),
                   str(tmp_path), kind)
    batches = [list(zip(e["prompts"], e["completions"])) for e in result.of("completion_batch")]
    assert [len(b) for b in batches] == [8, 8]
    scalar = f64(result.model, result.start)
    model, grads = verifier_expected(scalar, batches, kind, {"early": 0})
    check_grads(result, grads, far=[("the scores read one token early",
                                     verifier_expected(scalar, batches, kind, {"early": 1})[1])])
    check_weights(result, model)



# -----------------------------------------------------------------------------
# multiturn.py: GRPO on the game's turns, each turn's tokens on its estimator's advantage

class GuessEpisode:
    """One of the worker's planned games (ddp_worker.fixed_guess_episode) played out by the
    environment's rules, rebuilt from its parts: the ids after the prompt, which the policy wrote,
    each one's turn, and each turn's text. The rules: a guess's tokens count against the turn's
    budget, its EOS and the environment's answer do not; a turn that uses its budget ends the
    episode."""

    def __init__(self, prompt, j, budget):
        self.prompt, self.prompt_ids = prompt, TOK.encode(prompt)
        self.ids, self.policy, self.turn, self.texts = [], [], [], []
        k = -1
        for text, who in fixed_guess_episode(prompt, j):
            if who == "policy" and text is not None:
                k += 1
                self.texts.append("")
            for t in [EOS] if text is None else TOK.encode(text):
                self.ids.append(t)
                self.policy.append(who == "policy")
                self.turn.append(max(k, 0) if who == "policy" else k + 1)
                if who == "policy" and text is not None:
                    self.texts[k] += TOK.decode([t])
                    if len(self.texts[k]) == budget:
                        return                                 # cut: no EOS, no later turn


def multiturn_expected(gpt, batches, c):
    """One SGD step per batch of games on multiturn.py's loss: each turn's reward and state by the
    environment (tasks/guess.py), the advantages by test_multiturn.reference (the docstring's
    equations in floats), then 1/B sum_i 1/|o_i| sum_(t in o_i) [-rho A_(turn of t) + beta k3] at
    ratio 1. Planted mistakes: c["shift"] each turn's A on the next turn's tokens; c["reverse"]
    the discount over the turns before, not after; c["all_turns"] GiGPO's step groups over every
    turn of the group, not equal states; c["env"] the environment's tokens in o_i; (--layout
    steps) c["per_row"] each turn's row over its own tokens, not its episode's |o_i|, c["rows"]
    over the rows (the turns), not the B episodes."""
    from test_multiturn import reference
    ref, model, grads = frozen(gpt), copy.deepcopy(gpt), []
    for eps in batches:
        B = len(eps)
        judged = []
        for e in eps:
            r = guess.turn_rewards(e.prompt, e.texts)
            states = ["all" if c.get("all_turns") else s for s in guess.states(e.prompt, e.texts)]
            judged.append((r[::-1] if c.get("reverse") else r, guess.outcome(e.prompt, e.texts),
                           [(e.prompt, s) for s in states]))
        A = reference(c["credit"], judged, c["G"], c["gamma"], c["weight"])
        if c.get("reverse"):
            A = [a[::-1] for a in A]
        logps = lambda m: [token_logp(completion_logits(m, e.prompt_ids, e.ids, c["T"]), e.ids)
                           for e in eps]
        with torch.no_grad():
            ref_lp = logps(ref)
        total = 0.0
        for i, (e, lp) in enumerate(zip(eps, logps(model))):
            turns = [min(k + c.get("shift", 0), len(A[i]) - 1) for k in e.turn]
            adv = torch.tensor([A[i][k] if k < len(A[i]) else 0.0 for k in turns],
                               dtype=torch.float64)
            m = torch.tensor([1.0 if p or c.get("env") else 0.0 for p in e.policy],
                             dtype=torch.float64)
            per_token = (-torch.exp(lp - lp.detach()) * adv
                         + c["beta"] * kl_estimate(lp, ref_lp[i], "k3")) * m
            rows = sum(len(e.texts) for e in eps) if c.get("rows") else B
            if c.get("per_row"):
                turn = torch.tensor(e.turn)
                total = total + sum((per_token * (turn == k)).sum() / (m * (turn == k)).sum()
                                    for k in range(len(e.texts))) / rows
            else:
                total = total + per_token.sum() / m.sum() / rows
        g = grad_of(total, model)
        grads.append(g)
        sgd_step(model, g, SGD_LR)
    return model, grads


MULTITURN = {"T": 0.7, "beta": 0.3, "G": 4, "gamma": 0.7, "weight": 0.5}
MULTITURN_FLAGS = ["--steps", "2", "--prompts_per_step", "4", "--group_size", "4",
                   "--temperature", "0.7", "--beta", "0.3", "--gamma", "0.7", "--turn_weight",
                   "0.5", "--grad_clip", "1e9"]
MULTITURN_WRONG = {"outcome": [{"env": True}, {"T": 1.0}, {"beta": 0.04}],
                   "mt_grpo": [{"shift": 1}, {"weight": 1.0}, {"credit": "outcome"}],
                   "returns": [{"reverse": True}, {"gamma": 0.95}, {"shift": 1}],
                   "gigpo": [{"all_turns": True}, {"gamma": 0.95}, {"weight": 1.0}]}


@pytest.mark.parametrize("credit", list(MULTITURN_WRONG))
def test_multiturn_update(credit, tmp_path):
    """Two steps on planned games from random weights (binary search, 8 then the lowest possible,
    a turn that is not a number, a run-on cut by the budget): the turns, rewards, states and
    advantages rebuilt from the plans by the environment's rules; each flag at its default and
    each planted mistake told apart."""
    task.use(task_args("guess"))
    torch.manual_seed(0)
    init = str(tmp_path / "init.pt")
    save_checkpoint(init, GPT(GPTConfig(vocab_size=TOK.vocab_size, block_size=96, n_layer=2,
                                        n_head=2, n_embd=32)), TOK.name)
    result = train("multiturn", ["--init", init, "--credit", credit, *MULTITURN_FLAGS],
                   str(tmp_path / "run"))
    batches = [[GuessEpisode(p, j, guess.MAX_NEW_TOKENS) for p in e["prompts"]
                for j in range(e["group_size"])] for e in result.of("episodes")]
    assert len(batches) == 2 and {len(e.texts) for b in batches for e in b} >= {1, 2, 3}
    c = {**MULTITURN, "credit": credit}
    gpt = f64(result.model, result.start)
    model, grads = multiturn_expected(gpt, batches, c)
    far = [(str(w), multiturn_expected(gpt, batches, {**c, **w})) for w in MULTITURN_WRONG[credit]]
    check_grads(result, grads, far=[(k, g) for k, (_, g) in far])
    check_weights(result, model, far=[(k, m) for k, (m, _) in far])


def test_multiturn_update_in_the_step_layout(tmp_path):
    """--layout steps: a row a turn, sampled by the loop's own step_rows from each turn's step
    prompt; the compact protocol appends, so the update is the episodes' (one per game), each row
    normalised by its episode's |o_i| and the sum by the B episodes: normalising a row by its own
    tokens, or the sum by the rows, is far."""
    task.use(task_args("guess"))
    torch.manual_seed(0)
    init = str(tmp_path / "init.pt")
    save_checkpoint(init, GPT(GPTConfig(vocab_size=TOK.vocab_size, block_size=96, n_layer=2,
                                        n_head=2, n_embd=32)), TOK.name)
    result = train("multiturn", ["--init", init, "--credit", "mt_grpo", "--layout", "steps",
                                 *MULTITURN_FLAGS], str(tmp_path / "run"))
    batches = [[GuessEpisode(p, j, guess.MAX_NEW_TOKENS) for p in e["prompts"]
                for j in range(e["group_size"])] for e in result.of("episodes")]
    assert len(batches) == 2 and {len(e.texts) for b in batches for e in b} >= {1, 2, 3}
    c = {**MULTITURN, "credit": "mt_grpo"}
    gpt = f64(result.model, result.start)
    model, grads = multiturn_expected(gpt, batches, c)
    far = [(str(w), multiturn_expected(gpt, batches, {**c, **w}))
           for w in ({"per_row": True}, {"rows": True}, {"shift": 1})]
    check_grads(result, grads, far=[(k, g) for k, (_, g) in far])
    check_weights(result, model, far=[(k, m) for k, (m, _) in far])
