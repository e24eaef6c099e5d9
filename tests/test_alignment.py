"""What feeds the losses, position by position, on data where an off-by-one or a mismatched row
would show: a random model whose predictions differ at every position, prompts of different lengths,
completions of different lengths, several distinct prompts in a group layout. Each value is compared
with the same value computed on one sequence alone, with no padding and nothing else in the
batch."""
import torch
import torch.nn as nn

import sampler
import task
from hf.tokenizer import Tokenizer
from model import GPT, GPTConfig, ScalarGPT, completion_logits
from ppo import token_values
from reward_model import score_pairs

PROMPTS = ["3+4*2=", "9-8-7=", "2*3+4=", "7-1*5="]


def spread_model(seed=0, scalar=False):
    """A small random model with its logits spread (no position predicts the same thing as its
    neighbour)."""
    torch.manual_seed(seed)
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32)
    model = ScalarGPT(config) if scalar else GPT(config)
    if scalar:
        nn.init.normal_(model.head.weight, std=1.0)
    return model.eval()


def ragged_completions(tok, seed=1):
    """Random completion ids of lengths 1, 5, 3, 7 (no EOS inside), right-padded, with their
    mask."""
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 5, 3, 7]
    ids = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    tokens = torch.full((len(ids), max(lengths)), tok.pad_id)
    mask = torch.zeros(len(ids), max(lengths))
    for i, x in enumerate(ids):
        tokens[i, :len(x)], mask[i, :len(x)] = torch.tensor(x), 1.0
    return ids, tokens, mask


def test_completion_logits_at_t_are_the_logits_after_the_prompt_and_the_first_t_tokens_alone():
    tok, model = Tokenizer(), spread_model()
    # left-padded, 2 to 8 tokens
    prompt, prompt_mask = tok.encode_batch(["1=", "9-8-7=", "22*3=", "7-1*5+2="])
    ids, tokens, mask = ragged_completions(tok)
    with torch.no_grad():
        logits = completion_logits(model, prompt, prompt_mask, tokens, mask)   # (B, Tn, V)
        for i, text in enumerate(["1=", "9-8-7=", "22*3=", "7-1*5+2="]):
            for t in range(len(ids[i])):
                alone = torch.tensor([tok.encode(text) + ids[i][:t]])
                torch.testing.assert_close(logits[i, t], model(alone)[0, -1], rtol=0, atol=1e-5)
        neighbours = (logits[:, 1:] - logits[:, :-1]).abs().amax(-1)
        assert (neighbours[mask[:, 1:] > 0] > 1e-2).all()          # a shifted slice could not agree


def test_critic_values_are_the_value_of_the_state_before_each_completion_token():
    tok, critic = Tokenizer(), spread_model(scalar=True)
    texts = ["1=", "9-8-7=", "22*3=", "7-1*5+2="]
    prompt, prompt_mask = tok.encode_batch(texts)
    ids, tokens, mask = ragged_completions(tok, seed=2)
    seq, seq_mask = torch.cat([prompt, tokens], 1), torch.cat([prompt_mask, mask], 1)
    with torch.no_grad():
        values = token_values(critic, seq, seq_mask, prompt.size(1),
                              torch.autocast("cpu", enabled=False))
        for i, text in enumerate(texts):
            for t in range(len(ids[i])):                         # V(s_t), s_t = prompt + tokens < t
                alone = torch.tensor([tok.encode(text) + ids[i][:t]])
                torch.testing.assert_close(values[i, t], critic(alone)[0, -1], rtol=0, atol=1e-5)


def test_the_reward_model_scores_each_pair_at_its_own_eos():
    tok, rm = Tokenizer(), spread_model(scalar=True)
    pairs = [{"prompt": p, "chosen_ids": tok.encode(c) + [tok.eos_id], "rejected_ids": tok.encode(r)
              + [tok.eos_id]} for p, c, r in zip(
        PROMPTS[:3], ["4*2=8,3+8=11#11", "1", "2*3=6,6+4=10#10"], ["x", "9-8=1#1", "#"])]
    with torch.no_grad():
        r_c, r_r = score_pairs(rm, tok, pairs, "cpu")
        for i, pair in enumerate(pairs):
            for side, got in (("chosen_ids", r_c[i]), ("rejected_ids", r_r[i])):
                # ids as stored: EOS last
                alone = torch.tensor([tok.encode(pair["prompt"]) + pair[side]])
                torch.testing.assert_close(got, rm(alone)[0, -1], rtol=0, atol=1e-5)


class ScriptedPolicy(nn.Module):
    """A policy whose generate returns the given completions, row by row (G consecutive rows per
    prompt); the tests route sampler.generate to it (scripted_sampler)."""

    def __init__(self, tok, completions):
        super().__init__()
        self.tok, self.completions, self.w = tok, completions, nn.Parameter(torch.zeros(1))
        self.seen = None

    def generate(self, prompt, prompt_mask, max_new_tokens, eos_id, pad_id, num_samples=1, **_):
        self.seen = (prompt.clone(), prompt_mask.clone(), num_samples)
        eos_id = eos_id[0] if isinstance(eos_id,
                                         (list, tuple)) else eos_id         # a tokenizer's stop_ids
        ids = [self.tok.encode(c) + [eos_id] for c in self.completions]
        T = max(map(len, ids))
        tokens = torch.full((len(ids), T), pad_id)
        mask = torch.zeros(len(ids), T)
        for i, x in enumerate(ids):
            tokens[i, :len(x)], mask[i, :len(x)] = torch.tensor(x), 1.0
        return tokens, mask, torch.zeros(len(ids), dtype=torch.bool)


def scripted_sampler(monkeypatch):
    """sampler.generate(policy, ...) answered by the scripted policy's own generate(...)."""
    monkeypatch.setattr(sampler, "generate", lambda policy, *a, **k: policy.generate(*a, **k))


def test_a_rollout_scores_row_i_against_prompt_i_over_g(monkeypatch):
    scripted_sampler(monkeypatch)
    tok = Tokenizer()
    # G = 2: each prompt gets one completion right for it and one right for the next prompt (wrong
    # for it)
    answers = ["4*2=8,3+8=11#11", "9-8=1,1-7=-6#-6", "2*3=6,6+4=10#10", "1*5=5,7-5=2#2"]
    completions = [c for i in range(4) for c in (answers[i], answers[(i + 1) % 4])]
    policy = ScriptedPolicy(tok, completions)
    batch = task.rollout(policy, tok, PROMPTS, 2, 1.0, 24, format_weight=0.5)
    assert policy.seen[2] == 2
    assert batch.rewards.tolist() == [1.5, 0.5] * 4 and batch.correct.tolist() == [True, False] * 4
    for row in range(8):                                               # row i carries prompt i // G
        real = batch.prompt_mask[row] > 0
        assert tok.decode(batch.prompt[row][real].tolist()) == PROMPTS[row // 2]
        assert tok.decode(batch.tokens[row][batch.mask[row] > 0].tolist()[:-1]) == completions[row]
