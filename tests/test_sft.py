"""sft.py end to end, as a user runs it, with tiny settings: checkpoint, metrics, resume."""
import json
import os

import pytest
import torch

import task
from conftest import TINY_SFT, growing_folder, refused, run_script
from hf.checkpoint import load_checkpoint
from hf.tokenizer import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# past the warm-up: the cosine schedule's lr goes into the checkpoint too
TINY = ["--steps", "4", "--warmup", "2", "--batch_size", "8", "--n_layer", "1", "--n_head", "1",
        "--n_embd", "16", "--log_every", "2", "--eval_every", "4", "--eval_n", "8"]


def run(args):
    return run_script("sft.py", args)


def test_sft_runs_end_to_end_and_resumes(tmp_path):
    out = str(tmp_path)
    p = run(TINY + ["--out", out])
    assert p.returncode == 0, p.stderr
    assert "held-out greedy accuracy" in p.stdout
    model, ckpt = load_checkpoint(os.path.join(out, "sft.pt"), kind="gpt", tokenizer=Tokenizer())
    assert ckpt["step"] == 4 and ckpt["args"]["n_embd"] == 16
    rows = [json.loads(line) for line in open(os.path.join(out, "sft", "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [0, 2, 4]
    assert "eval_accuracy" in rows[0] and "eval_accuracy" in rows[-1] and "loss" in rows[1]
    assert all(0.0 <= r["eval_accuracy"] <= 1.0 for r in rows if "eval_accuracy" in r)

    p = run(TINY + ["--out", out, "--steps", "6", "--resume"])
    assert p.returncode == 0, p.stderr
    assert "resuming from" in p.stdout
    _, ckpt2 = load_checkpoint(os.path.join(out, "sft.pt"))
    assert ckpt2["step"] == 6
    # it trained on
    assert not torch.equal(ckpt2["model"]["wte.weight"], ckpt["model"]["wte.weight"])
    rows = [json.loads(line) for line in open(os.path.join(out, "sft", "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [0, 2, 4, 6]


def test_sft_rejects_bad_settings_with_a_message(tmp_path):
    p = run(["--steps", "0", "--out", str(tmp_path)])
    assert p.returncode != 0 and "--steps" in p.stderr and "0 is not allowed" in p.stderr
    p = run(TINY + ["--resume", "--out", str(tmp_path / "empty")])
    assert p.returncode != 0 and "no checkpoint at" in p.stderr


def test_sft_loss_is_completion_tokens_only():
    """The demonstrations the script trains on put the answer after the prompt; the loss mask must
    start at the first completion token. Checked on the same batch construction the script uses."""
    tok = Tokenizer()
    tokens, attn, loss_mask = task.completion_batch(
        ["3+4*2=", "1+1="], ["4*2=8,3+8=11#11", "1+1=2,2+0=2#2"], tok, "cpu")
    targets = tokens[:, 1:]
    first = tok.decode([t for t, m in zip(targets[0].tolist(), loss_mask[0].tolist()) if m])
    assert first == "4*2=8,3+8=11#11<|endoftext|>"
    second = tok.decode([t for t, m in zip(targets[1].tolist(), loss_mask[1].tolist()) if m])
    assert second == "1+1=2,2+0=2#2<|endoftext|>"
    assert attn[1].sum() == len("1+1=1+1=2,2+0=2#2") + 1


@pytest.mark.slow
def test_sft_learns_the_task(tmp_path):
    """The recipe of the tests' SFT policy (conftest.TINY_SFT): its loss falls from ln(258) = 5.55
    nats (a uniform guess over the byte vocabulary) to a few hundredths of it, and its held-out
    greedy accuracy leaves 0, which a flipped sign, a shifted target or a loss over the prompt would
    prevent."""
    p = run_script("sft.py", TINY_SFT + ["--out", str(tmp_path)])
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in open(tmp_path / "sft" / "metrics.jsonl")]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert rows[0]["eval_accuracy"] == 0.0 and 0 < losses[-1] < 0.3
    assert rows[-1]["eval_accuracy"] > 0.15 and rows[-1]["eval_accuracy_other"] > 0.3


GOLDEN_QWEN3 = os.path.join(ROOT, "tests", "golden", "qwen3")


def test_a_game_that_does_not_fit_the_models_context_is_refused_before_any_work(tmp_path):
    """sft.py --task guess --chat on a folder of 128 positions: a demonstration is the whole game
    (four turns and the replies between them, 98 + 81 tokens before the turns' own), so it is
    refused in one line before any work, as multiturn.py refuses it, no folder left (it used to
    fail mid-run, its log written)."""
    out = tmp_path / "out"
    p = run_script("sft.py", ["--task", "guess", "--chat", "--init", GOLDEN_QWEN3, "--steps", "20",
                              "--out", str(out)])
    refused(p, "98 tokens and 81 more come between attempts", "block_size) is 128")
    assert not out.exists()
    assert f"loading {GOLDEN_QWEN3} (0.00 GiB of weights)" in p.stdout      # a real model: said
    assert "loaded in " in p.stdout and "torch.compile" not in p.stdout


def test_a_template_that_writes_a_game_otherwise_once_it_goes_on_is_refused_before_any_work(
        tmp_path):
    """A template that writes older messages otherwise as the game goes on (8 times) cannot give a
    game's demonstration as one sequence: refused in one line, naming the folder, before any work
    (it used to fail after step 0's evaluation, its log written)."""
    folder = growing_folder(tmp_path / "grow", 4096)
    out = tmp_path / "out"
    p = run_script("sft.py", ["--task", "guess", "--chat", "--init", folder, "--steps", "2",
                              "--out", str(out)])
    refused(p, f"error: --chat: hf:{folder}", "writes an assistant message differently")
    assert not out.exists()


def test_the_model_depth_is_the_tasks_unless_given():
    import sft
    assert sft.parse_args([]).n_layer == 2 and sft.parse_args(["--chat"]).n_layer == 2
    assert [sft.parse_args(["--task", t]).n_layer for t in ("countdown", "toolcalc", "guess")] \
        == [4, 4, 4]
    assert sft.parse_args(["--n_layer", "4"]).n_layer == 4
    assert sft.parse_args(["--task", "countdown", "--n_layer", "1"]).n_layer == 1


def test_a_resume_with_another_depth_names_the_flag_and_changes_nothing(tmp_path):
    """A checkpoint of another shape (a 1-layer run resumed at the default 2) is refused in one line
    naming the flag that changed, its log and checkpoint untouched."""
    out = str(tmp_path)
    assert run(TINY + ["--out", out]).returncode == 0
    files = [os.path.join(out, "sft.pt"), os.path.join(out, "sft", "metrics.jsonl")]
    before = [open(f, "rb").read() for f in files]
    i = TINY.index("--n_layer")
    depthless = TINY[:i] + TINY[i + 2:]                              # the default depth, 2
    p = run(depthless + ["--out", out, "--steps", "6", "--resume"])
    assert p.returncode != 0 and "(changed: --n_layer 1 -> 2)" in p.stderr, p.stderr
    assert [open(f, "rb").read() for f in files] == before
