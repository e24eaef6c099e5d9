"""search.py: majority vote and best-of-N against independent references and by hand
(ties, None, NaN); the step sampler against model.generate's draws; the beam search by hand with a
scripted policy and an oracle scorer; and the script end to end on a tiny policy with verifiers of
the right kinds: the table's invariants (pass@N bounds every method and grows with N, tokens
proportional to N), results.json and the PNG, bad input refused."""
import collections
import json
import math
import os
import random

import pytest
import torch

import sampler
import search
import task
from conftest import refused, refuses_all, run_script
from hf.checkpoint import load_checkpoint, save_checkpoint
from hf.tokenizer import Tokenizer
from model import GPT, GPTConfig, ScalarGPT
from tasks import arithmetic


# -----------------------------------------------------------------------------
# Majority vote and best-of-N

def test_majority_vote_by_hand():
    answers = [["3", "4", "3"], [None, None], ["5", None, "6", "6", "5"], ["7"], [None, "8", None],
               ["1", "2"], []]
    assert search.majority_vote(answers) == ["3", None, "5", "7", "8",
                                             "1", None]                  # ties: the first to appear


def test_majority_vote_matches_a_counter_reference():
    rng = random.Random(0)
    for _ in range(200):
        row = [rng.choice(["1", "2", "3", None]) for _ in range(rng.randint(1, 9))]
        counts = collections.Counter(a for a in row if a is not None)
        if not counts:
            want = None
        else:
            top = max(counts.values())
            # the first of the most frequent
            want = next(a for a in row if a is not None and counts[a] == top)
        assert search.majority_vote([row]) == [want], row


def test_best_of_n_by_hand():
    nan, inf = float("nan"), float("inf")
    scores = [[0.1, 0.9, 0.9], [nan, -inf, nan], [nan, nan, nan], [2.0, nan, 3.0],
              [-1.0, -1.0, -2.0], [inf, 5.0, inf]]
    assert search.best_of_n(scores).tolist() == [1, 1, 0, 2, 0, 0]
    assert search.best_of_n(torch.tensor([[0.3]])).tolist() == [0]


def test_best_of_n_matches_a_reference_on_random_rows():
    rng = random.Random(1)
    for _ in range(100):
        row = [rng.choice([0.1, 0.5, 0.9, float("nan")]) for _ in range(rng.randint(1, 8))]
        real = [(v, j) for j, v in enumerate(row) if not math.isnan(v)]
        want = min(real, key=lambda vj: (-vj[0], vj[1]))[1] if real else 0
        assert search.best_of_n(torch.tensor([row])).item() == want, row


def test_best_first_orders_like_best_of_n():
    s = torch.tensor([0.2, float("nan"), 0.9, 0.2, 0.9])
    assert search.best_first(s) == [2, 4, 0, 3, 1]


# -----------------------------------------------------------------------------
# The step sampler and the beam search

def test_a_step_is_what_generate_samples_up_to_the_next_comma_or_eos():
    torch.manual_seed(0)
    tok = Tokenizer()
    policy = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32)).eval()
    comma = tok.encode(",")[0]
    with torch.no_grad():               # make ',' and EOS likely (logits +5 and +4) so steps end
        v = torch.randn(32)
        policy.ln_f.bias.copy_(v)
        policy.lm_head.weight[comma] += 5 * v / v.dot(v)
        policy.lm_head.weight[tok.eos_id] += 4 * v / v.dot(v)
    prompts = ["3+4*2=", "1-9*9=4", "2*3+4=6,"]
    prefixes = [tok.encode(p) for p in prompts]
    steps = search.sample_steps(policy, tok, prefixes, [12] * 3, 1.0,
                                torch.Generator().manual_seed(3))
    idx, mask = tok.encode_batch(prompts)
    tokens, keep, _ = sampler.generate(policy, idx, mask, 12, tok.eos_id, tok.pad_id,
                                       temperature=1.0, generator=torch.Generator().manual_seed(3))
    stopped = 0
    for step, row in zip(steps, tokens.tolist()):
        cut = next((t + 1 for t, x in enumerate(row) if x in (comma, tok.eos_id)), 12)
        assert step == row[:cut]        # the same draws, cut at the first ',' or EOS (or the limit)
        stopped += step[-1] in (comma, tok.eos_id)
    assert stopped >= 2
    short = search.sample_steps(policy, tok, prefixes, [1, 2, 3], 1.0,
                                torch.Generator().manual_seed(3))
    assert [len(s) <= n for s, n in zip(short, [1, 2, 3])] == [True] * 3 and len(short[0]) == 1


def scripted(tok, script):
    """A stand-in for sample_steps: each prefix (decoded) gets the next of its scripted steps, in
    turn."""
    calls = collections.Counter()

    def sample_steps(policy, tok_, prefixes, limits, temperature, generator):
        out = []
        for ids in prefixes:
            text = tok.decode(ids)
            step = script[text][calls[text] % len(script[text])]
            calls[text] += 1
            out.append(tok.encode(step.replace("<eos>", ""))
                       + ([tok.eos_id] if step.endswith("<eos>") else []))
        return out
    return sample_steps


def oracle(model, tok, kind, prompts, ids, finished=None, how=None):
    """A perfect PRM: the min of the rule labels of the steps so far (a partial path's empty last
    piece dropped)."""
    out = []
    for p, c, done in zip(prompts, ids, finished):
        # a finished path: EOS last
        labels = arithmetic.step_labels(p, tok.decode([t for t in c if t != tok.eos_id]))
        out.append(float(min(labels if done else labels[:-1])))
    return torch.tensor(out)


def test_beam_search_by_hand_with_a_scripted_policy_and_an_oracle_prm(monkeypatch):
    tok = Tokenizer()
    script = {"3+4*2=": ["3+4=7,", "4*2=8,", "3+4=7,", "3+4=7,"],
              "3+4*2=4*2=8,": ["3+8=12#12<eos>", "3+8=11#11<eos>"],
              "3+4*2=3+4=7,": ["7*2=14#14<eos>"]}
    monkeypatch.setattr(search, "score", oracle)
    monkeypatch.setattr(search, "sample_steps", scripted(tok, script))
    # beam 1, expand 2: level 1 samples 2 first steps (6 tokens each), keeps '4*2=8,'; level 2
    # samples 2 endings (9 tokens + EOS each) and keeps the right one: 6 + 6 + 10 + 10 = 32 tokens
    picked, used = search.beam_search(None, None, tok, ["3+4*2="], 1, 2, 1.0, 24, None)
    assert tok.decode(picked[0]) == "4*2=8,3+8=11#11<|endoftext|>" and used == [32]
    # beam 2, expand 2: level 1 samples 4 first steps; the kept two are '4*2=8,' and the first
    # '3+4=7,' (ties: the first); level 2 gives each 2 endings: 4 * 6 + 4 * 10 = 64 tokens, and the
    # right one wins
    monkeypatch.setattr(search, "sample_steps", scripted(tok, script))
    picked, used = search.beam_search(None, None, tok, ["3+4*2="], 2, 2, 1.0, 24, None)
    assert tok.decode(picked[0]) == "4*2=8,3+8=11#11<|endoftext|>" and used == [64]


def test_beam_search_keeps_a_path_sampled_twice_once(monkeypatch):
    """Level 1 samples '4*2=8,' twice and '3+4=7,' twice: with beam 2 the two kept paths are the two
    distinct ones (two copies of the best would leave the beam one path wide), so both are expanded
    at level 2."""
    tok = Tokenizer()
    script = {"3+4*2=": ["4*2=8,", "4*2=8,", "3+4=7,", "3+4=7,"],
              "3+4*2=4*2=8,": ["3+8=11#11<eos>"], "3+4*2=3+4=7,": ["7*2=14#14<eos>"]}
    expanded = []
    sampler = scripted(tok, script)

    def recording(policy, tok_, prefixes, limits, temperature, generator):
        expanded.extend(tok.decode(p) for p in prefixes)
        return sampler(policy, tok_, prefixes, limits, temperature, generator)
    monkeypatch.setattr(search, "score",
                        lambda model, tok_, kind, prompts, ids, finished=None, how=None:
                            torch.tensor([0.9 if tok.decode(c).startswith("4*2") else 0.5
                                          for c in ids]))
    monkeypatch.setattr(search, "sample_steps", recording)
    search.beam_search(None, None, tok, ["3+4*2="], 2, 2, 1.0, 24, None)
    assert expanded.count("3+4*2=3+4=7,") == 2 and expanded.count("3+4*2=4*2=8,") == 2


def test_beam_search_ranks_a_finished_path_by_its_last_step_not_its_weakest(monkeypatch):
    """A finished path whose final step the PRM trusts (0.95, after a doubtful first step, 0.6)
    against an unfinished one at 0.7: scored by the last step the finished one wins and the search
    stops; scored by the minimum over steps it would lose to the unfinished path, whose minimum can
    only fall as it grows."""
    tok = Tokenizer()
    probs = {"4*2=8,3+8=11#11": [0.6, 0.95], "4*2=8,": [0.6], "3+4=7,": [0.7],
             "3+4=7,7*2=14#14": [0.7, 0.1]}
    script = {"3+4*2=": ["4*2=8,3+8=11#11<eos>", "3+4=7,"], "3+4*2=3+4=7,": ["7*2=14#14<eos>"]}

    def prm_score(model, tok_, kind, prompts, ids, finished=None, how=None):
        steps = [probs[tok.decode([t for t in c if t != tok.eos_id])] for c in ids]
        return torch.tensor([s[-1] if how == "last" else min(s) for s in steps])
    monkeypatch.setattr(search, "score", prm_score)
    monkeypatch.setattr(search, "sample_steps", scripted(tok, script))
    picked, used = search.beam_search(None, None, tok, ["3+4*2="], 1, 2, 1.0, 24, None)
    # no level 2: none left
    assert tok.decode(picked[0]) == "4*2=8,3+8=11#11<|endoftext|>" and used == [16 + 6]


def test_best_of_n_with_no_samples_is_an_error_that_says_so():
    with pytest.raises(ValueError, match="N >= 1"):
        search.best_of_n(torch.zeros(3, 0))


def test_beam_search_of_width_one_is_sampling(tiny_sft):
    """beam 1 x expand 1 keeps every step it samples: it draws what model.generate draws with the
    same generator."""
    from plumbing.loading import load_model
    policy, tok, _ = load_model(tiny_sft, "cpu")
    prm = ScalarGPT.from_policy(policy).eval()
    prompts = task.eval_prompts()[:6]
    for i, p in enumerate(prompts):
        picked, used = search.beam_search(policy, prm, tok, [p], 1, 1, 1.0, 24,
                                          torch.Generator().manual_seed(i))
        idx, mask = tok.encode_batch([p])
        tokens, keep, _ = sampler.generate(policy, idx, mask, 24, tok.eos_id, tok.pad_id,
                                           temperature=1.0,
                                           generator=torch.Generator().manual_seed(i))
        row = [t for t, k in zip(tokens[0].tolist(), keep[0].tolist()) if k]
        assert picked[0] == row and used == [len(row)]                    # as sampled, its EOS last


# -----------------------------------------------------------------------------
# The script

@pytest.fixture(scope="module")
def verifiers(tiny_sft, tmp_path_factory):
    """ORM, PRM and RM checkpoints of the right kinds on the tiny SFT backbone, heads random (not
    trained: the script's plumbing is under test here; prm.py's training is tested in
    test_prm.py)."""
    out = tmp_path_factory.mktemp("verifiers")
    policy, ckpt = load_checkpoint(tiny_sft)
    paths = {}
    for name, extra in {"orm": {"script": "prm", "reward_type": "orm"},
                        "prm": {"script": "prm", "reward_type": "prm"},
                        "rm": {"script": "reward_model"}}.items():
        torch.manual_seed(len(name) + ord(name[0]))
        model = ScalarGPT.from_policy(policy)
        torch.nn.init.normal_(model.head.weight, std=0.5)
        paths[name] = str(out / f"{name}.pt")
        save_checkpoint(paths[name], model, ckpt["tokenizer"], **extra)
    return paths


@pytest.mark.slow
def test_script_end_to_end(tiny_sft, verifiers, tmp_path):
    out = str(tmp_path)
    p = run_script("search.py", ["--init", tiny_sft, "--orm", verifiers["orm"],
                                 "--prm", verifiers["prm"], "--rm", verifiers["rm"],
                                 "--eval_n", "12", "--max_n", "4", "--beam", "2", "--expand", "2",
                                 "--out", out], fresh=True)
    assert p.returncode == 0, p.stderr
    assert "| best-of-N PRM (min) |" in p.stdout and "| beam 2 x expand 2 |" in p.stdout
    r = json.load(open(os.path.join(out, "search", "results.json")))
    assert r["n"] == [1, 2, 4] and r["prompts"] == 12
    acc = r["accuracy"]
    assert set(acc) == {"majority", "orm", "prm_min", "prm_prod", "rm", "pass"}
    for k, values in acc.items():
        assert all(0 <= a <= b + 1e-12
                   for a, b in zip(values, acc["pass"])), k               # nothing beats the oracle
        assert values[0] == pytest.approx(acc["pass"][0])                    # one of one: no choice
    assert acc["pass"] == sorted(acc["pass"])                                  # pass@N grows with N
    # N samples cost N x
    assert [t / n for t, n in zip(r["tokens"], r["n"])] == pytest.approx([r["tokens"][0]] * 3)
    assert ([b["beam"] for b in r["beam_search"]] == [1, 2]
            and all(b["tokens"] > 0 for b in r["beam_search"]))
    with open(os.path.join(out, "search", "search.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_script_refuses_bad_input(tiny_sft, verifiers, tmp_path):
    common = ["--init", tiny_sft, "--rm", verifiers["rm"], "--eval_n", "2"]
    refuses_all("search.py", [
        # an ORM where a PRM is expected
        (common + ["--orm", verifiers["orm"], "--prm", verifiers["orm"]],
         ["reward_type 'orm'", "reward_type 'prm' is needed"]),
        (common + ["--orm", verifiers["rm"], "--prm", verifiers["prm"]], ["script 'reward_model'"]),
        (common + ["--orm", str(tmp_path / "none.pt"), "--prm", verifiers["prm"]],
         ["no checkpoint at", "none.pt", "prm.py"]),
        *[([flag, "0"], [flag, "0 is not allowed"]) for flag in ("--max_n", "--beam", "--expand")],
        (["--max_n", "1000000000"], ["--max_n", "<= 256"])], tmp_path)


def test_what_can_be_refused_is_refused_before_any_prerequisite_is_built(tmp_path):
    """From a folder without out/ (every default checkpoint missing): an unreadable --rm, an
    --out that is a file and a --max_new_tokens past the context are refused at once, nothing built,
    nothing sampled."""
    junk = tmp_path / "junk.pt"
    junk.write_bytes(os.urandom(500))
    (tmp_path / "a_file").write_text("x")
    for args, words in ((["--rm", str(junk)], ["--rm", "junk.pt"]),
                        (["--out", str(tmp_path / "a_file")], ["--out"]),
                        (["--max_new_tokens", "100"], ["--max_new_tokens 100", "<= "])):
        p = run_script("search.py", args, cwd=tmp_path)
        refused(p, *words)
        assert ("building it first" not in p.stdout
                and not os.path.exists(tmp_path / "out" / "sft.pt"))
