"""Run a training script's main() with fixed rollouts, for tests/test_distributed.py.

    python tests/ddp_worker.py grpo --steps 1 ...                                  # one process
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/ddp_worker.py grpo --steps 1 ...

The script's sampler is replaced by one whose completions depend only on the prompt and the sample's index in its
group (a correct demonstration or the left-to-right mistake, padded to a fixed width), so that one process with a
batch of P prompts, two processes with P/2 each, and one process with --grad_accum 2 see exactly the same rollouts:
what the test then compares is the update alone. The optimiser is plain SGD with a large step (lr 0.1 in every
parameter group): its update is -0.1 * gradient, far above the float32 rounding of the weights, so any difference in
the gradient (a wrong normaliser) shows in the weights, where AdamW's first step, about -lr * sign(gradient), would
hide it.
"""
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import task  # noqa: E402
from tasks import arithmetic  # noqa: E402

WIDTH = arithmetic.MAX_NEW_TOKENS  # completions padded to a fixed width: the same tensors whatever the batch


def fixed_completion(prompt, j):
    return arithmetic.demonstration(prompt, left_to_right=(j + len(prompt) + ord(prompt[0])) % 3 == 0)


def fixed_tokens(tokenizer, prompts, group_size, device):
    """tokens, mask (P*G, WIDTH) and truncated (P*G,) of the fixed completions, a prompt's G on consecutive rows."""
    rows = [tokenizer.encode(fixed_completion(p, j)) + [tokenizer.eos_id] for p in prompts for j in range(group_size)]
    tokens = torch.full((len(rows), WIDTH), tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), WIDTH)
    for i, r in enumerate(rows):
        tokens[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1.0
    return tokens.to(device), mask.to(device), torch.zeros(len(rows), dtype=torch.bool, device=device)


def fixed_rollout(policy, tokenizer, prompts, group_size, temperature, max_new_tokens=None, format_weight=0.0,
                  generator=None):
    """task.rollout's contract, with the fixed completions."""
    device = next(policy.parameters()).device
    prompt, prompt_mask = tokenizer.encode_batch(prompts, device)
    tokens, mask, truncated = fixed_tokens(tokenizer, prompts, group_size, device)
    completions = tokenizer.decode_completions(tokens, mask)
    rewards = torch.tensor([task.reward(prompts[i // group_size], c, format_weight) for i, c in enumerate(completions)],
                           device=device)
    correct = torch.tensor([task.reward(prompts[i // group_size], c) == 1.0 for i, c in enumerate(completions)],
                           device=device)
    G = group_size
    return task.Rollout(prompt.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0), tokens, mask, truncated,
                        rewards, correct)


def fixed_ppo_rollout(policy, tok, prompts, temperature, max_new_tokens, generator, device, autocast):
    """ppo.rollout's contract, with the fixed completions (one per prompt)."""
    idx, idx_mask = tok.encode_batch(prompts, device)
    tokens, mask, truncated = fixed_tokens(tok, prompts, 1, device)
    return torch.cat([idx, tokens], 1), torch.cat([idx_mask, mask], 1), idx.size(1), tokens, mask, truncated


def sgd(params, lr=None, **kwargs):
    """SGD at lr 0.1 in place of AdamW; the first optimiser made (the policy's) records the starting weights, in
    model.parameters() order, to $DDP_WORKER_INIT, for the test to subtract (sft.py starts from random weights)."""
    params = [dict(g, params=list(g["params"])) if isinstance(g, dict) else g for g in params]
    first = params[0]["params"] if isinstance(params[0], dict) else params      # the policy's (ppo.py: group 0)
    path = os.environ.get("DDP_WORKER_INIT")
    if path and int(os.environ.get("RANK", 0)) == 0 and not os.path.exists(path):
        torch.save([p.detach().cpu().clone() for p in first], path)
    optimizer = torch.optim.SGD(params, lr=0.1)
    for group in optimizer.param_groups:
        group["lr"] = 0.1
    return optimizer


if __name__ == "__main__":
    script = importlib.import_module(sys.argv[1])
    task.rollout = fixed_rollout
    torch.optim.AdamW = sgd
    if sys.argv[1] == "ppo":
        script.rollout = fixed_ppo_rollout
    if os.environ.get("DDP_WORKER_NAN_RANK") == os.environ.get("RANK", "0"):    # this rank's log-probs are NaN
        logprobs = script.logprobs
        script.logprobs = lambda *a, **k: logprobs(*a, **k) * float("nan")
    script.main(script.parse_args(sys.argv[2:]))
