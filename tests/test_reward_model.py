"""reward_model.py: the Bradley-Terry loss and its gradient against a float64 reference, where the
score is read (the EOS, whatever the padding), and the script end to end: a tiny reward model beats
chance on held-out pairs, writes metrics and a checkpoint, and resumes."""
import importlib.util
import inspect
import json
import math
import os

import pytest
import torch

import task
from conftest import ROOT, run_script
from hf.checkpoint import load_checkpoint
from hf.tokenizer import Tokenizer
from model import GPT, GPTConfig, ScalarGPT

spec = importlib.util.spec_from_file_location("reward_model", os.path.join(ROOT, "reward_model.py"))
reward_model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reward_model)  # importing runs nothing: the training is under __main__


def test_the_loss_runs_when_copied_with_torch_alone():
    namespace = {"torch": torch, "F": torch.nn.functional}
    exec(inspect.getsource(reward_model.bradley_terry_loss), namespace)
    r_c, r_r = torch.randn(6, generator=torch.Generator().manual_seed(3)), torch.zeros(6)
    assert torch.equal(namespace["bradley_terry_loss"](r_c, r_r, 0.5),
                       reward_model.bradley_terry_loss(r_c, r_r, 0.5))


def bt_reference(r_c, r_r, margin):
    """-log P(chosen > rejected) with P = 1 / (1 + exp(-(r_c - r_r - m))), float64, one pair at a
    time."""
    return [math.log1p(math.exp(-(c - r - margin))) if c - r - margin > -30 else -(c - r - margin)
            for c, r in zip(r_c, r_r)]


@pytest.mark.parametrize("margin", [0.0, 0.5])
def test_bradley_terry_loss_matches_float64_reference_and_gradient(margin):
    r_c = (torch.randn(64, dtype=torch.float64) * 3).requires_grad_(True)
    r_r = (torch.randn(64, dtype=torch.float64) * 3).requires_grad_(True)
    loss = reward_model.bradley_terry_loss(r_c, r_r, margin)
    torch.testing.assert_close(loss.detach(),
                               torch.tensor(bt_reference(r_c.tolist(), r_r.tolist(), margin),
                                            dtype=torch.float64))
    g_c, g_r = torch.autograd.grad(loss.sum(), (r_c, r_r))
    # d/dr_c [-log sigmoid(d)] = -(1 - sigmoid(d)) = -sigmoid(-d), and the opposite for r_r
    d = (r_c - r_r - margin).detach()
    expected = torch.tensor([-1 / (1 + math.exp(x)) for x in d.tolist()], dtype=torch.float64)
    torch.testing.assert_close(g_c, expected)
    torch.testing.assert_close(g_r, -expected)


def test_bradley_terry_hand_worked_and_extremes():
    loss = reward_model.bradley_terry_loss(torch.tensor([0.0, 1.0, 100.0, -100.0]),
                                           torch.tensor([0.0, 0.0, 0.0, 0.0]))
    # a tie costs log 2; a gap of 1 costs log(1 + e^-1); huge gaps stay finite (0 and 100)
    torch.testing.assert_close(
        loss, torch.tensor([math.log(2), math.log1p(math.exp(-1)), 0.0, 100.0]))
    # the margin shifts the gap: r_c - r_r = 1 with margin 1 is a tie
    assert reward_model.bradley_terry_loss(torch.tensor([1.0]), torch.tensor([0.0]),
                                           1.0).item() == pytest.approx(math.log(2))


def test_score_is_read_at_the_eos_whatever_the_padding():
    torch.manual_seed(0)
    tok = Tokenizer()
    model = ScalarGPT.from_policy(GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32)))
    torch.nn.init.normal_(model.head.weight)  # a non-zero head so scores differ by position
    prompts, completions = ["3+4*2=", "1+1="], ["4*2=8,3+8=11#11", "1+1=2,2+1=3#3"]
    # as preference_pairs stores them
    pairs = [{"prompt": p, "chosen_ids": tok.encode(c) + [tok.eos_id],
              "rejected_ids": tok.encode(c) + [tok.eos_id]} for p, c in zip(prompts, completions)]
    tokens, mask, _ = task.pair_batch(pairs, tok)                     # the batch score_pairs scores
    tokens, mask = tokens[:2], mask[:2]                               # the chosen rows
    last = mask.sum(1).long() - 1
    assert (tokens[torch.arange(2), last] == tok.eos_id).all()      # the last real token is the EOS
    assert mask[1, -1] == 0                                          # the short row is right-padded
    with torch.no_grad():
        batched = model.score(tokens, mask)
        for i in range(2):  # each row alone, no padding; and left-padded with 5 pads
            alone, alone_mask, _ = task.pair_batch(pairs[i:i + 1], tok)
            alone, alone_mask = alone[:1], alone_mask[:1]
            ids = tok.encode(prompts[i] + completions[i]) + [tok.eos_id]
            left = torch.tensor([[tok.pad_id] * 5 + ids])
            left_mask = torch.tensor([[0.0] * 5 + [1.0] * len(ids)])
            per_pos = model(alone, alone_mask)[0]                    # (T,) values at every position
            assert model.score(alone, alone_mask).item() == pytest.approx(batched[i].item(),
                                                                          abs=1e-5)
            assert model.score(left, left_mask).item() == pytest.approx(batched[i].item(), abs=1e-5)
            # the EOS position
            assert batched[i].item() == pytest.approx(per_pos[-1].item(), abs=1e-5)
            # not the token before it
            assert batched[i].item() != pytest.approx(per_pos[-2].item(), abs=1e-5)


@pytest.mark.slow
def test_reward_model_beats_chance_on_held_out_pairs_and_resumes(tiny_sft, tmp_path):
    out = str(tmp_path)
    args = ["--init", tiny_sft, "--out", out, "--n_train", "512", "--batch_size", "32",
            "--lr", "1e-3", "--log_every", "8"]
    p = run_script("reward_model.py", args + ["--epochs", "3"], fresh=True)
    assert p.returncode == 0, p.stderr
    assert "held-out pair accuracy" in p.stdout
    rows = [json.loads(line) for line in open(os.path.join(out, "rm", "metrics.jsonl"))]
    assert rows[0]["step"] == 0 and rows[-1]["step"] == 48
    # chance is 0.5; 512 held-out pairs: 0.6 is 4.5 sigma above it
    assert rows[-1]["eval_pair_accuracy"] > 0.6, rows[-1]
    assert rows[-1]["eval_margin"] > 0
    model, ckpt = load_checkpoint(os.path.join(out, "rm.pt"), kind="scalar")
    assert ckpt["step"] == 48 and ckpt["scored"] == "prompt+completion+EOS"
    assert os.path.exists(os.path.join(out, "pairs_train.json"))
    assert os.path.exists(os.path.join(out, "pairs_eval.json"))
    p = run_script("reward_model.py", args + ["--epochs", "4", "--resume"])
    assert p.returncode == 0, p.stderr
    assert "resuming from" in p.stdout
    rows = [json.loads(line) for line in open(os.path.join(out, "rm", "metrics.jsonl"))]
    assert rows[-1]["step"] == 64


def test_reward_model_rejects_bad_settings_with_a_message(tmp_path):
    p = run_script("reward_model.py", ["--epochs", "0", "--out", str(tmp_path)])
    assert p.returncode != 0 and "--epochs" in p.stderr and "0 is not allowed" in p.stderr
    p = run_script("reward_model.py", ["--init", str(tmp_path / "nope.pt"), "--out", str(tmp_path)])
    assert p.returncode != 0 and "nope.pt" in p.stderr
