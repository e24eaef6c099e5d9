"""kernels.kl_penalty, the one-sample KL estimators every RL script uses (Schulman 2020,
"Approximating KL Divergence"), against float64 references written here: hand-worked values, the
clamp, and what each estimator's value and gradient equal in expectation, by enumerating a
categorical distribution."""
import math

import pytest
import torch

from kernels import kl_penalty


def ref_kl(logp, ref_logp, estimator):
    log_ratio = logp - ref_logp                         # log pi_theta / pi_ref
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    return torch.exp(-log_ratio) + log_ratio - 1        # pi_ref/pi_theta - log(pi_ref/pi_theta) - 1


def test_kl_estimators_hand_example():
    # log pi_theta - log pi_ref = x = [0.1, -0.5, 0.1, 1.2]: k3 = e^-x + x - 1 = 0.004837, 0.148721,
    # 0.004837, 0.501194 (sum 0.659590), worked by hand
    logp = torch.tensor([-1.2, -2.5, -0.8, -0.3])
    ref = torch.tensor([-1.3, -2.0, -0.9, -1.5])
    assert torch.allclose(kl_penalty(logp, ref, "k1"), torch.tensor([0.1, -0.5, 0.1, 1.2]),
                          atol=1e-6)
    assert torch.allclose(kl_penalty(logp, ref, "k2"), torch.tensor([0.005, 0.125, 0.005, 0.72]),
                          atol=1e-6)
    k3 = kl_penalty(logp, ref, "k3")
    assert torch.allclose(k3, torch.tensor([0.0048374, 0.1487213, 0.0048374, 0.5011942]), atol=1e-6)
    assert abs(k3.sum().item() - 0.6595903) < 1e-5
    with pytest.raises(ValueError, match="'k4'"):
        kl_penalty(logp, ref, "k4")


def test_kl_clamp_bounds_the_log_ratio_and_stops_its_gradient():
    logp = torch.tensor([-0.5, -30.0, -1.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-0.7, -0.1, -25.0], dtype=torch.float64)      # log r = -0.2, +29.9, -24
    k3 = kl_penalty(logp, ref, "k3", clamp=10.0)
    log_r = torch.tensor([-0.2, 10.0, -10.0], dtype=torch.float64)    # clamped to [-10, 10] by hand
    torch.testing.assert_close(k3, torch.exp(log_r) - log_r - 1)
    assert (k3[1].item() == pytest.approx(math.exp(10) - 11)
            and kl_penalty(logp, ref, "k3")[1].item() > 1e12)
    g, = torch.autograd.grad(k3.sum(), logp)
    assert (g[0].item() == pytest.approx(-(math.exp(-0.2) - 1)) and g[1].item() == 0
            and g[2].item() == 0)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_match_reference(estimator):
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 3
    ref = logp + 0.5 * torch.randn(5, 7, generator=g, dtype=torch.float64)
    assert torch.allclose(kl_penalty(logp, ref, estimator), ref_kl(logp, ref, estimator),
                          atol=1e-12)


def test_kl_estimators_in_expectation():
    """Enumerate a categorical pi and ref: E_pi[k1] = E_pi[k3] = KL(pi || ref) exactly; as loss
    terms (gradient through log pi only) E_pi[grad k1] = 0, E_pi[grad k2] = grad KL(pi || ref),
    E_pi[grad k3] = grad KL(ref || pi)."""
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(11, generator=g, dtype=torch.float64).requires_grad_()
    ref_logp = torch.log_softmax(torch.randn(11, generator=g, dtype=torch.float64), 0)
    logp = torch.log_softmax(theta, 0)
    pi = logp.exp().detach()                        # the sampling weights: no gradient through them
    kl_fwd = (logp.exp() * (logp - ref_logp)).sum()                 # KL(pi || ref)
    kl_rev = (ref_logp.exp() * (ref_logp - logp)).sum()             # KL(ref || pi)
    for est in ("k1", "k3"):
        assert abs((pi * kl_penalty(logp, ref_logp, est)).sum().item() - kl_fwd.item()) < 1e-10
    expected = {"k1": torch.zeros(11, dtype=torch.float64),
                "k2": torch.autograd.grad(kl_fwd, theta, retain_graph=True)[0],
                "k3": torch.autograd.grad(kl_rev, theta, retain_graph=True)[0]}
    for est, want in expected.items():
        got = torch.autograd.grad((pi * kl_penalty(logp, ref_logp, est)).sum(), theta,
                                  retain_graph=True)[0]
        assert torch.allclose(got, want, atol=1e-10), est
