"""prm.py: the step loss and its gradient against a float64 reference written from the binary
cross-entropy; the four aggregations against a float64 reference and by hand; where the scores are
read (each step's ',' and the EOS); Math-Shepherd's Monte Carlo labels with a scripted policy
(hand-counted shares); the label agreement; and the script end to end: the ORM and the PRM trained
from a tiny SFT policy, resumed, the mc labels, bad input refused."""
import inspect
import json
import math
import os

import pytest
import torch

import prm
import sampler
import task
from conftest import refuses_all, run_script
from hf.checkpoint import load_checkpoint
from hf.tokenizer import Tokenizer
from model import GPT, GPTConfig, ScalarGPT, scores_at
from tasks import arithmetic


# -----------------------------------------------------------------------------
# float64 references, from the equations

def ref_bce(z, y):
    """-(y log sigmoid(z) + (1 - y) log(1 - sigmoid(z))), one step, float64, stable for large |z|:
    log sigmoid(z) = -log(1 + e^-z), log(1 - sigmoid(z)) = log sigmoid(-z)."""
    log_sig = lambda x: -math.log1p(math.exp(-x)) if x > -30 else x
    return -(y * log_sig(z) + (1 - y) * log_sig(-z))


def ref_prm_loss(logits, labels, mask):
    terms = [ref_bce(z, y) for zr, yr, mr in zip(logits, labels, mask)
             for z, y, m in zip(zr, yr, mr) if m]
    return sum(terms) / len(terms) if terms else 0.0


def ref_aggregate(scores, mask, how):
    out = []
    for sr, mr in zip(scores, mask):
        p = [s for s, m in zip(sr, mr) if m]
        if not p:
            out.append(0.0)
        elif how == "min":
            out.append(min(p))
        elif how == "prod":
            out.append(math.prod(p))
        elif how == "last":
            out.append(p[-1])
        else:
            out.append(sum(p) / len(p))
    return torch.tensor(out, dtype=torch.float64)


def test_prm_loss_matches_float64_reference_and_its_gradient():
    torch.manual_seed(0)
    logits = (torch.randn(16, 5, dtype=torch.float64) * 4).requires_grad_(True)
    labels = torch.rand(16, 5, dtype=torch.float64)                          # soft labels in [0, 1]
    labels[:8] = labels[:8].round()                                          # and hard ones
    mask = (torch.rand(16, 5) > 0.3).double()
    mask[3] = 0                                                              # a row with no step
    loss = prm.prm_loss(logits, labels, mask)
    assert loss.item() == pytest.approx(ref_prm_loss(logits.tolist(), labels.tolist(),
                                                     mask.tolist()), rel=1e-12)
    (grad,) = torch.autograd.grad(loss, logits)
    # d/dz of the mean BCE: (sigmoid(z) - y) / #steps on real steps, 0 elsewhere
    n = mask.sum().item()
    expected = torch.tensor([[(1 / (1 + math.exp(-z)) - y) / n if m else 0.0
                              for z, y, m in zip(zr, yr, mr)]
                             for zr, yr, mr in zip(logits.tolist(), labels.tolist(),
                                                   mask.tolist())], dtype=torch.float64)
    torch.testing.assert_close(grad, expected)


def test_prm_loss_hand_worked_extremes_and_masked_junk():
    # p = 1/2 costs log 2 whatever the label; a confident right step costs ~0, a confident wrong one
    # ~|z|
    loss = prm.prm_loss(torch.tensor([[0.0, 100.0, -100.0]]), torch.tensor([[1.0, 1.0, 1.0]]),
                        torch.ones(1, 3))
    assert loss.item() == pytest.approx((math.log(2) + 0.0 + 100.0) / 3, rel=1e-6)
    # a soft label 0.25 at z = 0: still log 2; the gradient sigmoid(0) - 0.25 = 0.25
    z = torch.zeros(1, 1, requires_grad=True)
    prm.prm_loss(z, torch.tensor([[0.25]]), torch.ones(1, 1)).backward()
    assert z.grad.item() == pytest.approx(0.25)
    # NaN and inf at masked steps never reach the loss or the gradient
    z = torch.tensor([[0.5, float("nan"), float("inf")]], requires_grad=True)
    labels = torch.tensor([[1.0, float("nan"), 7.0]])
    loss = prm.prm_loss(z, labels, torch.tensor([[1.0, 0.0, 0.0]]))
    loss.backward()
    assert loss.item() == pytest.approx(ref_bce(0.5, 1.0))
    assert torch.isfinite(z.grad).all() and z.grad[0, 1:].eq(0).all()
    # nothing real: 0, with a zero gradient
    z = torch.randn(2, 3, requires_grad=True)
    loss = prm.prm_loss(z, torch.ones(2, 3), torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and z.grad.eq(0).all()


def test_the_loss_and_the_aggregation_run_when_copied_with_torch_alone():
    namespace = {"torch": torch, "F": torch.nn.functional}
    for f in (prm.prm_loss, prm.aggregate_steps):
        exec(inspect.getsource(f), namespace)
    g = torch.Generator().manual_seed(5)
    z, y = torch.randn(6, 4, generator=g), torch.rand(6, 4, generator=g)
    m = (torch.rand(6, 4, generator=g) > 0.3).float()
    assert torch.equal(namespace["prm_loss"](z, y, m), prm.prm_loss(z, y, m))
    for how in ("min", "prod", "last", "mean"):
        p = torch.sigmoid(z)
        assert torch.equal(namespace["aggregate_steps"](p, m, how), prm.aggregate_steps(p, m, how))


def test_prm_loss_parts_add_up_to_the_whole():
    torch.manual_seed(1)
    z, y, m = torch.randn(8, 4), torch.rand(8, 4), (torch.rand(8, 4) > 0.4).float()
    whole = prm.prm_loss(z, y, m)
    n = m.sum()
    parts = prm.prm_loss(z[:3], y[:3], m[:3], n) + prm.prm_loss(z[3:], y[3:], m[3:], n)
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)


@pytest.mark.parametrize("how", ["min", "prod", "last", "mean"])
def test_aggregate_steps_matches_float64_reference(how):
    torch.manual_seed(2)
    scores = torch.rand(32, 6, dtype=torch.float64)
    mask = (torch.rand(32, 6) > 0.4).double()
    mask[0] = 0                                                 # no step: 0
    mask[1] = torch.tensor([1.0, 0, 0, 1.0, 0, 0])              # holes: 'last' is the last real one
    scores[mask == 0] = float("nan")                            # junk at masked steps must not leak
    got = prm.aggregate_steps(scores, mask, how)
    torch.testing.assert_close(got, ref_aggregate(scores.tolist(), mask.tolist(), how))


def test_aggregate_steps_with_no_steps_at_all_is_zero_not_an_index_error():
    for how in ("min", "prod", "last", "mean"):
        assert prm.aggregate_steps(torch.zeros(3, 0), torch.zeros(3, 0), how).tolist() == [
            0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="'median'"):
        prm.aggregate_steps(torch.zeros(3, 0), torch.zeros(3, 0), "median")


def test_aggregate_steps_hand_worked():
    s = torch.tensor([[0.9, 0.2, 0.8], [0.5, 0.7, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    expected = {"min": [0.2, 0.5], "prod": [0.144, 0.35], "last": [0.8, 0.7],
                "mean": [1.9 / 3, 0.6]}
    for how, want in expected.items():
        torch.testing.assert_close(prm.aggregate_steps(s, m, how), torch.tensor(want))
    with pytest.raises(ValueError, match="allowed"):
        prm.aggregate_steps(s, m, "max")


# -----------------------------------------------------------------------------
# Where the scores are read

def test_scores_are_read_at_each_steps_comma_and_at_the_eos():
    tok = Tokenizer()
    prompt, completion = "3+4*2=", "4*2=8,3+8=11#11"
    ids = tok.encode(completion) + [tok.eos_id]                           # as sampled: the EOS last
    p = tok.encode(prompt)
    # the ',' and the EOS, by hand
    assert task.read_positions(p, ids, tok, "prm") == [6 + 5, 6 + 15]
    assert task.read_positions(p, ids, tok, "orm") == [6 + 15]
    assert task.read_positions(p, tok.encode("4*2=8,"), tok, "prm", finished=False) == [6 + 5]
    other = tok.encode("1+1=2,2+1=3#3") + [tok.eos_id]
    tokens, attn, _ = task.completion_batch([prompt, "1+1+1="], [ids, other], tok)
    recs = [{"prompt": prompt, "ids": ids}, {"prompt": "1+1+1=", "ids": other}]
    _, _, positions, labels, mask = prm.verifier_batch(recs, [[1, 0], [1, 1]], tok, "prm", "cpu")
    read = tokens.gather(1, positions)
    assert read.tolist() == [[tok.encode(",")[0], tok.eos_id], [tok.encode(",")[0], tok.eos_id]]
    assert labels.tolist() == [[1.0, 0.0], [1.0, 1.0]] and mask.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    # the value read is the model's output at that position, whatever the other rows' padding
    torch.manual_seed(0)
    model = ScalarGPT.from_policy(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16)))
    torch.nn.init.normal_(model.head.weight)
    with torch.no_grad():
        got = scores_at(model, tokens, attn, positions, mask)
        alone, alone_attn, _ = task.completion_batch([prompt], [ids], tok)
        full = model(alone, alone_attn)[0]
    torch.testing.assert_close(got[0], full[[11, 21]], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="do not match"):
        prm.verifier_batch(recs, [[1], [1]], tok, "prm", "cpu")    # one label per step, or an error


# -----------------------------------------------------------------------------
# Math-Shepherd's labels, with a scripted policy

class ScriptedPolicy(torch.nn.Module):
    """A stand-in for the SFT policy: continues each prefix (decoded) with scripted texts, sample m
    of k getting script[prefix][m]."""

    def __init__(self, tok, script):
        super().__init__()
        self.tok, self.script, self.w = tok, script, torch.nn.Parameter(torch.zeros(1))
        self.config = GPTConfig()

    def generate(self, idx, mask, max_new_tokens, eos_id, pad_id, num_samples, temperature,
                 generator):
        eos_id = eos_id[0] if isinstance(eos_id,
                                         (list, tuple)) else eos_id         # a tokenizer's stop_ids
        rows = []
        for row, m in zip(idx.tolist(), mask.tolist()):
            prefix = self.tok.decode([t for t, keep in zip(row, m) if keep])
            rows += [self.tok.encode(text) + [eos_id] for text in self.script[prefix][:num_samples]]
        T = max(len(r) for r in rows)
        tokens = torch.tensor([r + [pad_id] * (T - len(r)) for r in rows])
        mask = torch.tensor([[1.0] * len(r) + [0.0] * (T - len(r)) for r in rows])
        return tokens, mask, torch.zeros(len(rows), dtype=torch.bool)


def test_mc_labels_count_the_continuations_that_reach_the_answer(monkeypatch):
    monkeypatch.setattr(sampler, "generate", lambda policy, *a,
                        **k: policy.generate(*a, **k))                          # the script answers
    tok = Tokenizer()
    # left to right, right answer by luck
    records = [{"prompt": "9+8*1=", "text": "9+8=17,17*1=17#17"},
               {"prompt": "3+4*2=", "text": "3+4=7,7*2=14#14"},            # left to right, wrong
               {"prompt": "3+4*2=", "text": "4*2=8,3+8=11#11"}]            # right
    for r in records:
        r["ids"], r["outcome"] = tok.encode(r["text"]), task.reward(r["prompt"], r["text"])
        r["rule"] = arithmetic.step_labels(r["prompt"], r["text"])
    # 2 of 4 right
    script = {"9+8*1=9+8=17,": ["17*1=17#17", "17*1=18#18", "17*1=17#17", "17*1=16#16"],
              "3+4*2=3+4=7,": ["7*2=14#14"] * 4,                                            # 0 of 4
              "3+4*2=4*2=8,": ["3+8=11#11", "3+8=11#11", "3+8=11#11", "3+8=12#12"]}         # 3 of 4
    mc = prm.mc_labels(ScriptedPolicy(tok, script), tok, records, 4, 1.0, None, batch_size=2)
    # the last step: the completion's own outcome
    assert mc == [[0.5, 1.0], [0.0, 0.0], [0.75, 1.0]]
    agreement = prm.label_agreement(records, mc)
    # rule [0,0], [0,0], [1,1] against hard mc [1,1], [0,0], [1,1]: 4 of 6 steps agree; both misses
    # are the a+b*1 case
    assert agreement["steps"] == 6 and agreement["agreement"] == pytest.approx(4 / 6)
    assert (agreement["rule0_mc1"] == 2 and agreement["rule1_mc1"] == 2
            and agreement["rule0_mc0"] == 2)
    assert agreement["disagree_left_to_right_lucky"] == 2
    assert {(e["prompt"], e["step"]) for e in agreement["examples"]} == {("9+8*1=", 1),
                                                                         ("9+8*1=", 2)}


def test_mc_continuations_get_what_remains_of_the_completions_budget(monkeypatch):
    """A continuation from the prefix '4*2=8,' (6 tokens) has 24 - 6 = 18 tokens left of the
    completion's budget: one that reaches the right answer only at its 19th token does not count;
    given 64 tokens in all, it does."""
    monkeypatch.setattr(sampler, "generate", lambda policy, *a,
                        **k: policy.generate(*a, **k))                          # the script answers
    tok = Tokenizer()
    text = "4*2=8,3+8=11#11"
    records = [{"prompt": "3+4*2=", "text": text, "ids": tok.encode(text), "outcome": 1.0,
                "rule": [1, 1]}]
    slow = " " * 12 + "3+8=11#11"                           # 21 tokens: the answer ends at the 21st
    script = {"3+4*2=4*2=8,": [slow] * 2}
    assert prm.mc_labels(ScriptedPolicy(tok, script), tok, records, 2, 1.0, None,
                         max_new_tokens=24) == [[0.0, 1.0]]
    assert prm.mc_labels(ScriptedPolicy(tok, script), tok, records, 2, 1.0, None,
                         max_new_tokens=64) == [[1.0, 1.0]]


# -----------------------------------------------------------------------------
# The script

TINY = ["--n_prompts", "48", "--samples_per_prompt", "2", "--eval_n", "32", "--eval_samples", "2",
        "--batch_size", "16", "--lr", "1e-3", "--log_every", "2", "--eval_every", "6"]


def rows(out, name):
    return [json.loads(line) for line in open(os.path.join(out, name, "metrics.jsonl"))]


@pytest.mark.slow
def test_script_trains_both_verifiers_and_resumes(tiny_sft, tmp_path):
    out = str(tmp_path)
    p = run_script("prm.py", TINY + ["--epochs", "1", "--init", tiny_sft, "--out", out], fresh=True)
    assert p.returncode == 0, p.stderr
    assert ("held-out outcome accuracy" in p.stdout
            and "held-out step accuracy vs rule labels" in p.stdout)
    for kind in ("orm", "prm"):
        r = rows(out, kind)
        assert [x["step"] for x in r] == [0, 2, 4, 6], kind          # 96 completions / 16 = 6 steps
        assert 0 <= r[-1]["eval_outcome_accuracy"] <= 1 and math.isfinite(r[-1]["loss"])
        _, ckpt = load_checkpoint(os.path.join(out, f"{kind}.pt"), kind="scalar")
        assert ckpt["reward_type"] == kind and ckpt["script"] == "prm" and ckpt["step"] == 6
    assert ("eval_step_accuracy" in rows(out, "prm")[-1]
            and "eval_step_accuracy" not in rows(out, "orm")[-1])
    assert rows(out, "orm")[-1]["loss"] < math.log(2)          # it learned something: below p = 1/2
    p = run_script("prm.py", TINY + ["--epochs", "2", "--init", tiny_sft, "--out", out, "--resume"])
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("resuming from") == 2
    for kind in ("orm", "prm"):
        assert [x["step"] for x in rows(out, kind)] == [0, 2, 4, 6, 8, 10, 12]
    # the verifier of the wrong kind is refused by name, in one line
    with pytest.raises(SystemExit, match="reward_type 'orm'"):
        prm.load_verifier(os.path.join(out, "orm.pt"), "cpu", "prm")


def test_script_mc_labels_report_agreement(tiny_sft, tmp_path):
    out = str(tmp_path)
    p = run_script("prm.py", TINY + ["--train", "prm", "--labels", "mc", "--mc_k", "2",
                                     "--mc_label", "soft", "--epochs", "1",
                                     "--init", tiny_sft, "--out", out])
    assert p.returncode == 0, p.stderr
    assert ("labels: mc (hard) and rule agree on" in p.stdout
            and not os.path.exists(os.path.join(out, "orm.pt")))
    agreement = json.load(open(os.path.join(out, "prm", "label_agreement.json")))
    assert agreement["steps"] == sum(agreement[k]
                                     for k in ("rule1_mc1", "rule1_mc0", "rule0_mc1", "rule0_mc0"))
    assert agreement["steps"] >= 96 and 0 <= agreement["agreement"] <= 1
    assert rows(out, "prm")[0]["labels_agree"] == agreement["agreement"]
    _, ckpt = load_checkpoint(os.path.join(out, "prm.pt"))
    assert ckpt["labels"] == "mc (soft, k=2)"


def test_script_refuses_bad_input(tmp_path):
    refuses_all("prm.py", [(["--mc_k", "0"], ["--mc_k", "0 is not allowed"]),
                           (["--n_prompts", "4", "--samples_per_prompt", "2", "--batch_size", "9"],
                            ["--batch_size 9", "8 training completions"]),
                           (["--labels", "human"], ["--labels"]),
                           (["--init", str(tmp_path / "nope.pt")],
                            ["no checkpoint at", "nope.pt"])], tmp_path)
