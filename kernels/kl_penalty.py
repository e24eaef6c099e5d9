"""The one-sample KL estimators that RL losses put in place of the exact KL (kernels.kl).

Schulman 2020, "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html). For a token
y sampled from pi_theta, with log r = log pi_ref(y) - log pi_theta(y):

    k1 = -log r              unbiased for KL(pi_theta || pi_ref); negative on some tokens
    k2 = (log r)^2 / 2       biased, low variance, >= 0
    k3 = (r - 1) - log r     unbiased, low variance, >= 0 (DeepSeekMath eq. 4, GRPO's)

Their values estimate the same KL; their gradients, when the estimate is a loss term differentiated
through log pi_theta (and not through the sampling), do not: the expected gradient of k1 is 0 (it
penalises only when it is a reward: RLOO, REINFORCE++, PPO, TRPO put it there), k2's is the gradient
of KL(pi_theta || pi_ref), and k3's is the gradient of KL(pi_ref || pi_theta), the other direction,
which agrees with it near pi_ref (tests/test_kl_penalty.py measures all three; experiments/ has the
bias and variance study). k3 grows like e^|log r| where pi_theta puts far less mass than pi_ref, so
one token can dominate a loss: `clamp` limits log r to [-clamp, clamp] first, and a clamped token
gives no KL gradient. Peers bound it elsewhere: verl's k3 ("low_var_kl") clamps log r to [-20, 20]
and then the estimate itself to at most 10; OpenRLHF clamps the estimate (any of k1, k2, k3) to
[-10, 10]; TRL does neither.
"""
import torch


def kl_penalty(logp, ref_logp, estimator, clamp=None):
    """Per-token estimate of KL(pi_theta || pi_ref) on tokens sampled from pi_theta.
    logp, ref_logp (B, T) log pi_theta and log pi_ref of the sampled tokens -> (B, T).
    estimator: "k1", "k2" or "k3"; clamp: None, or clamp log r to [-clamp, clamp] first."""
    log_r = ref_logp - logp                                      # log r = log pi_ref - log pi_theta
    if clamp is not None:
        log_r = log_r.clamp(-clamp, clamp)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r ** 2
    if estimator == "k3":
        return torch.exp(log_r) - log_r - 1                      # (r - 1) - log r
    raise ValueError(f"kl estimator {estimator!r} is unknown; allowed: 'k1', 'k2', 'k3'")
