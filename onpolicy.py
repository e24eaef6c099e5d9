"""The on-policy scripts' step 2 (grpo, reinforce, rloo, agent): pi_old and pi_ref without
gradient, the exact KL and the entropy on a logged step, pi_old from the sampler under
--batch_invariant, sampler_logp_diff. Run (plumbing/run.py) is one."""
from dataclasses import dataclass

import torch

from model import completion_hidden, kl_entropy


@dataclass
class Scored:
    old_logp: torch.Tensor          # (B, Tn) log pi_old of each token
    ref_logp: torch.Tensor          # (B, Tn) log pi_ref
    kl_exact: object                # KL(pi || ref) over kl_mask's tokens (a logged step), else 0.0
    entropy: object                 # pi's entropy over the same tokens, else 0.0
    sampler_diff: object            # max |sampler's - trainer's log-prob| (a logged step), or None


class OnPolicy:
    # needs Run's args, autocast, logging, micro_batches and max

    def score(self, policy, ref, ref_weights, prompt, prompt_mask, tokens, mask, sampler_logp,
              temperature, kl_mask=None, n_kl=None):
        """Scored: each model's forward once per micro-batch, through what the loss's
        completion_logprobs runs (on-policy, pi_old is the trainer's log-prob bit for bit); on a
        logged step the exact KL(pi || ref) and the entropy (model.kl_entropy) summed over kl_mask
        (default mask) / n_kl. --batch_invariant: pi_old is the sampler's, and the policy scores
        on logged steps alone. ref_weights: the parked reference's context."""
        kl_mask = mask if kl_mask is None else kl_mask
        old_logp, ref_logp = torch.zeros_like(mask), torch.zeros_like(mask)      # (B, Tn)
        kl_exact = ent = 0.0
        recompute = not self.args.batch_invariant or self.logging()
        with ref_weights:
            for rows in self.micro_batches(len(mask)):
                with torch.no_grad(), self.autocast:       # (b, Tp+Tn-1, C) final hidden states
                    h_ref = completion_hidden(ref, prompt[rows], prompt_mask[rows], tokens[rows],
                                              mask[rows])
                    ref_logp[rows] = ref.head_logprobs(h_ref, tokens[rows], temperature)
                    if recompute:
                        h = completion_hidden(policy, prompt[rows], prompt_mask[rows],
                                              tokens[rows], mask[rows])
                        old_logp[rows] = policy.head_logprobs(h, tokens[rows], temperature)
                    if self.logging():                     # (b, Tn) each
                        kl_t, ent_t = kl_entropy(policy, ref, h, h_ref, kl_mask[rows],
                                                 temperature)
                        kl_exact += kl_t.sum() / n_kl                           # KL(pi || ref)
                        ent += ent_t.sum() / n_kl
        # how far the trainer's log-probs are from those the sampler drew with (same weights)
        diff = self.sampler_diff(sampler_logp, old_logp, kl_mask) if recompute else None
        if self.args.batch_invariant:
            old_logp = sampler_logp                                  # equal, bit for bit
        return Scored(old_logp, ref_logp, kl_exact, ent, diff)

    def sampler_diff(self, sampler_logp, trainer_logp, mask):
        """The largest |sampler's - trainer's| log-prob where mask is 1, over every rank."""
        return self.max(torch.where(mask > 0, (sampler_logp - trainer_logp).abs(), 0.0))
