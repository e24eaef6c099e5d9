"""
Forward against reverse KL, shown: fit a one-peaked distribution q to a two-peaked target p on a
small discrete support, once by minimising the forward KL(p || q) and once the reverse KL(q || p),
from several starting points.

    forward  KL(p || q) = sum_x p(x) log(p(x) / q(x))
             mass-covering: q pays for every x where p > 0 and q is small, so it spreads over both
             peaks (and the valley);
    reverse  KL(q || p) = sum_x q(x) log(q(x) / p(x))
             mode-seeking: q pays for every x where q > 0 and p is small, so it sits on one peak and
             ignores the other.

q is a Gaussian restricted to the support, q(x) proportional to exp(-(x - mu)^2 / (2 sigma^2)) (a
softmax of a quadratic), with parameters mu and log sigma, fitted by Adam in float64. That family is
an exponential family with statistics x and x^2, so the forward fit is exact moment matching: q's
mean and variance become p's, whatever the start. The reverse objective has a local minimum on each
peak, where KL(q || p) is about -log(the peak's weight), so where q ends up depends on where it
starts (and a third, worse one, a wide q straddling the valley, which a start in the valley itself
can fall into: the third panel shows the objective against mu).

In RL for language models, the penalty KL(pi_theta || pi_ref) is the reverse direction with pi_theta
in q's place: it lets the policy drop some of the reference's modes (answers) as long as what it
keeps is likely under the reference. The claim sometimes read that reverse KL is mode-covering is
the wrong way round; the figure shows it.

Run:
    # a few seconds; writes results/forward_reverse_kl.png
    python experiments/forward_reverse_kl.py
"""
import argparse
import math
import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -----------------------------------------------------------------------------
# Pure functions (tested in tests/test_experiments.py)

def support(n=41, half_width=8.0):
    """n equally spaced points on [-half_width, half_width], float64."""
    return torch.linspace(-half_width, half_width, n, dtype=torch.float64)


def log_gaussian(x, mu, log_sigma):
    """log q(x) of a Gaussian restricted to the points x and normalised over them:
    log softmax(-(x - mu)^2 / 2 sigma^2)."""
    return torch.log_softmax(-0.5 * ((x - mu) / torch.exp(log_sigma)) ** 2, dim=-1)


def log_two_peaks(x, centres=(-2.5, 2.5), widths=(0.75, 0.75), weights=(0.6, 0.4)):
    """log p(x) of a mixture of two Gaussians restricted to x, normalised over x: the two-peaked
    target."""
    w = torch.tensor(weights, dtype=torch.float64)
    parts = [log_gaussian(x, torch.tensor(c, dtype=torch.float64),
                          torch.tensor(math.log(s), dtype=torch.float64))
             for c, s in zip(centres, widths)]
    return torch.logsumexp(torch.stack(parts) + torch.log(w / w.sum())[:, None], dim=0)


def kl_divergence(log_a, log_b):
    """KL(a || b) = sum_x a(x) (log a(x) - log b(x)) of two distributions given by their logs over
    the same points; 0 log 0 = 0."""
    a = log_a.exp()
    return torch.where(a > 0, a * (log_a - log_b), 0.0).sum(-1)


def moments(x, log_q):
    """(mean, variance) of the distribution exp(log_q) on the points x."""
    q = log_q.exp()
    mean = (q * x).sum()
    return mean, (q * (x - mean) ** 2).sum()


def fit(x, log_p, direction, mu0, log_sigma0=0.0, steps=3000, lr=0.05):
    """Fit log_gaussian(x, mu, log_sigma) to the target log_p by minimising KL(p || q) (direction
    "forward") or KL(q || p) ("reverse") with Adam from (mu0, log_sigma0). Returns (mu, sigma, final
    KL) as floats."""
    if direction not in ("forward", "reverse"):
        raise ValueError(f"direction {direction!r} is unknown; allowed: 'forward', 'reverse'")
    mu = torch.tensor(float(mu0), dtype=torch.float64, requires_grad=True)
    log_sigma = torch.tensor(float(log_sigma0), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.Adam([mu, log_sigma], lr=lr)
    objective = lambda log_q: kl_divergence(log_p,
                                            log_q) if direction == "forward" else kl_divergence(
        log_q, log_p)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = objective(log_gaussian(x, mu, log_sigma))
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        final = objective(log_gaussian(x, mu, log_sigma)).item()
    return mu.item(), math.exp(log_sigma.item()), final


def landscape(x, log_p, direction, mus, log_sigmas):
    """min over log_sigmas of the objective, at each mu: the profile that shows one minimum
    (forward) or one per peak (reverse). Returns a float64 tensor like mus."""
    M, S = torch.meshgrid(mus, log_sigmas, indexing="ij")                     # (n_mu, n_sigma)
    log_q = log_gaussian(x, M[..., None], S[..., None])                       # (n_mu, n_sigma, n)
    values = kl_divergence(log_p, log_q) if direction == "forward" else kl_divergence(log_q, log_p)
    return values.min(dim=1).values


# -----------------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description="Fit a one-peaked q to a two-peaked p by "
                                                 "forward and by reverse KL")
    parser.add_argument("--starts", type=float, nargs="+", default=[-4.0, -1.0, 1.0, 4.0],
                        help="initial means mu0")
    parser.add_argument("--steps", type=int, default=3000, help="Adam steps per fit")
    parser.add_argument("--out", default="results/forward_reverse_kl.png", help="the figure")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps {args.steps} must be at least 1")
    x = support()
    log_p = log_two_peaks(x)
    mean, var = moments(x, log_p)
    print(f"target p: peaks at -2.5 (weight 0.6) and +2.5 (0.4), width 0.75, on {len(x)} points in "
          f"[{x[0]:.0f}, {x[-1]:.0f}]: mean {mean:+.3f}, std {var.sqrt():.3f}")
    fits = {}
    for direction in ("forward", "reverse"):
        for mu0 in args.starts:
            fits[direction, mu0] = fit(x, log_p, direction, mu0, steps=args.steps)
            mu, sigma, value = fits[direction, mu0]
            q_mean, q_var = moments(x, log_gaussian(x, torch.tensor(mu, dtype=torch.float64),
                                                    torch.tensor(math.log(sigma))))
            print(f"{direction:7s} KL from mu0 {mu0:+.1f}, sigma0 1: mu {mu:+.3f}, "
                  f"sigma {sigma:.3f}, KL {value:.4f} (q's mean {q_mean:+.3f}, "
                  f"std {q_var.sqrt():.3f})")

    import matplotlib
    matplotlib.use("Agg")                                                      # no display needed
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    p = log_p.exp()
    step = (x[1] - x[0]).item()
    titles = {"forward": "forward KL(p || q): covers both peaks",
              "reverse": "reverse KL(q || p): picks one peak"}
    for ax, direction in zip(axes, ("forward", "reverse")):
        ax.bar(x, p, width=0.8 * step, color="0.75", label="target p (two peaks)")
        for i, mu0 in enumerate(args.starts):
            mu, sigma, value = fits[direction, mu0]
            q = log_gaussian(x, torch.tensor(mu, dtype=torch.float64),
                             torch.tensor(math.log(sigma))).exp()
            ax.plot(x, q, "o-" if direction == "forward" else "s-", markersize=3, color=f"C{i}",
                    alpha=0.8, label=f"q from mu0 = {mu0:+.1f}: mu {mu:+.2f}, sigma {sigma:.2f}")
        ax.set(title=titles[direction], xlabel="x", ylabel="probability")
        ax.legend(fontsize=7)
    mus = torch.linspace(-4.5, 4.5, 181, dtype=torch.float64)
    log_sigmas = torch.linspace(-2, 2, 201, dtype=torch.float64)
    for direction, style in (("forward", "-"), ("reverse", "--")):
        axes[2].plot(mus, landscape(x, log_p, direction, mus, log_sigmas), style,
                     label=f"{direction}: min over sigma")
    axes[2].set(title="the objective against mu (best sigma at each mu)", xlabel="mu", ylabel="KL",
                yscale="log")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle("fitting one Gaussian to two peaks (python experiments/forward_reverse_kl.py)",
                 fontsize=10)
    fig.tight_layout()
    path = os.path.join(ROOT, args.out) if not os.path.isabs(args.out) else args.out
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
