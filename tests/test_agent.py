"""agent.py and the episodes it trains on (task.episodes): a scripted policy's calls answered and
placed where they belong; the mask over the policy's tokens (zero gradient on every position the
environment wrote, a reply that tokenises differently inside the sequence than alone); rewards,
SCoRe's shaping and per-attempt advantages by hand; the loss against a float64 reference; the script
end to end, resumed, with its two study flags."""
import contextlib
import json
import math
import os
import random
import re
import shutil
from types import SimpleNamespace

import pytest
import tiktoken
import torch

import episode
import task
from agent import agent_loss, batch_std, episode_rewards, grpo_advantages
from conftest import ROOT, refuses_all, run_script, task_args
from hf.checkpoint import load_checkpoint
from hf.tokenizer import Tokenizer
from kernels import invariant, logprobs
from model import GPT, GPTConfig, completion_logits, completion_logprobs
from plumbing import Run
from plumbing.loading import load_model
from tasks import toolcalc


@pytest.fixture(autouse=True)
def toolcalc_task():
    task.use(task_args("toolcalc"))


class Scripted(torch.nn.Module):
    """A policy that puts all its probability on the token respond(text so far) names (None: EOS),
    whatever it was fed: the prompt, its own tokens or the environment's. It reads what the sampler
    feeds it, so it sees the replies."""

    def __init__(self, tok, respond):
        super().__init__()
        self.tok, self.respond, self.config = tok, respond, GPTConfig(vocab_size=tok.vocab_size)
        self.dummy = torch.nn.Parameter(torch.zeros(1))          # the device

    def hidden(self, idx, mask=None, cache=None):   # the sampler's call; logits() reads its logits
        self.out = self.forward(idx, mask, cache)
        return torch.zeros(*self.out.shape[:-1], 1)

    def logits(self, h, *args, **kwargs):
        return self.out

    def forward(self, idx, mask=None, cache=None):
        if cache.length == 0:                                   # the prompts
            self.history = [[t for t, m in zip(r, mr) if m > 0]
                            for r, mr in zip(idx.tolist(), mask.tolist())]
        else:
            for h, t in zip(self.history, idx[:, -1].tolist()):
                h.append(t)
        cache.length += idx.size(1)
        logits = torch.zeros(idx.size(0), idx.size(1), self.tok.vocab_size)
        for i, h in enumerate(self.history):
            nxt = self.respond(self.tok.decode(h))
            logits[i, -1, self.tok.eos_id if nxt is None else self.tok.encode(nxt)[0]] = 100.0
        return logits


def replies(episode):
    """The environment's replies in an episode's text: what follows each call's '>'."""
    return re.findall(r"(?<=>)(?:-?[0-9]+|error)", episode)


def writer(*parts):
    """A scripted policy that writes `parts` in order (None: an EOS), skipping past what the
    environment writes: a part is text, or a function of the episode's text so far (after the
    prompt's '=')."""
    def respond(text):
        episode = text.partition("=")[2]
        # an attempt's own EOS
        episode = episode.replace("<|endoftext|>" + toolcalc.REVISE, toolcalc.REVISE)
        # the revision prompt
        own = re.sub(re.escape(toolcalc.REVISE) + r"[0-9+\-*]+=", "\0", episode)
        own = re.sub(r"(?<=>)(?:-?[0-9]+|error)", "", own)                       # the policy's text
        target = "".join("\0" if p is None else p(episode) if callable(p) else p for p in parts)
        if not target.startswith(own) or len(own) == len(target):
            return None
        return None if target[len(own)] == "\0" else target[len(own)]
    return respond


def after_reply(episode):
    """'#' and the environment's last reply."""
    return "#" + replies(episode)[-1] if replies(episode) else ""


def decode(tok, e, i, which):
    return tok.decode(e.tokens[i][which[i] > 0].tolist())


# -----------------------------------------------------------------------------
# Episodes

def test_a_scripted_call_is_answered_and_each_token_is_marked_by_who_wrote_it():
    tok = Tokenizer()
    policy = Scripted(tok, writer(lambda e: "<37+12*46>", after_reply))
    e = task.episodes(policy, tok, ["37+12*46="], group_size=2, temperature=1.0)
    assert tok.decode(e.tokens[0][e.mask[0] > 0].tolist()) == "<37+12*46>589#589<|endoftext|>"
    assert e.sampled[0].tolist() == [1.0] * 10 + [0.0] * 3 + [1.0] * 5    # 589 is the environment's
    assert decode(tok, e, 0, e.sampled) == "<37+12*46>#589<|endoftext|>"
    assert decode(tok, e, 0, e.mask - e.sampled) == "589"
    assert e.correct.tolist() == [[1.0], [1.0]] and e.calls.tolist() == [[1.0], [1.0]]
    assert e.malformed.sum() == 0 and not e.truncated.any() and e.turn.max() == 0
    assert torch.equal(e.prompt[0], e.prompt[1]) and e.prompt_mask.sum() == 2 * len("37+12*46=")


def test_rows_of_different_lengths_two_calls_and_a_head_computation_in_one_batch():
    tok = Tokenizer()

    def respond(text):
        if text.startswith("3+4*2="):                           # in the head, no call
            return writer("4*2=8,3+8=11#11")(text)
        return writer("<12*46>", lambda e: "<37+" + (replies(e) or ["?"])[0] + ">",
                      after_reply)(text)
    e = task.episodes(Scripted(tok, respond), tok, ["37+12*46=", "3+4*2="], temperature=0.0)
    assert decode(tok, e, 0, e.mask) == "<12*46>552<37+552>589#589<|endoftext|>"
    assert decode(tok, e, 0, e.mask - e.sampled) == "552589"
    assert (decode(tok, e, 1, e.mask) == "4*2=8,3+8=11#11<|endoftext|>"
            and (e.mask[1] == e.sampled[1]).all())
    assert e.calls.tolist() == [[2.0], [0.0]] and e.correct.tolist() == [[1.0], [1.0]]
    assert e.mask[1, len("4*2=8,3+8=11#11") + 1:].sum() == 0                 # padding after the EOS


def test_malformed_calls_unclosed_calls_and_the_call_budget():
    tok = Tokenizer()
    e = task.episodes(Scripted(tok, writer("<12/4>", "#3")), tok, ["37+12*46="], temperature=0.0)
    assert decode(tok, e, 0, e.mask) == "<12/4>error#3<|endoftext|>"
    assert (e.calls.tolist() == [[1.0]] and e.malformed.tolist() == [[1.0]]
            and e.correct.tolist() == [[0.0]])
    e = task.episodes(Scripted(tok, writer("<12*46")), tok, ["37+12*46="], temperature=0.0)
    assert decode(tok, e, 0, e.mask) == "<12*46<|endoftext|>" and e.malformed.tolist() == [[1.0]]
    calls = writer("<1+1>", "<2+2>", "<3+3>", after_reply)
    e = task.episodes(Scripted(tok, calls), tok, ["37+12*46="], temperature=0.0, max_calls=2)
    assert decode(tok, e, 0, e.mask) == "<1+1>2<2+2>4<3+3>error#error<|endoftext|>"
    assert e.calls.tolist() == [[3.0]] and e.malformed.tolist() == [[1.0]]
    e = task.episodes(Scripted(tok, writer("<9*9>", after_reply)), tok, ["37+12*46="],
                      temperature=0.0, max_new_tokens=8)
    assert decode(tok, e, 0, e.mask) == "<9*9>81#" and e.truncated.all()  # 8 tokens, reply included


def test_every_stop_id_ends_an_attempt_as_sampled_and_no_added_token_is_a_call_marker():
    """A real checkpoint's tokenizer (the Qwen3 folder: stop ids <|im_end|> and <|endoftext|>, added
    tokens such as <|im_start|> and <tool_call> whose text holds '<' and '>'): its second stop id
    ends the attempt and stays in the episode as sampled (it used to be written as an ordinary token
    and sampling ran on), and <|im_start|> does not close a call."""
    tok = Tokenizer.from_pretrained(os.path.join(os.path.dirname(__file__), "golden", "qwen3"))
    assert len(tok.stop_ids) == 2 and tok.stop_ids[1] != tok.eos_id
    opens, closes = (episode._holding(tok, toolcalc.CALL_OPEN),
                     set(episode._holding(tok, toolcalc.CALL_CLOSE)))
    assert (not (set(opens) | closes) & tok.added_ids
            and tok.encode_special("<|im_start|>")[0] in tok.added_ids)
    assert tok.encode("<")[0] in opens and tok.encode(">")[0] in closes
    env = task.environment(max_calls=2)
    for stop in tok.stop_ids:
        e = episode._Episode(turns=1)
        for s in tok.encode("1#5") + [stop] + tok.encode("2"):
            episode._advance(e, s, tok, env, closes, [], 1, 36)
        assert e.done and e.ids == tok.encode("1#5") + [stop] and e.who[-1] == episode._POLICY
    e = episode._Episode(turns=1)
    for s in tok.encode("<1+1") + tok.encode_special("<|im_start|>") + tok.encode("#2"):
        episode._advance(e, s, tok, env, closes, [], 1, 36)
    assert e.calls == [0] and not e.queue      # no call closed, nothing of the environment's queued


def test_without_the_tool_no_call_is_ever_opened():
    tok = Tokenizer()
    e = task.episodes(Scripted(tok, writer("<37+12*46>", after_reply)), tok, ["37+12*46="], 4, 1.0,
                      tool=False, max_new_tokens=12)
    assert not (e.tokens == tok.encode("<")[0]).any()
    assert e.calls.sum() == 0 and (e.mask == e.sampled).all()


def test_two_attempts_the_first_eos_is_the_policys_and_the_revision_prompt_follows_it():
    """The EOS that ends the first attempt is the policy's token, of the first attempt (trained:
    "stop here" gets its gradient and KL term as every other decision does); the environment's
    revision prompt (REVISE and the problem again) comes after it."""
    tok = Tokenizer()
    policy = Scripted(tok, writer("12*46=562,37+562=599#599", None, "<37+12*46>", after_reply))
    e = task.episodes(policy, tok, ["37+12*46="], temperature=0.0, turns=2)
    first = "12*46=562,37+562=599#599"
    revise = "\nrevise:37+12*46="
    assert decode(tok, e, 0,
                  e.mask) == first + "<|endoftext|>" + revise + "<37+12*46>589#589<|endoftext|>"
    assert decode(tok, e, 0, e.mask - e.sampled) == revise + "589"
    assert e.correct.tolist() == [[0.0, 1.0]] and e.calls.tolist() == [[0.0, 1.0]]
    n = len(first)
    assert (e.tokens[0, n] == tok.eos_id and e.sampled[0, n] == 1
            and e.turn[0, n] == 0)                                         # the policy's, attempt 1
    assert e.turn[0, :n + 1].eq(0).all() and e.turn[0, n + 1:int(e.mask.sum())].eq(1).all()
    assert (e.tokens[0, :int(e.mask.sum())] == tok.eos_id).sum() == 2


def test_a_two_attempt_demonstration_trains_the_first_attempts_eos():
    """SFT's two-attempt demonstrations as the episodes are: the first attempt, its EOS (a target),
    the revision prompt (context), the second attempt and its EOS."""
    tok = Tokenizer()
    first, second = "12*46=562,37+562=599#599", "<37+12*46>589#589"
    revise = toolcalc.revision("37+12*46=")
    tokens, attn, mask = task.completion_batch(["37+12*46="], [first + revise + second], tok)
    ids = tokens[0, len("37+12*46="):].tolist()
    assert tok.decode(ids) == first + "<|endoftext|>" + revise + second + "<|endoftext|>"
    targets = mask[0, len("37+12*46=") - 1:].tolist()                  # target t+1 of each position
    # the first EOS is a target
    assert targets[len(first)] == 1.0 and ids[len(first)] == tok.eos_id
    assert targets[len(first) + 1:len(first) + 1 + len(revise)] == [0.0] * len(revise)
    assert targets[len(first) + 1 + len(revise)] == 1.0           # the second attempt's first token


def merging_tokenizer():
    """The byte tokenizer and one merge, '9#': a reply '589' then the policy's '#' re-tokenise as 5,
    8, '9#'."""
    tok = Tokenizer()
    ranks = {bytes([i]): i for i in range(256)}
    ranks[b"9#"] = 256
    tok.enc = tiktoken.Encoding(name="bytes+9#", pat_str=r"[\s\S]{1,256}", mergeable_ranks=ranks,
                                special_tokens={"<|endoftext|>": 257, "<|pad|>": 258})
    tok.eos_id, tok.pad_id, tok.vocab_size, tok.stop_ids = 257, 258, 259, (257,)
    return tok


def test_a_reply_that_tokenises_differently_in_the_sequence_cannot_shift_the_mask():
    tok = merging_tokenizer()
    e = task.episodes(Scripted(tok, writer("<37+12*46>", after_reply)), tok, ["37+12*46="],
                      temperature=0.0)
    ids = e.tokens[0][e.mask[0] > 0].tolist()
    assert ids == (tok.encode("<37+12*46>") + tok.encode("589") + tok.encode("#")
                   + tok.encode("589") + [tok.eos_id])
    assert tok.encode(tok.decode(ids[:-1])) != ids[:-1]             # re-tokenised, '9#' would merge
    assert e.sampled[0, :len(ids)].tolist() == [1.0] * 10 + [0.0] * 3 + [1.0] * 5
    assert e.correct.tolist() == [[1.0]]


# -----------------------------------------------------------------------------
# The mask in the loss: zero gradient where the environment wrote

def test_every_position_the_environment_wrote_gets_exactly_zero_gradient():
    tok = Tokenizer()
    policy = Scripted(tok, writer("12*46=562,37+562=599#599", None, "<37+12*46>", after_reply))
    e = task.episodes(policy, tok, ["37+12*46="] * 3, temperature=0.0, turns=2)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=96, n_layer=1, n_head=2, n_embd=16))
    advantages = torch.tensor([[1.0], [-0.5], [2.0]]).expand_as(e.mask)
    env = (e.mask - e.sampled) > 0
    for loss_mask, env_grad in ((e.sampled, False), (e.mask, True)):   # the right mask; the pitfall
        logits = completion_logits(model, e.prompt, e.prompt_mask, e.tokens,
                                   e.mask).detach().requires_grad_(True)
        logp = logprobs(logits, e.tokens)
        with torch.no_grad():
            old, ref = logp + 0.1 * torch.randn_like(logp), logp + 0.2 * torch.randn_like(logp)
        loss, _ = agent_loss(logp, old, ref, advantages, loss_mask)
        loss.backward()
        per_position = logits.grad.abs().sum(-1)                                # (B, Tn)
        assert env.sum() == 3 * (len(toolcalc.revision("37+12*46=")) + 3)
        assert (per_position[env] > 0).all() if env_grad else (per_position[env] == 0).all()
        assert (per_position[e.sampled > 0] > 0).all() and (per_position[e.mask == 0] == 0).all()
    model.zero_grad()                           # and through the model: the same loss, every weight
    logp = logprobs(completion_logits(model, e.prompt, e.prompt_mask, e.tokens, e.mask), e.tokens)
    agent_loss(logp, logp.detach(), logp.detach(), advantages, e.sampled)[0].backward()
    assert all(p.grad is not None for p in model.parameters())


# -----------------------------------------------------------------------------
# Rewards, advantages, the loss

def test_rewards_call_cost_and_scores_shaping_by_hand():
    correct = torch.tensor([[1.0], [0.0], [1.0]])
    calls = torch.tensor([[1.0], [0.0], [2.0]])
    assert episode_rewards(correct, calls, 0.1, 1.0)[:,
                                                     0].tolist() == pytest.approx([0.9, 0.0, 0.8])
    correct = torch.tensor([[0.0, 1.0], [1.0, 1.0], [1.0, 0.0],
                            [0.0, 0.0]])                           # wrong->right, right->right, ...
    calls = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    r = episode_rewards(correct, calls, 0.1, 2.0)
    assert r[:, 0].tolist() == pytest.approx([0.0, 0.9, 1.0, -0.1])      # r_1 = right_1 - c calls_1
    assert r[:, 1].tolist() == pytest.approx([2.9, 1.0,
                                              -2.0, -0.1])   # r_2 = right_2 + alpha (.) - c calls_2


def test_each_attempts_tokens_take_their_attempts_advantage():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0], [1.0, 1.0]])  # two groups of G = 2
    adv = torch.stack([grpo_advantages(rewards[:, k], 2) for k in range(2)], 1)
    assert torch.allclose(adv, torch.tensor([[1.0, -1.0], [-1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]),
                          atol=1e-5)
    turn = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]])
    assert torch.allclose(adv.gather(1, turn)[:2], torch.tensor([[1.0, 1, -1, -1], [-1, 1, 1, 1]]),
                          atol=1e-5)


def test_an_episode_that_never_reached_the_second_attempt_stays_out_of_its_group_statistics():
    """A group of 4 where episode 3 ran out of tokens in its first attempt (its attempt-2 reward is
    a 0 it never earned): attempt 2's mean and std are the other three's (float64 by hand), episode
    3 gets 0 there; a group with one present member, or equal rewards among the present ones, gets
    0; present=None is the plain group."""
    # two groups of G = 4, attempt 2's rewards
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 5.0, 1.0])
    present = torch.tensor([True, True, True, False, True, True, False, False])
    got = grpo_advantages(r, 4, present=present)
    x = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    want = (x - x.mean()) / (x.std(unbiased=False) + 1e-6)
    assert torch.allclose(got[:3].double(), want, atol=1e-6) and got[3] == 0
    assert got[4:].tolist() == [0.0, 0.0, 0.0, 0.0]                 # equal among the present (2, 2)
    one = grpo_advantages(torch.tensor([3.0, 0.0]), 2, present=torch.tensor([True, False]))
    assert one.tolist() == [0.0, 0.0]
    plain = torch.tensor([1.0, 0.0, 1.0, 0.5])
    assert torch.allclose(grpo_advantages(plain, 4, present=torch.ones(4, dtype=torch.bool)),
                          grpo_advantages(plain, 4))


def test_the_steps_std_keeps_the_call_cost_small_where_a_groups_std_makes_it_plus_or_minus_one():
    """Two groups of G = 4 (call cost 0.1): in the first every answer is right and two called (0.9,
    1, 0.9, 1), in the second one right answer with a call among wrong ones (0.9, 0, 0, 0). Dividing
    by a group's own std gives the cost-only group +-1, as large as the right answer's; the step's
    std (population, float64 by hand) leaves it a tenth of the right answer's; scale 1 leaves r -
    mean. batch_std matches the hand value, and over present rows."""
    r = torch.tensor([0.9, 1.0, 0.9, 1.0, 0.9, 0.0, 0.0, 0.0])
    group = grpo_advantages(r, 4)
    assert torch.allclose(group[:4], torch.tensor([-1.0, 1.0, -1.0, 1.0]), atol=1e-4)
    assert torch.allclose(group[4:], torch.tensor([3 ** 0.5, -3 ** -0.5, -3 ** -0.5, -3 ** -0.5]),
                          atol=1e-4)
    x = r.double()
    s = ((x - x.mean()) ** 2).mean().sqrt()
    # one process
    run = SimpleNamespace(all_sum=lambda v: v if torch.is_tensor(v) else torch.tensor(float(v)))
    run.mean = lambda x, mask=None: Run.mean(run, x, mask)    # plumbing's, as agent.py's run has it
    assert batch_std(run, r) == pytest.approx(s.item(), rel=1e-6)
    batch = grpo_advantages(r, 4, scale=batch_std(run, r))
    want = torch.cat([x[:4] - x[:4].mean(), x[4:] - x[4:].mean()]) / (s + 1e-6)
    assert torch.allclose(batch.double(), want, atol=1e-6)
    # the call cost a tenth of a right answer
    assert batch[1] / batch[4] == pytest.approx(0.05 / 0.675, rel=1e-5)
    assert torch.allclose(grpo_advantages(r, 4, scale=1.0).double(), want * (s + 1e-6), atol=1e-6)
    present = torch.tensor([True, True, False, True, True, True, True, False])
    xp = x[present]
    assert batch_std(run, r, present) == pytest.approx(((xp - xp.mean()) ** 2).mean().sqrt().item(),
                                                       rel=1e-6)


def ref_loss(logp, old, ref, adv, mask, clip_eps, beta):
    """GRPO's loss on episodes, token by token in float64: the mean over episodes of each one's mean
    over the tokens its mask keeps of -min(rho A, clip(rho) A) + beta k3."""
    total = 0.0
    for i in range(logp.size(0)):
        kept = [t for t in range(logp.size(1)) if mask[i, t] > 0]
        s = 0.0
        for t in kept:
            rho = torch.exp(logp[i, t] - old[i, t])
            a = adv[i, t]
            k3 = torch.exp(ref[i, t] - logp[i, t]) - (ref[i, t] - logp[i, t]) - 1
            s = s - torch.minimum(rho * a,
                                  torch.clamp(rho, 1 - clip_eps, 1 + clip_eps) * a) + beta * k3
        total = total + (s / len(kept) if kept else 0.0)
    return total / logp.size(0)


def test_loss_and_gradient_match_a_float64_reference():
    g = torch.Generator().manual_seed(0)
    B, T = 5, 9
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, 2, generator=g, dtype=torch.float64).gather(
        1, torch.randint(0, 2, (B, T), generator=g))
    mask = (torch.rand(B, T, generator=g) > 0.3).double()
    mask[1] = 0.0                                             # an episode with no policy token left
    logp_nan = logp.clone()                                   # values under the mask are never read
    logp_nan[mask == 0], old[mask == 0] = float("inf"), float("nan")
    lp = logp_nan.clone().requires_grad_(True)
    loss, metrics = agent_loss(lp, old, ref, adv, mask, clip_eps=0.2, beta=0.04)
    lp_ref = logp.clone().requires_grad_(True)
    want = ref_loss(lp_ref, torch.where(mask > 0, old, 0.0), ref, adv, mask, 0.2, 0.04)
    assert abs(loss.item() - want.item()) < 1e-10
    grad, = torch.autograd.grad(loss, lp)
    grad_ref, = torch.autograd.grad(want, lp_ref)
    assert torch.allclose(grad, grad_ref, atol=1e-12) and (grad[mask == 0] == 0).all()
    assert 0 < metrics["clip_frac"] < 1


# -----------------------------------------------------------------------------
# The script

@pytest.fixture(scope="session")
def tiny_tool_sft(tmp_path_factory):
    """A small SFT policy on the tool task (2 layers, width 64, 400 steps): it has learned the
    format, calls and all. Trained once (sft.py --task toolcalc --steps 400 --batch_size 32
    --n_layer 2 --n_head 2 --n_embd 64 --lr 3e-3, torch 2.13, 2 CPU threads; its optimiser state
    dropped) and kept in the repository (tests/fixtures/tiny_tool_sft.pt), as conftest's tiny_sft:
    54 s of every test run, and the same weights on every machine."""
    out = tmp_path_factory.mktemp("tiny_tool_sft")
    shutil.copy(os.path.join(ROOT, "tests", "fixtures", "tiny_tool_sft.pt"), out / "sft.pt")
    return str(out / "sft.pt")


TINY = ["--prompts_per_step", "4", "--group_size", "4", "--log_every", "1", "--eval_every", "2",
        "--eval_n", "16"]


def read_metrics(out):
    return [json.loads(line) for line in open(os.path.join(out, "agent", "metrics.jsonl"))]


@pytest.mark.slow
def test_script_runs_end_to_end_and_resumes(tiny_tool_sft, tmp_path):
    out = str(tmp_path)
    p = run_script("agent.py", TINY + ["--steps", "2", "--init", tiny_tool_sft, "--out", out],
                   fresh=True)
    assert p.returncode == 0, p.stderr
    assert ("held-out greedy accuracy" in p.stdout and "without the tool" in p.stdout
            and "done: 2 steps" in p.stdout)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in ("reward_mean", "accuracy", "calls", "call_share", "malformed", "accuracy_called",
                "kl_exact", "entropy", "completion_len", "env_tokens", "env_logp", "grad_norm",
                "clip_frac", "kl_k3", "cost_only_groups", "advantage_called"):
        assert key in rows[1] and math.isfinite(rows[1][key]), key
    for key in ("eval_accuracy", "eval_accuracy_no_tool", "eval_calls", "eval_call_share_hard",
                "eval_accuracy_called"):
        assert key in rows[0] and key in rows[2], key
    assert (rows[1]["completion_len"] > 0 and rows[1]["env_tokens"] >= 0
            and 0 <= rows[1]["call_share"] <= 1)
    assert all(0 <= r["sampler_logp_diff"] < 1e-4 for r in rows[1:])   # the policy's tokens
    assert rows[1]["entropy"] > 0            # measured from the loss forward (Scored.measure)
    _, ckpt = load_checkpoint(os.path.join(out, "agent.pt"))
    p = run_script("agent.py",
                   TINY + ["--steps", "3", "--init", tiny_tool_sft, "--out", out, "--resume"])
    assert p.returncode == 0, p.stderr
    assert "resuming from" in p.stdout
    _, ckpt2 = load_checkpoint(os.path.join(out, "agent.pt"))
    assert (ckpt2["step"] == 3
            and not torch.equal(ckpt2["model"]["wte.weight"], ckpt["model"]["wte.weight"]))
    assert [r["step"] for r in read_metrics(out)] == [0, 1, 2, 3]


def test_the_parked_reference_is_away_while_sampling_and_updating_and_moves_no_number(
    tiny_tool_sft, tmp_path, monkeypatch):
    """As grpo's (tests/test_plumbing.py): the reference parked as on a GPU is back for step 2
    alone, and metrics.jsonl is the unparked run's line for line (times aside)."""
    import agent
    from conftest import parked_runs
    argv = TINY + ["--steps", "2", "--init", tiny_tool_sft, "--device", "cpu"]
    assert parked_runs(agent, argv, tmp_path, monkeypatch) == [2]            # a forward a step


def test_script_runs_two_attempts_and_the_pitfall(tiny_tool_sft, tmp_path):
    out = str(tmp_path)
    p = run_script("agent.py", TINY + ["--steps", "2", "--turns", "2", "--train_on_env_tokens",
                                       "--stage1_steps", "1", "--init", tiny_tool_sft,
                                       "--out", out])
    assert p.returncode == 0, p.stderr
    assert "ENVIRONMENT TOKENS IN THE LOSS" in p.stdout and "second attempt" in p.stdout
    rows = read_metrics(out)
    assert all(k in rows[2] for k in ("eval_accuracy_turn2", "eval_wrong_to_right",
                                      "eval_right_to_wrong"))
    assert all(k in rows[1] for k in ("accuracy_turn1", "wrong_to_right", "right_to_wrong"))
    assert [rows[1]["stage"], rows[2]["stage"]] == [1, 2]           # SCoRe's stage I, then stage II
    assert rows[1]["env_tokens"] >= len(toolcalc.REVISE)             # the revision prompt, at least


def test_script_rejects_bad_settings_with_a_message(tmp_path):
    refuses_all("agent.py", [(["--turns", "3"], ["--turns", "3"]),
                             (["--call_cost", "-1"], ["--call_cost", "-1"]),
                             (["--max_new_tokens", "60", "--turns", "2"], ["--max_new_tokens"]),
                             (["--stage1_steps", "5"], ["--stage1_steps", "5", "--turns 2"]),
                             (["--turns", "2", "--stage1_steps", "3", "--steps", "2"],
                              ["--stage1_steps 3 is longer than the run (--steps 2)",
                               "allowed: --stage1_steps <= --steps"]),
                             (["--scale_rewards", "median"], ["--scale_rewards", "median"])],
                tmp_path)
    assert all(not os.path.exists(tmp_path / f"out{i}")
               or os.listdir(tmp_path / f"out{i}") in ([], ["agent"]) for i in range(6))
    import agent                                           # at the limit: accepted
    assert agent.parse_args(["--turns", "2", "--stage1_steps", "2", "--steps", "2"]).steps == 2


def test_lora_on_a_rotary_gelu_policy_and_the_two_attempt_length_refusal(tmp_path):
    """The tool task's SFT policy has rotary positions and a GELU MLP: --lora_rank adapts the
    projections it has (the default targets used to include gate: a KeyError). --turns 2: the length
    refusal names the flag's own value and an allowed value that runs (it named the episode's total,
    and a bound that was itself refused)."""
    from hf.checkpoint import save_checkpoint
    init = str(tmp_path / "rope.pt")
    torch.manual_seed(0)
    save_checkpoint(init, GPT(GPTConfig(block_size=toolcalc.BLOCK_SIZE, n_layer=1, n_head=2,
                                        n_embd=32, pos="rope")), "bytes")
    small = ["--init", init, "--steps", "1", "--prompts_per_step", "2", "--group_size", "2",
             "--eval_n", "2"]
    p = run_script("agent.py", small + ["--lora_rank", "2", "--out", str(tmp_path / "a")])
    assert p.returncode == 0, p.stderr[-2000:]
    assert "LoRA: rank 2, alpha 32 on q, k, v, o, up, down" in p.stdout
    refused = refuses_all("agent.py", [(small + ["--turns", "2", "--max_new_tokens", "500"],
                                        ["--max_new_tokens 500 does not fit",
                                         "allowed: --max_new_tokens <="])], tmp_path)[0]
    allowed = int(re.search(r"allowed: --max_new_tokens <= (\d+)", refused.stderr)[1])
    # the longest episode: the longest prompt, attempt 1 and its end token, the revision prompt
    # (REVISE and the problem again), attempt 2
    longest = toolcalc.max_prompt_tokens(Tokenizer())
    revision = len(Tokenizer().encode(toolcalc.REVISE)) + longest
    assert allowed == (toolcalc.BLOCK_SIZE - longest - 1 - revision) // 2
    refuses_all("agent.py", [(small + ["--turns", "2", "--max_new_tokens", str(allowed + 1)],
                              [f"--max_new_tokens {allowed + 1} does not fit", f"<= {allowed}"])],
                tmp_path)
    p = run_script("agent.py", small + ["--turns", "2", "--max_new_tokens", str(allowed),
                                        "--out", str(tmp_path / "b")])
    assert p.returncode == 0, p.stderr[-2000:]


@pytest.mark.parametrize("name, extra", [("toolcalc", []), ("arithmetic", []), ("countdown", []),
                                         ("gsm8k", ["--data", "GSM8K"])])
def test_the_chat_protocol_with_a_tool_on_every_task(name, extra, tmp_path):
    """--chat --tools calculator: episodes in the toy's chat template (bytes-chat) on each task,
    scored by its own grader; the step's tool metrics logged, the held-out ones too; and its
    refusals."""
    from hf.checkpoint import save_checkpoint
    init = str(tmp_path / "chat.pt")
    torch.manual_seed(0)
    save_checkpoint(init, GPT(GPTConfig(vocab_size=Tokenizer("bytes-chat").vocab_size,
                                        block_size=512, n_layer=1, n_head=2, n_embd=32,
                                        pos="rope")), "bytes-chat", chat_date="2026-01-01")
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": f"Tom has {a} bags of {a + 1} apples. "
                                                    f"How many?",
                                        "answer": f"{a}*{a + 1}={a * (a + 1)}\n#### {a * (a + 1)}"})
                            + "\n" for a in range(2, 22)))
    extra = [str(data) if x == "GSM8K" else x for x in extra]
    small = ["--init", init, "--chat", "--tools", "calculator", "--task", name, *extra,
             "--steps", "1", "--prompts_per_step", "2", "--group_size", "2", "--eval_n", "2",
             "--max_new_tokens", "40", "--log_every", "1", "--out", str(tmp_path / "a")]
    p = run_script("agent.py", small)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "tools calculator in the template's protocol" in p.stdout and "done: 1 steps" in p.stdout
    rows = read_metrics(str(tmp_path / "a"))
    assert all(math.isfinite(rows[1][k])
               for k in ("calls", "malformed", "turns", "accuracy_called", "env_tokens"))
    assert "eval_turns" in rows[0] and rows[1]["turns"] >= 1
    if name == "toolcalc":
        refuses_all("agent.py", [(small + ["--turns", "2"], ["--turns 2", "allowed: --turns 1"]),
                                 (["--chat", "--tools", "abacus"],
                                  ["--tools abacus", "allowed: calculator"]),
                                 (["--tools", "calculator"], ["--tools calculator", "add --chat"]),
                                 (["--tools_env", "PATH"], ["--tools_env PATH", "add --tools"]),
                                 (["--chat", "--tools", "calculator", "--tools_env", "NOT_SET_X"],
                                  ["--tools_env NOT_SET_X", "no such variable"]),
                                 (["--chat"], ["--task toolcalc --chat", "--tools calculator"]),
                                 (["--tools", "os:system", "--chat"],
                                  ["--tools os:system", "no type hint"]),
                                 (["--tools", "json:loads", "--chat"],
                                  ["--tools json:loads", "**kwargs cannot be given by name"])],
                    tmp_path)


def test_each_written_token_carries_the_log_prob_the_trainer_gives_it():
    """Episodes.logp (the sampler's, as each token was written: the policy's draws and the
    calculator's replies) against completion_logprobs over the whole episode: within float32's
    reordering by default, bit for bit under --batch_invariant's mode."""
    policy, tok, _ = load_model(os.path.join(ROOT, "tests", "fixtures", "tiny_tool_sft.pt"), "cpu",
                                "gpt")
    prompts = task.sample_prompts(random.Random(0), 6)
    for mode, most in ((contextlib.nullcontext(), 1e-4), (invariant.BatchInvariant(), 0.0)):
        with mode, torch.no_grad():
            e = task.episodes(policy, tok, prompts, 4, 0.8,
                              generator=torch.Generator().manual_seed(0))
            logp = completion_logprobs(policy, e.prompt, e.prompt_mask, e.tokens, e.mask, 0.8)
        assert (e.mask - e.sampled).sum() > 0                     # replies among the tokens
        assert (logp - e.logp).abs()[e.mask > 0].max() <= most
        assert (e.logp[e.mask == 0] == 0).all()
