"""multiturn.py and its environment (tasks/guess.py): the game's rules, rewards and demonstrator;
each turn-level estimator against a float64 reference written from its equation (hand-worked
episodes of unequal length, a state several episodes share, gamma 0 and 1, groups all equal); the
episodes the sampler plays with the environment's answers; the script end to end, and its
refusals. The exact update of its loop: tests/test_updates.py."""
import json
import math
import os
import random

import pytest
import torch

import multiturn
import task
from conftest import ROOT, growing_folder, refused, refuses_all, run_script, task_args
from hf import chat
from hf.checkpoint import load_checkpoint
from hf.tokenizer import Tokenizer
from model import GPT, GPTConfig, completion_logprobs
from tasks import guess

F64 = dict(dtype=torch.float64)


# -----------------------------------------------------------------------------
# The game

def test_the_game_answers_higher_or_lower_and_ends_at_the_number():
    p = guess.eval_prompts()[0]
    n = guess.secret(p)
    assert {guess.secret(q) for q in guess.eval_prompts()} == set(range(1, 16))
    assert guess.feedback(p, [str(n)]) is None
    assert guess.feedback(p, ["1", str(n - 1)] if n > 1 else ["2"]) == (
        guess.HIGHER if n > 1 else guess.LOWER)
    for junk in (["x"], [" "], [""], ["999"], [None], []):
        assert guess.feedback(p, junk) == guess.UNREAD
    for bad in (None, "", "#x 1-15?", 3):
        assert guess.secret(bad) is None and guess.outcome(bad, ["8"]) == 0.0
        assert guess.turn_rewards(bad, ["8", "x"]) == [0.0, 0.0]
    assert guess.reward(p, None) == 0.0 and guess.segments("") == [("", False)]


def test_binary_search_takes_49_15_turns_and_the_information_adds_up_to_one():
    """Over the 15 numbers, the middle of what is possible needs 1, 2, 2, 3 x 4 and 4 x 8 guesses
    (49 / 15 = 3.27 on average); a search that ends knowing the number has turn rewards adding up
    to 1 whatever its length, and each turn's is log2(n_k / n_k+1) / log2(15) by hand."""
    counts = []
    for n in range(1, 16):
        p = next(q for q in guess.eval_prompts() if guess.secret(q) == n)
        guesses, lo, hi = [], 1, 15
        while True:
            g = (lo + hi) // 2
            guesses.append(str(g))
            if g == n:
                break
            lo, hi = (g + 1, hi) if n > g else (lo, g - 1)
        counts.append(len(guesses))
        assert guess.outcome(p, guesses) == 1.0
        assert math.isclose(sum(guess.turn_rewards(p, guesses)), 1.0)
    assert sum(counts) == 49 and max(counts) == guess.MAX_TURNS
    p = next(q for q in guess.eval_prompts() if guess.secret(q) == 11)
    # 15 possible; 4 rules out 1-4 (11 left); 4 again nothing; 12 leaves 5-11 (7); 11 is said (1)
    want = [math.log2(15 / 11), 0.0, math.log2(11 / 7), math.log2(7)]
    assert guess.turn_rewards(p, ["4", "4", "12", "11"]) == pytest.approx(
        [w / math.log2(15) for w in want])
    assert guess.outcome(p, ["1", "2", "3", "4", "11"]) == 0.0               # a fifth guess: late
    assert guess.states(p, ["4", "x"]) == [(p,), (p, 4)]


def test_the_demonstrator_leaves_room_and_its_episode_text_round_trips():
    rng, found, turns = random.Random(0), [], []
    for p in guess.eval_prompts():
        d = guess.demonstrator(p, rng)
        found.append(guess.outcome(p, d))
        turns.append(len(d))
        text = guess.episode_text(p, d)
        assert guess.guesses_of(text) == d and guess.reward(p, text) == found[-1]
        assert [piece for piece, env in guess.segments(text) if not env] == d
    assert 0.65 < sum(found) / len(found) < 0.85 and 3.0 < sum(turns) / len(turns) <= 4
    assert guess.demonstration(guess.eval_prompts()[0]) == guess.demonstration(
        guess.eval_prompts()[0])                                                # a fixed draw
    assert not set(guess.eval_prompts()) & set(guess.sample_prompts(random.Random(1), 2000))


# -----------------------------------------------------------------------------
# The estimators against float64 references from their equations

def z(values):
    """(x - mean) / (population std + 1e-6) of a list; zeros when all are equal."""
    if len(set(values)) <= 1:
        return [0.0] * len(values)
    m = sum(values) / len(values)
    s = math.sqrt(sum((v - m) ** 2 for v in values) / len(values))
    return [(v - m) / (s + 1e-6) for v in values]


def reference(credit, episodes, G, gamma, weight):
    """episodes: [(turn rewards, outcome, states)] -> each episode's list of A_k, by the module
    docstring's equations, in plain floats."""
    out = [[0.0] * len(r) for r, _, _ in episodes]
    full = [[x + (o if k == len(r) - 1 else 0.0) for k, x in enumerate(r)] for r, o, _ in episodes]
    R = [[sum(gamma ** (j - k) * f[j] for j in range(k, len(f))) for k in range(len(f))]
         for f in full]
    for g0 in range(0, len(episodes), G):
        rows = range(g0, g0 + G)
        zo = dict(zip(rows, z([episodes[i][1] for i in rows])))
        ze = dict(zip(rows, z([sum(full[i]) for i in rows])))
        for k in range(max(len(episodes[i][0]) for i in rows)):
            reached = [i for i in rows if k < len(episodes[i][0])]
            zr = dict(zip(reached, z([episodes[i][0][k] for i in reached])))
            zR = dict(zip(reached, z([R[i][k] for i in reached])))
            for i in reached:
                out[i][k] = {"outcome": zo[i], "mt_grpo": zr[i] + weight * zo[i],
                             "returns": zR[i]}.get(credit, 0.0)
        if credit == "gigpo":
            by_state = {}
            for i in rows:
                for k, s in enumerate(episodes[i][2]):
                    by_state.setdefault(s, []).append((i, k))
            for turns in by_state.values():
                for (i, k), zs in zip(turns, z([R[i][k] for i, k in turns])):
                    out[i][k] = ze[i] + weight * zs
    return out


def as_tensors(episodes, K):
    B = len(episodes)
    rewards, present = torch.zeros(B, K, **F64), torch.zeros(B, K, dtype=torch.bool)
    states, ids = torch.zeros(B, K, dtype=torch.long), {}
    for i, (r, _, s) in enumerate(episodes):
        rewards[i, :len(r)], present[i, :len(r)] = torch.tensor(r, **F64), True
        states[i, :len(r)] = torch.tensor([ids.setdefault(x, len(ids)) for x in s])
    return rewards, torch.tensor([o for _, o, _ in episodes], **F64), present, states


# two groups of three: unequal lengths; in the first, episodes 0 and 1 share their first two states
# and 2 its first; the second group's outcomes all equal (its turn rewards not)
HAND = [([0.3, 0.2, 1.0], 1.0, ["a", "a8", "a84"]), ([0.3, 0.5], 0.0, ["a", "a8"]),
        ([0.0, 0.4, 0.1, 0.2], 0.0, ["a", "ax", "ax1", "ax12"]),
        ([0.5, 0.5], 1.0, ["b", "b8"]), ([1.0], 1.0, ["b"]),
        ([0.2, 0.2, 0.6], 1.0, ["b", "b3", "b34"])]


@pytest.mark.parametrize("credit", multiturn.CREDITS)
@pytest.mark.parametrize("gamma,weight", [(0.0, 1.0), (1.0, 0.5), (0.9, 2.0)])
def test_each_estimator_is_its_equation(credit, gamma, weight):
    rewards, outcome, present, states = as_tensors(HAND, 4)
    got = multiturn.turn_advantages(credit, rewards, outcome, present, states, 3, gamma, weight)
    want = reference(credit, HAND, 3, gamma, weight)
    for i, row in enumerate(want):
        assert got[i, :len(row)].tolist() == pytest.approx(row, abs=1e-9), (i, got[i], row)
        assert (got[i, len(row):] == 0).all()


@pytest.mark.parametrize("credit", multiturn.CREDITS)
def test_each_estimator_on_random_groups(credit):
    rng = random.Random(credit)
    episodes = []
    for g in range(5):
        for j in range(4):
            n = rng.randint(1, 4)
            prefix = [f"{g}"] + [f"{g}{rng.choice('ab')}" * (k + 1) for k in range(n - 1)]
            episodes.append(([rng.choice([0.0, 0.25, 0.5, 1.0]) for _ in range(n)],
                             float(rng.random() < 0.5), prefix))
    rewards, outcome, present, states = as_tensors(episodes, 4)
    got = multiturn.turn_advantages(credit, rewards, outcome, present, states, 4, 0.8, 0.7)
    for i, row in enumerate(reference(credit, episodes, 4, 0.8, 0.7)):
        assert got[i, :len(row)].tolist() == pytest.approx(row, abs=1e-9)


# verl-agent's gigpo/core_gigpo.py (mode mean_std_norm, the episode term across steps) and
# MT-GRPO's trainer (SiliangZeng/Multi-Turn-RL-Agent, mt_grpo_env_trainer.py), ported: a row a turn

def verl_agent_episode_norm(scores, index, epsilon=1e-6):
    """episode_norm_reward: each row's score is its episode's; mean and std over the group's rows
    (compute_mean_std_cross_steps=True), torch.std; a group of one row: mean 0, std 1."""
    by = {}
    for i, x in zip(index, scores):
        by.setdefault(i, []).append(x)
    stat = {i: ((0.0, 1.0) if len(v) == 1 else (torch.tensor(v, **F64).mean().item(),
                                                  torch.tensor([v], **F64).std().item()))
            for i, v in by.items()}
    return [(x - stat[i][0]) / (stat[i][1] + epsilon) for i, x in zip(index, scores)]


def verl_agent_step_norm(returns, step_groups, epsilon=1e-6):
    """step_norm_reward: over the rows of each anchor state, torch.std; one row: mean itself."""
    by = {}
    for g, x in zip(step_groups, returns):
        by.setdefault(g, []).append(x)
    stat = {g: (torch.tensor(v, **F64).mean().item(), 1.0 if len(v) == 1 else
                torch.tensor([v], **F64).std().item()) for g, v in by.items()}
    return [(x - stat[g][0]) / (stat[g][1] + epsilon) for g, x in zip(step_groups, returns)]


def mt_grpo_trainer_norm(rewards, num_generations):
    """_compute_normalized_advantages: (r - mean) / (std + 1e-4) over each group, torch.std."""
    r = torch.tensor(rewards, **F64).view(-1, num_generations)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1).tolist()


def official_groups(rng, G, n_groups):
    episodes = []
    for g in range(n_groups):
        for _ in range(G):
            n = rng.randint(1, 4)
            prefix = [f"{g}"] + [f"{g}{rng.choice('ab')}" * (k + 1) for k in range(n - 1)]
            episodes.append(([rng.choice([0.0, 0.25, 0.5, 1.0]) for _ in range(n)],
                             float(rng.random() < 0.5), prefix))
    return episodes


@pytest.mark.parametrize("seed", range(4))
def test_official_gigpo_is_verl_agents(seed):
    """--official gigpo against verl-agent's functions on step rows (each turn a row with its
    episode's score, its anchor state and its discounted return): equal in float64, on the
    hand-worked groups and on random ones; the project's own choice differs (Bessel, and the
    episode statistics over turns)."""
    rng = random.Random(seed)
    for episodes, G in ((HAND, 3), (official_groups(rng, 4, 5), 4)):
        rewards, outcome, present, states = as_tensors(episodes, 4)
        gamma, omega = 0.9, 0.7
        got = multiturn.gigpo_advantages(rewards, outcome, present, states, G, gamma, omega,
                                         official=True)
        full = multiturn.with_outcome(rewards, present, outcome)
        R = multiturn.discounted_returns(full, present, gamma)
        rows = [(i, k) for i in range(len(episodes)) for k in range(len(episodes[i][0]))]
        episode = verl_agent_episode_norm([full[i].sum().item() for i, _ in rows],
                                          [i // G for i, _ in rows])
        step = verl_agent_step_norm([R[i, k].item() for i, k in rows],
                                    [int(states[i, k]) for i, k in rows])
        want = [e + omega * s for e, s in zip(episode, step)]
        assert [got[i, k].item() for i, k in rows] == pytest.approx(want, abs=1e-9)
        mine = multiturn.gigpo_advantages(rewards, outcome, present, states, G, gamma, omega)
        assert (mine - got).abs().max() > 1e-3


def test_official_mt_grpo_is_its_trainers():
    """--official mt_grpo against the trainer's assignment on its two-turn setting (a reward on
    the first turn, the outcome alone on the second): A_1 = z(O) + coef z(r_1), A_2 = z(O), with
    its std and eps, here for coef 0.5 and 2; the project's lambda weighs the outcome instead."""
    rng = random.Random(0)
    G, groups = 4, 3
    r1 = [rng.choice([0.0, 0.5, 1.0]) for _ in range(G * groups)]
    o = [float(rng.random() < 0.5) for _ in range(G * groups)]
    episodes = [([a, 0.0], b, ["s", "t"]) for a, b in zip(r1, o)]
    rewards, outcome, present, states = as_tensors(episodes, 2)
    for coef in (0.5, 2.0):
        got = multiturn.mt_grpo_advantages(rewards, outcome, present, G, coef, official=True)
        z_o, z_t = mt_grpo_trainer_norm(o, G), mt_grpo_trainer_norm(r1, G)
        assert got[:, 0].tolist() == pytest.approx([a + coef * b for a, b in zip(z_o, z_t)],
                                                   abs=1e-9)
        assert got[:, 1].tolist() == pytest.approx(z_o, abs=1e-9)
        mine = multiturn.mt_grpo_advantages(rewards, outcome, present, G, coef)
        assert (mine - got).abs().max() > 1e-2


def test_hand_worked_returns_and_gigpo():
    """Group b at gamma 1: r' = [0.5, 1.5], [2.0], [0.2, 0.2, 1.6]; R_0 = 2.0, 2.0, 2.0: z_0 all
    0; R_1 = 1.5, 1.8 over the two that reached turn 1: -1, +1. GiGPO there: episode sums 2, 2, 2
    (z 0); state "b" holds the three turn 0s (R 2, 2, 2: 0); "b8" and "b3" one turn each: 0."""
    rewards, outcome, present, states = as_tensors(HAND, 4)
    R = multiturn.returns_advantages(rewards, outcome, present, 3, gamma=1.0)
    assert R[3:, 0].tolist() == [0.0, 0.0, 0.0]
    assert R[3, 1].item() == pytest.approx(-1.0, abs=1e-5) and R[5, 1].item() == pytest.approx(
        1.0, abs=1e-5)
    A = multiturn.gigpo_advantages(rewards, outcome, present, states, 3, gamma=1.0)
    assert (A[3:] == 0).all()
    # gamma 0: each turn's return is its own r', the discount of later turns nothing
    R0 = multiturn.discounted_returns(multiturn.with_outcome(rewards, present, outcome), present,
                                      0.0)
    assert R0[0].tolist() == pytest.approx([0.3, 0.2, 2.0, 0.0])


def test_the_tokens_of_turn_k_get_turn_ks_advantage_and_the_environments_none():
    """The advantages gathered by each token's turn into agent.py's loss: d loss / d log pi of a
    policy token of turn k is -A_k / (|o_i| B) at ratio 1, beta 0; of an environment token 0."""
    from agent import agent_loss
    turn = torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2]])
    sampled = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]])
    A = torch.tensor([[0.5, -2.0, 3.0, 0.0]], **F64)
    logp = torch.zeros(1, 8, **F64, requires_grad=True)
    loss, _ = agent_loss(logp, logp.detach(), logp.detach(), A.gather(1, turn), sampled.double(),
                         beta=0.0)
    grad, = torch.autograd.grad(loss, logp)
    want = torch.tensor([[0.5, 0.5, 0, 0, -2.0, -2.0, 0, 3.0]], **F64) * sampled / -5
    assert torch.allclose(grad, want)


# eight searches that all find 15 (guess.eval_prompts()[0]): every r' sums to 2 in arithmetic
SEARCHES = [["1", "2", "3", "15"], ["2", "4", "13", "15"], ["1", "2", "4", "15"],
            ["3", "4", "13", "15"], ["1", "2", "5", "15"], ["3", "7", "13", "15"],
            ["1", "2", "6", "15"], ["4", "13", "14", "15"]]


def test_anchor_states_are_what_the_environment_sees_and_each_groups_own():
    """"8", " 8", "08" and "<think>...</think>8" are one state after them, as two unread turns
    are; a state's id is never shared with another group, the same game drawn twice included."""
    p = guess.eval_prompts()[0]
    texts = [["8", "12"], [" 8", "12"], ["08", "12"], ["<think>mid</think>8", "12"],
             ["x", "12"], ["y?", "12"]]
    assert len({tuple(guess.states(p, t)) for t in texts[:4]}) == 1
    assert guess.states(p, texts[4]) == guess.states(p, texts[5]) != guess.states(p, texts[0])
    _, _, present, states = multiturn.judged([p, p], 6, texts * 2, 4, "cpu")
    assert states[:4, 1].unique().numel() == 1 and states[4, 1] == states[5, 1]
    assert states[0, 1] != states[4, 1]
    assert set(states[:6][present[:6]].tolist()).isdisjoint(states[6:][present[6:]].tolist())


def test_groups_equal_in_arithmetic_get_exactly_zero():
    """The environment's float32 turn rewards of these searches sum to 2 within 1e-7, not
    exactly; the episode z and gamma-1 returns were up to 0.114 on two of them, always the same
    paths. Equal within tol * max(1, |x|): 0; a spread at the tolerance is equal, past it not."""
    prompt = guess.eval_prompts()[0]
    assert guess.secret(prompt) == 15
    r, o, present, _ = multiturn.judged([prompt], 8, SEARCHES, 4, "cpu")
    totals = multiturn.with_outcome(r, present, o).sum(1)
    assert totals.max() > totals.min()                       # float32: not equal as stored
    assert torch.equal(multiturn.episode_z(totals, 8), torch.zeros(8))
    assert torch.equal(multiturn.returns_advantages(r, o, present, 8, gamma=1.0)[:, 0],
                       torch.zeros(8))                       # R_0 = 1 + O: 2 for every one
    one, group = torch.ones(2, dtype=torch.bool), torch.zeros(2, dtype=torch.long)
    at = torch.tensor([1.0, 1.0 + 1e-6], **F64)
    past = torch.tensor([1.0, 1.0 + 1.1e-6], **F64)
    assert torch.equal(multiturn.normalise(at, one, group), torch.zeros(2, **F64))
    assert (multiturn.normalise(past, one, group).abs() > 0.3).all()


# -----------------------------------------------------------------------------
# Episodes the sampler plays with the environment

@pytest.fixture(scope="module")
def guess_sft(tmp_path_factory):
    """A small SFT policy of the game (200 steps)."""
    out = tmp_path_factory.mktemp("guess_sft")
    p = run_script("sft.py", ["--task", "guess", "--steps", "200", "--n_layer", "2", "--n_head",
                              "2", "--n_embd", "32", "--eval_n", "16", "--out", str(out)])
    assert p.returncode == 0, p.stderr[-2000:]
    return str(out / "sft.pt")


def test_the_sampler_plays_the_game_by_its_rules(guess_sft):
    """A small SFT policy's sampled episodes: between turns the environment writes what
    guess.feedback says of the turns so far (never in the sampled mask), an episode ends at a
    right guess or after MAX_TURNS, and each turn's tokens carry its index."""
    task.use(task_args("guess"))
    policy, _ = load_checkpoint(guess_sft)
    tok = Tokenizer()
    prompts = guess.eval_prompts()[:6]
    ep = task.episodes(policy, tok, prompts, 3, 1.0, 3, 0, guess.MAX_TURNS,
                       generator=torch.Generator().manual_seed(1))
    texts = task.turn_texts(ep, tok)
    for i, turns in enumerate(texts):
        p, row = prompts[i // 3], ep.tokens[i][ep.mask[i] > 0].tolist()
        env = [t for t, s in zip(row, ep.sampled[i][ep.mask[i] > 0].tolist()) if not s]
        want = [t for k in range(len(turns) - 1)
                for t in tok.encode(guess.feedback(p, turns[:k + 1]))]
        assert env == want, (turns, tok.decode(env))
        assert len(turns) <= guess.MAX_TURNS
        found = [k for k, t in enumerate(turns) if guess.parse_guess(t) == guess.secret(p)]
        if found:
            assert found[0] == len(turns) - 1                 # it ends at the right guess
        assert ep.turn[i][ep.mask[i] > 0].tolist() == sorted(ep.turn[i][ep.mask[i] > 0].tolist())
    assert (ep.mask - ep.sampled).sum() > 0 and max(len(t) for t in texts) > 1


# -----------------------------------------------------------------------------
# The script

FLAGS = ["--prompts_per_step", "4", "--group_size", "4", "--log_every", "1", "--eval_every", "2",
         "--eval_n", "16"]


@pytest.mark.slow
def test_script_runs_end_to_end_and_resumes(guess_sft, tmp_path):
    out = str(tmp_path)
    p = run_script("multiturn.py", FLAGS + ["--steps", "2", "--credit", "gigpo", "--init",
                                            guess_sft, "--out", out], fresh=True)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "multi-turn (gigpo credit)" in p.stdout and "done: 2 steps" in p.stdout
    rows = [json.loads(line) for line in open(os.path.join(out, "multiturn", "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in ("found", "turns", "turn_reward", "kl_exact", "entropy", "advantage_abs",
                "grad_norm", "clip_frac", "sampler_logp_diff"):
        assert math.isfinite(rows[1][key]), key
    for key in ("eval_found", "eval_turns", "eval_turns_found", "eval_accuracy"):
        assert key in rows[0] and key in rows[2], key
    assert rows[0]["eval_found"] == rows[0]["eval_accuracy"]            # the same verdict
    assert 1 <= rows[1]["turns"] <= guess.MAX_TURNS and rows[1]["sampler_logp_diff"] < 1e-4
    assert rows[1]["entropy"] > 0            # measured from the loss forward (Scored.measure)
    p = run_script("multiturn.py", FLAGS + ["--steps", "3", "--credit", "gigpo", "--init",
                                            guess_sft, "--out", out, "--resume"])
    assert p.returncode == 0 and "resuming from" in p.stdout, p.stderr[-2000:]
    assert load_checkpoint(os.path.join(out, "multiturn.pt"))[1]["step"] == 3


@pytest.mark.parametrize("layout", ["episode", "steps"])
def test_batch_invariant_makes_the_episodes_log_probs_the_trainers(layout, guess_sft, tmp_path):
    p = run_script("multiturn.py", FLAGS + ["--steps", "2", "--credit", "returns", "--init",
                                            guess_sft, "--out", str(tmp_path), "--layout",
                                            layout, "--batch_invariant"])
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in open(tmp_path / "multiturn" / "metrics.jsonl")]
    assert [r["sampler_logp_diff"] for r in rows[1:]] == [0.0, 0.0]
    assert [r["sampler_kl"] for r in rows[1:]] == [0.0, 0.0]            # over the whole support


def test_bad_input_is_one_line(guess_sft, tmp_path):
    refuses_all("multiturn.py", [(["--gamma", "1.5"], ["--gamma", "1.5"]),
                                 (["--init", guess_sft, "--max_new_tokens", "20"],
                                  ["--max_new_tokens 20 does not fit", "4 attempts of it"]),
                                 (["--gamma", "-0.1"], ["--gamma"]),
                                 (["--credit", "vapo"], ["--credit", "vapo"]),
                                 (["--task", "arithmetic"], ["--task arithmetic",
                                                             "allowed: --task guess"]),
                                 (["--chat", "--tools", "calculator"],
                                  ["--tools calculator", "this script has neither"]),
                                 (["--format", "r1"], ["--format r1", "plain format only"])],
                tmp_path)
    for script in ("grpo.py", "dpo.py", "self_distill.py", "search.py"):   # a game with no answers
        refuses_all(script, [(["--task", "guess"], ["--task guess needs its environment"])],
                    tmp_path)
    assert not os.path.exists(os.path.join(ROOT, "out", "guess", "multiturn"))


# -----------------------------------------------------------------------------
# The game in a chat template (--chat)

@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_in_a_chat_template_the_episode_is_the_demonstrations_layout(name):
    """Each guess an assistant turn, each answer a user turn: a demonstration's pieces are the
    template's render of the whole conversation (through the last end of turn), and between two
    turns the environment writes
    exactly what the demonstration has there (the template's user turn and its next opening)."""
    task.use(task_args("guess", chat=True))
    tok = Tokenizer.from_pretrained(os.path.join(ROOT, "tests", "golden", name)).use_chat(
        "2024-07-26")
    env = task.environment(0, tok)
    for p in guess.eval_prompts()[:8]:
        messages = task.demonstration(p)
        head, pieces = chat.demonstration(tok, p, messages)
        user = [{"role": "user", "content": p}]
        ids = head + [t for piece, _ in pieces for t in piece]
        full = tok.chat.encode(user + messages, tok.encode_special, tok.encode,
                               add_generation_prompt=False)
        assert full[:len(ids)] == ids and len(full) - len(ids) <= 1   # ChatML's last newline
        assert head == tok.encode_prompt(p)
        turns = [m["content"] for m in messages if m["role"] == "assistant"]
        between = [piece for piece, by_env in pieces if by_env]
        assert between == [env.feedback(p, turns[:k + 1]) for k in range(len(turns) - 1)]
        for piece, by_env in pieces:
            if not by_env:
                assert piece[-1] == tok.eos_id                  # a turn ends with its end token


@pytest.mark.slow
def test_the_chat_protocol_end_to_end(tmp_path):
    out = str(tmp_path)
    p = run_script("sft.py", ["--task", "guess", "--chat", "--steps", "60", "--n_layer", "1",
                              "--n_head", "2", "--n_embd", "32", "--eval_n", "8", "--out", out])
    assert p.returncode == 0, p.stderr[-2000:]
    for layout in ("episode", "steps"):                 # steps: each turn its own row
        p = run_script("multiturn.py", FLAGS + ["--steps", "2", "--chat", "--layout", layout,
                                                "--init", os.path.join(out, "sft.pt"), "--out",
                                                os.path.join(out, layout)])
        assert p.returncode == 0, p.stderr[-2000:]
        rows = [json.loads(line)
                for line in open(os.path.join(out, layout, "multiturn", "metrics.jsonl"))]
        assert [r["step"] for r in rows] == [0, 1, 2] and rows[1]["sampler_logp_diff"] < 1e-4
        assert 1 <= rows[1]["turns"] <= guess.MAX_TURNS and math.isfinite(rows[1]["loss"])


# -----------------------------------------------------------------------------
# Step-wise samples (--layout steps): each turn's prompt as the template renders the game then

GAME_STEPS = json.load(open(os.path.join(ROOT, "tests", "golden", "game_steps.json")))


@pytest.mark.parametrize("case", sorted(GAME_STEPS))
def test_each_steps_prompt_is_transformers_apply_chat_template(case):
    """The ids of each turn's prompt of a game against transformers' apply_chat_template (written
    by tests/golden/make_golden.py --game) on the Llama 3 and Qwen3 folders, and with a template
    that drops earlier reasoning as Qwen3's does: there the prompt of a later turn is not the
    earlier one with the new turns appended, and the step layout trains on what was read."""
    name, template = case.split("/")
    tok = Tokenizer.from_pretrained(os.path.join(ROOT, "tests", "golden", name))
    if template != "own":
        source = open(os.path.join(ROOT, "tests", "golden", "templates", template)).read()
        tok.template = (source, *tok.template[1:])
    tok = tok.use_chat("2024-07-26")
    task.use(task_args("guess", chat=True))
    env, appended, previous = task.environment(0, tok), True, []
    for k, step in enumerate(GAME_STEPS[case]):
        prompt = step["messages"][0]["content"]
        turns = [m["content"] for m in step["messages"] if m["role"] == "assistant"]
        ids = multiturn.step_prompt(tok, prompt, turns)
        assert ids == step["ids"], (case, k)
        if k:           # the episode as sampled: the last prompt, the turn, its end, the answer
            appended &= ids == previous + tok.encode(turns[-1]) + [tok.eos_id] + env.feedback(
                prompt, turns)
        previous = ids
    assert appended == (template == "own")


def test_a_template_whose_history_outgrows_the_context_is_refused_in_the_step_layout(tmp_path):
    """A template that writes older messages 8 times: the episode (the prompt, the turns appended)
    fits 200 positions, but the last turn's step prompt, the game rendered again, is 346 tokens.
    Refused before any work, in one line; and in the loop, a game whose turns outgrow what that
    probe read stops in the same line (here, a policy that ends each turn at once: turn 2, its
    prompt one token past the bound)."""
    folder, out = growing_folder(tmp_path / "grow", 200), tmp_path / "out"
    p = run_script("multiturn.py", ["--chat", "--layout", "steps", "--init", folder, "--steps",
                                    "1", "--out", str(out)])
    refused(p, "--layout steps: turn 4's prompt", "is 346 tokens", "context of 200",
            "allowed: a context of 349")
    assert not out.exists()
    task.use(task_args("guess", chat=True))
    tok = Tokenizer.from_pretrained(folder).use_chat("2026-01-01")
    policy = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=200, n_layer=1, n_head=1,
                           n_embd=8, tie_embeddings=False))
    with torch.no_grad():                   # every position's greedy token: a stop id
        policy.ln_f.weight.zero_()
        policy.ln_f.bias.fill_(1.0)
        policy.lm_head.weight.zero_()
        policy.lm_head.weight[next(iter(tok.stop_ids))] = 1.0
    with pytest.raises(SystemExit, match=r"^error: --layout steps: turn 2's prompt, .* is 198 "
                                         r"tokens, .* allowed: a context of 201"):   # one past
        multiturn.step_rows(policy, tok, task.eval_prompts()[:1], 1, 0.0, 3, guess.MAX_TURNS)
    multiturn.check_step_prompt(197, 2, 3, 200)                                   # the bound


def layouts(tok, prompt, texts):
    """The same game as one episode row and as a row per turn (multiturn.Rows), built from its
    texts: the turns' ids, each ended by the end token, the environment's answers between."""
    env = task.environment(0, tok)
    ids, sampled, turn = [], [], []
    for k, text in enumerate(texts):
        piece = tok.encode(text) + [tok.eos_id]
        ids, sampled, turn = ids + piece, sampled + [1.0] * len(piece), turn + [k] * len(piece)
        said = env.feedback(prompt, texts[:k + 1]) if k + 1 < len(texts) else None
        said = tok.encode(said) if isinstance(said, str) else said or []
        ids, sampled, turn = ids + said, sampled + [0.0] * len(said), turn + [k + 1] * len(said)
    whole = (torch.tensor([tok.encode_prompt(prompt)]), torch.ones(1, len(tok.encode_prompt(
        prompt))), torch.tensor([ids]), torch.ones(1, len(ids)), torch.tensor([sampled]),
        torch.tensor([turn]))
    steps = []
    for k, text in enumerate(texts):
        p = multiturn.step_prompt(tok, prompt, texts[:k])
        piece = tok.encode(text) + [tok.eos_id]
        steps.append((torch.tensor([p]), torch.ones(1, len(p)), torch.tensor([piece]),
                      torch.ones(1, len(piece)), torch.ones(1, len(piece)),
                      torch.full((1, len(piece)), k)))
    return whole, steps


@pytest.mark.parametrize("chat_protocol", [False, True])
def test_the_step_and_episode_layouts_give_one_gradient_where_the_template_appends(
        chat_protocol):
    """bytes' compact protocol and bytes-chat's ChatML only append: a turn's prompt re-rendered is
    the episode up to it, so the loss over the turns as rows (each normalised by its episode's
    |o_i|) has the gradient of the loss over the episode as one row."""
    from agent import agent_loss
    task.use(task_args("guess", chat=chat_protocol))
    tok = Tokenizer("bytes-chat").use_chat("2026-01-01") if chat_protocol else Tokenizer()
    torch.manual_seed(0)
    policy = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=256, n_layer=1, n_head=2,
                           n_embd=32)).double()
    prompt = guess.eval_prompts()[5]
    texts = ["8", "x", "12", "13"]
    A = torch.tensor([[0.7, -1.3, 0.2, 2.0]], **F64)
    whole, steps = layouts(tok, prompt, texts)
    o = whole[4].sum()

    def grad(rows, lengths):
        policy.zero_grad()
        total = 0.0
        for (p, pm, t, m, s, turn), n in zip(rows, lengths):
            logp = completion_logprobs(policy, p, pm.double(), t, m.double(), 0.7)
            total = total + agent_loss(logp, logp.detach(), logp.detach() + 0.1,
                                       A.gather(1, turn.clamp(max=3)), s.double(), beta=0.3,
                                       num_seqs=1, lengths=n)[0]
        total.backward()
        return torch.cat([q.grad.flatten() for q in policy.parameters()])
    one = grad([whole], [o[None]])
    by_turn = grad(steps, [o[None]] * len(steps))
    assert torch.allclose(one, by_turn, rtol=1e-5, atol=1e-7), (one - by_turn).abs().max()
    own = grad(steps, [None] * len(steps))             # each turn normalised by its own tokens
    assert not torch.allclose(one, own, rtol=1e-2, atol=1e-5)
    for k in range(1, len(texts)):          # each turn's prompt is the episode up to that turn
        start = next(j for j, (t, s) in enumerate(zip(whole[5][0].tolist(), whole[4][0].tolist()))
                     if t == k and s)
        assert steps[k][0][0].tolist() == whole[0][0].tolist() + whole[2][0][:start].tolist()


def test_step_rows_are_sampled_from_each_turns_prompt(guess_sft):
    """--layout steps: a row a turn, its prompt the step prompt of the game's turns before it, its
    tokens the turn ended by a stop id (or cut, which ends the episode); rows grouped by episode
    in turn order."""
    task.use(task_args("guess"))
    policy, _ = load_checkpoint(guess_sft)
    tok = Tokenizer()
    prompts = guess.eval_prompts()[:4]
    rows = multiturn.step_rows(policy, tok, prompts, 2, 1.0, 3, guess.MAX_TURNS,
                               torch.Generator().manual_seed(0))
    seen = {}
    for r in range(len(rows.tokens)):
        i, k = int(rows.episode[r]), int(rows.turn[r, 0])
        assert k == seen.get(i, -1) + 1
        seen[i] = k
        p = rows.prompt[r][rows.prompt_mask[r] > 0].tolist()
        assert p == multiturn.step_prompt(tok, prompts[i // 2], rows.texts[i][:k])
        ids = rows.tokens[r][rows.mask[r] > 0].tolist()
        assert tok.decode([t for t in ids if t not in tok.stop_ids]) == rows.texts[i][k]
        assert ids[-1] in tok.stop_ids or k == len(rows.texts[i]) - 1
    assert [seen[i] + 1 for i in sorted(seen)] == [len(t) for t in rows.texts]
    assert (rows.logp[rows.mask > 0] < 0).all() and max(len(t) for t in rows.texts) > 1


def test_history_windows_and_summarises_a_turns_prompt():
    """--history k: the prompt then the last k turns with their answers (an answer reads its own
    guess); 0: the prompt alone; summary: the prompt rewritten with the range still possible;
    full (None): every turn. By hand on one game."""
    tok = Tokenizer()
    prompt = next(p for p in guess.eval_prompts() if guess.secret(p) == 11)
    turns = ["8", "12", "x"]                           # higher, lower, unread
    full = multiturn.step_prompt(tok, prompt, turns)
    assert tok.decode(full).endswith("8" + tok.decode([tok.eos_id]) + "> 12"
                                     + tok.decode([tok.eos_id]) + "< x" + tok.decode([tok.eos_id])
                                     + "? ")
    assert multiturn.step_prompt(tok, prompt, turns, 3) == full
    last = multiturn.step_prompt(tok, prompt, turns, 1)
    assert last == tok.encode_prompt(prompt) + tok.encode("x") + [tok.eos_id] + tok.encode("? ")
    assert multiturn.step_prompt(tok, prompt, turns, 0) == tok.encode_prompt(prompt)
    said = guess.summary(prompt, turns)
    assert said == prompt.replace("1-15", "9-11")      # 8 too low, 12 too high, x read as nothing
    assert multiturn.step_prompt(tok, prompt, turns, "summary") == tok.encode_prompt(said)
    assert guess.summary(prompt, []) == prompt and guess.summary("no game", ["3"]) == "no game"


def test_history_bad_input_is_one_line(tmp_path):
    refuses_all("multiturn.py", [(["--layout", "steps", "--history", "-1"], ["--history -1"]),
                                 (["--layout", "steps", "--history", "5"],
                                  ["--history 5", "0 to 4"]),
                                 (["--history", "1"], ["--history 1 needs --layout steps"])],
                tmp_path)
