"""Tests for kernels/: logprobs, kl, entropy, through both the PyTorch and the Triton path, and
the edge-case table EDGE_CASES that every function (linear_logprobs too) goes through on both
paths. (linear_logprobs' own tests: test_linear_logprobs.py; ahead-of-time GPU compilation of
every kernel: test_kernel_compile.py.)

Every value is checked against a float64 reference written here, straight from the equations
(never from the code under test), forward and gradient, on random inputs of a fixed seed, so that
the suite never fails by chance (KERNELS_TEST_SEED=<n> picks another seed, KERNELS_TEST_SEED=random
a fresh one each test, printed so that a failure can be replayed; 2,500 seeds of the float64
comparisons passed when the tolerances below were last changed).

How the Triton path is tested without a GPU. Triton chooses between compiling and interpreting
a kernel when `@triton.jit` runs, i.e. when `kernels` is imported, from TRITON_INTERPRET. Setting
it in this process (or in a conftest.py) would be too late if another test file imported
`kernels` first, and would switch every other test file's `kernels.logprobs` calls to the slow
interpreter. So:
  - on a machine with CUDA, the `triton_path` cases run here, on the GPU;
  - otherwise `test_interpreted_kernels_subprocess` re-runs this file's `triton_path` and
    `dispatch` tests in a child pytest with TRITON_INTERPRET=1 (small sizes; ~1 minute), and
    fails with the child's output if any of them fails.
The `torch_path` cases always run here.

Unwritten outputs: the autouse fixture turns on torch's deterministic mode, under which
torch.empty fills new tensors with NaN, so an element a kernel forgets to write fails the
comparison (`test_empty_is_nan_filled` checks that this mechanism is active).

Tolerances. Inputs in bf16/fp16 are exact in float64, and both paths compute in float32, so
forward values get float32 tolerances whatever the input dtype: rtol 1e-5, plus an absolute
floor where the value is a difference of O(1) terms (log-probs near 0: 1e-6; KL = CE - H:
1e-6 * (1 + log V)). Gradients come back in the input dtype and get that dtype's rounding:
rtol 1e-5 (fp32), 2^-10 (fp16), 2^-6 (bf16), plus, per entry, 16 float32 epsilons of the terms
the entry is computed from (see grad_tolerance: e.g. at the argmax of a peaked p the KL gradient
cancels two numbers of size KL), and the float64 reference's own rounding.
"""

import math
import os
import re
import subprocess
import sys

import pytest
import torch

import kernels
from kernels import HAS_TRITON, TRITON_INTERPRET
from kernels.common import as_rows, chunk_ranges, take_rows

HAS_CUDA = torch.cuda.is_available()
# can the Triton path run in this process?
TRITON_HERE = HAS_TRITON and (HAS_CUDA or TRITON_INTERPRET)
IMPLS = ["torch_path"] + (["triton_path"] if TRITON_HERE else [])
NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------
# Fixtures: NaN-filled torch.empty, fresh seeds.
# ---------------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def nan_filled_empty():
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # torch.empty -> NaN
    yield
    torch.use_deterministic_algorithms(was)


@pytest.fixture(autouse=True)
def fresh_seed():
    chosen = os.environ.get("KERNELS_TEST_SEED", "0")
    if chosen == "random":                              # exploration: opt-in, printed to replay
        chosen = int.from_bytes(os.urandom(4), "little")
    seed = int(chosen)
    print(f"seed {seed} (replay with KERNELS_TEST_SEED={seed})")
    torch.manual_seed(seed)
    return seed


def test_empty_is_nan_filled():
    assert torch.empty(16).isnan().all() and torch.empty(4, 4, dtype=torch.bfloat16).isnan().all()


# ---------------------------------------------------------------------------------------------
# float64 references, from the equations.
# ---------------------------------------------------------------------------------------------
def ref_log_softmax(logits, temperature):
    return torch.log_softmax(logits.detach().cpu().double() / temperature, dim=-1)


def ref_logprobs(logits, targets, temperature):
    x = logits.detach().cpu().double().requires_grad_()
    logp = torch.log_softmax(x / temperature, dim=-1)  # log p_v = x_v/T - log sum_w exp(x_w/T)
    return x, logp.gather(-1, targets.cpu().long().unsqueeze(-1)).squeeze(-1)


def _plogp_terms(logp, other):
    """p * (logp - other) with 0 * anything = 0 where p = 0 (and no NaN in its gradient)."""
    zero = torch.isinf(logp)
    return torch.where(zero, 0.0, logp.exp() * (logp - other).masked_fill(zero, 0.0))


def ref_kl(logits_p, logits_q, temperature):
    x = logits_p.detach().cpu().double().requires_grad_()
    logp = torch.log_softmax(x / temperature, dim=-1)
    logq = ref_log_softmax(logits_q, temperature)
    return x, _plogp_terms(logp, logq).sum(-1)  # sum_v p_v (log p_v - log q_v)


def ref_entropy(logits, temperature):
    x = logits.detach().cpu().double().requires_grad_()
    logp = torch.log_softmax(x / temperature, dim=-1)
    return x, -_plogp_terms(logp, torch.zeros_like(logp)).sum(-1)  # -sum_v p_v log p_v


def grad_tolerance(name, logits, other, temperature, grad_out):
    """Absolute tolerance per gradient entry, from the size of what it is computed from.

    Each entry is |g| / temp times a sum of terms:
      logprobs  (onehot_v - p_v)                -> size onehot_v + p_v
      kl        p_v (log p_v - log q_v - KL)    -> size p_v (|log p_v| + |log q_v| + KL + 3)
      entropy   -p_v (log p_v + H)              -> size p_v (|log p_v| + H + 2)
    Any float32 evaluation is off by a few float32 epsilons of that size (at the argmax of a
    peaked p, log p - log q - KL cancels two numbers of size KL), so 16 eps32 of it is allowed.
    The + 1 per log-sum-exp: log p = (x - m) - log s with s = sum exp(x - m) >= 1, and s is off by
    an epsilon of itself, so log p is off by an epsilon however small |log p| is; likewise log q,
    and KL and H, each a difference holding such a log. A one-hot p (p_v = 1 at the argmax, KL and
    log p near 1e-8) showed it: float32 gives exactly 0 where the float64 gradient is -1.2e-11.
    The float64 reference has its own floor: its log p = x/temp - lse is off by ~eps64 |x/temp|,
    which log_softmax's backward turns into ~eps64 |x/temp| |g| / temp in every entry; 1e-13 of that
    is allowed. A wrong formula or an unwritten entry is off by far more than either."""
    logp = ref_log_softmax(logits, temperature)
    p = logp.exp()
    if name == "logprobs":
        size = torch.nn.functional.one_hot(other.cpu().long(), logits.shape[-1]).double() + p
    elif name == "kl":
        logq = ref_log_softmax(other, temperature)
        kl = _plogp_terms(logp, logq).sum(-1, keepdim=True)
        size = torch.where(p > 0, p * (logp.abs() + logq.abs() + kl + 3), 0.0)
    else:
        h = -_plogp_terms(logp, torch.zeros_like(logp)).sum(-1, keepdim=True)
        size = torch.where(p > 0, p * (logp.abs() + h + 2), 0.0)
    xs = [logits] + ([other] if name == "kl" else [])
    x_max = max(x.detach().cpu().double().nan_to_num(neginf=0.0).abs().max().item()
                for x in xs) / temperature
    # [..., 1] |g| / temp
    g_t = (grad_out.detach().cpu().double().abs() / temperature).unsqueeze(-1)
    return (16 * EPS32 * size + 1e-13 * (1 + x_max)) * g_t


# ---------------------------------------------------------------------------------------------
# Helpers.
# ---------------------------------------------------------------------------------------------
def device_for(impl):
    return "cuda" if impl == "triton_path" and HAS_CUDA else "cpu"


def make_logits(shape, scale, dtype, neg_inf_frac=0.0, device="cpu"):
    """Random logits ~ N(0, scale^2) (clamped to +-6 scale so fp16 at 1e4 stays finite), with a
    fraction of entries set to -inf, never a whole row."""
    x = torch.randn(shape).clamp_(-6, 6) * scale
    if neg_inf_frac > 0:
        drop = torch.rand(shape) < neg_inf_frac
        keep = torch.randint(0, shape[-1], shape[:-1]).unsqueeze(-1)
        drop.scatter_(-1, keep, False)  # at least one finite entry per row
        x[drop] = NEG_INF
    return x.to(dtype).to(device)


def call(impl, name, *args, temperature=1.0, small_steps=False):
    """Call kernels.<name>_torch or kernels.<name>_triton; small_steps makes the PyTorch path use
    5-row chunks and the Triton path 128-wide blocks (several steps, a ragged last one)."""
    if impl == "torch_path":
        return getattr(kernels, f"{name}_torch")(*args, temperature,
                                                 chunk_rows=5 if small_steps else None)
    return getattr(kernels, f"{name}_triton")(*args, temperature,
                                              block_size=128 if small_steps else None)


def check_forward(got, ref, atol):
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got.cpu().double(), ref.detach(), rtol=1e-5, atol=atol)


# bf16: one ulp is up to 2^-7 of the value, and Triton's interpreter truncates where GPUs round.
GRAD_RTOL = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-6}
EPS32 = torch.finfo(torch.float32).eps


def check_grad(got, ref, tol):
    """|got - ref| <= rtol(dtype) |ref| + tol (grad_tolerance) + float32 underflow of exp()
    + fp16's subnormal spacing."""
    assert got.dtype in GRAD_RTOL and got.shape == ref.shape == tol.shape
    floor = torch.finfo(torch.float32).tiny + (6e-8 if got.dtype == torch.float16 else 0.0)
    bound = GRAD_RTOL[got.dtype] * ref.abs() + tol + floor
    got = got.cpu().double()
    err = (got - ref).abs()
    worst = (err / bound).nan_to_num(nan=math.inf).argmax()
    assert (err <= bound).all(), (
        f"{int((err > bound).sum())} / {err.numel()} entries off; "
        f"worst at flat index {worst.item()}: "
        f"got {got.flatten()[worst].item():.6g}, ref {ref.flatten()[worst].item():.6g}, "
        f"bound {bound.flatten()[worst].item():.3g}"
    )


# Cases: (leading shape, V, dtype, temperature, scale, fraction of -inf entries, small_steps).
# Every required value appears: V in {1, 2, 7, 1000, 50257} and past 2^17 (primes among them;
# none a multiple of the Triton block), N in {1, 3, 16, 64}, fp32/bf16/fp16, temp in {0.5, 1, 2},
# scales from 1e-3 to 1e4, rows holding -inf, 3-D inputs.
CASES = [
    ((64,), 1000, torch.float32, 1.0, 1.0, 0.0, False),
    ((16,), 1000, torch.float32, 0.5, 1.0, 0.0, True),   # small steps: 16 rows (interpreted)
    ((3,), 7, torch.float32, 0.5, 1e4, 0.0, False),
    ((1,), 1, torch.float32, 2.0, 1.0, 0.0, False),
    ((3,), 2, torch.float16, 1.0, 10.0, 0.0, False),
    ((64,), 2, torch.bfloat16, 0.5, 1e4, 0.0, False),
    ((16,), 1000, torch.bfloat16, 2.0, 3.0, 0.0, True),
    ((64,), 1000, torch.float16, 0.5, 1e4, 0.0, False),
    ((3,), 1000, torch.float32, 1.0, 1.0, 0.5, True),
    ((3,), 1000, torch.bfloat16, 1.0, 30.0, 0.3, False),
    ((1,), 7, torch.float16, 2.0, 1e-3, 0.0, False),
    ((1,), 50257, torch.float32, 1.0, 5.0, 0.0, False),
    ((3,), 50257, torch.bfloat16, 2.0, 1e4, 0.1, False),
    ((1,), 131101, torch.float32, 1.0, 3.0, 0.0, False),  # the first prime >= 2^17
    ((1,), 151936, torch.bfloat16, 0.5, 3.0, 0.0, False),  # Qwen's vocabulary
    ((2, 5), 1000, torch.float32, 0.5, 1.0, 0.2, True),  # 3-D logits [2, 5, 1000]
    ((2, 3), 7, torch.float16, 2.0, 1e4, 0.0, False),  # 3-D logits [2, 3, 7]
]


def case_id(c):
    lead, V, dtype, T, scale, ninf, small = c
    name = f"{'x'.join(map(str, lead))}x{V}-{str(dtype)[6:]}-T{T}-s{scale:g}"
    return name + (f"-inf{ninf}" if ninf else "") + ("-small" if small else "")


impl_param = pytest.mark.parametrize("impl", IMPLS)
case_param = pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])


# ---------------------------------------------------------------------------------------------
# logprobs
# ---------------------------------------------------------------------------------------------
@impl_param
@case_param
def test_logprobs_matches_float64_reference(impl, case):
    lead, V, dtype, T, scale, ninf, small = case
    logits = make_logits(lead + (V,), scale, dtype, ninf, device_for(impl)).requires_grad_()
    # may land on a -inf logit: log-prob -inf
    targets = torch.randint(0, V, lead, device=logits.device)
    grad_out = torch.randn(lead, device=logits.device)

    out = call(impl, "logprobs", logits, targets, temperature=T, small_steps=small)
    (out * grad_out).sum().backward()

    x, ref = ref_logprobs(logits, targets, T)
    (ref * grad_out.cpu().double()).sum().backward()
    check_forward(out, ref, atol=1e-6)
    check_grad(logits.grad, x.grad, grad_tolerance("logprobs", logits, targets, T, grad_out))


@impl_param
def test_logprobs_hand_worked(impl):
    dev = device_for(impl)
    logits = torch.tensor([[1.0, 2.0, 3.0]], device=dev).log()  # p = [1, 2, 3] / 6
    t = torch.tensor([2], device=dev)
    assert call(impl, "logprobs", logits, t).item() == pytest.approx(math.log(3 / 6), rel=1e-6)
    # temp = 0.5 squares the probabilities: p = [1, 4, 9] / 14
    assert call(impl, "logprobs", logits, t,
                temperature=0.5).item() == pytest.approx(math.log(9 / 14), rel=1e-6)
    # d logp_t / d logits = (onehot - p) / temp; uniform p = 1/4, temp = 2, .sum() backward (grad 1,
    # stride 0)
    x = torch.zeros(1, 4, device=dev, requires_grad=True)
    call(impl, "logprobs", x, torch.tensor([1], device=dev), temperature=2.0).sum().backward()
    assert x.grad.tolist()[0] == pytest.approx([-1 / 8, 3 / 8, -1 / 8, -1 / 8], rel=1e-6)


@impl_param
def test_logprobs_int_dtypes_and_empty(impl):
    dev = device_for(impl)
    logits = make_logits((4, 9), 1.0, torch.float32, device=dev)
    t64 = torch.randint(0, 9, (4,), device=dev)
    _, ref = ref_logprobs(logits, t64, 1.0)
    for dtype in (torch.int32, torch.int16, torch.uint8):
        check_forward(call(impl, "logprobs", logits, t64.to(dtype)), ref, atol=1e-6)
    empty = call(impl, "logprobs", torch.zeros(0, 5, device=dev),
                 torch.zeros(0, dtype=torch.long, device=dev))
    assert empty.shape == (0,) and empty.dtype == torch.float32


def test_logprobs_torch_path_rejects_out_of_range_targets():
    logits = torch.randn(3, 10)
    with pytest.raises(ValueError, match=r"target 10 .*\[0, 10\)"):
        kernels.logprobs_torch(logits, torch.tensor([0, 10, 3]))
    with pytest.raises(ValueError, match=r"target -1 .*\[0, 10\)"):
        kernels.logprobs(logits, torch.tensor([0, -1, 3]))


@pytest.mark.skipif(not TRITON_HERE, reason="runs in test_interpreted_kernels_subprocess")
def test_logprobs_triton_path_out_of_range_is_nan():
    logits = torch.randn(3, 10, device=device_for("triton_path"))
    out = kernels.logprobs_triton(logits, torch.tensor([0, 10, -1], device=logits.device))
    assert out[0].isfinite() and out[1].isnan() and out[2].isnan()


# ---------------------------------------------------------------------------------------------
# kl
# ---------------------------------------------------------------------------------------------
@impl_param
@case_param
def test_kl_matches_float64_reference(impl, case):
    lead, V, dtype, T, scale, ninf, small = case
    p = make_logits(lead + (V,), scale, dtype, ninf, device_for(impl))
    # q: p plus noise (same -inf entries), so KL spans small and large values across cases
    q = (p.float() + torch.randn_like(p.float()) * scale * 0.5).to(dtype)
    p.requires_grad_()
    grad_out = torch.randn(lead, device=p.device)

    out = call(impl, "kl", p, q, temperature=T, small_steps=small)
    (out * grad_out).sum().backward()

    x, ref = ref_kl(p, q, T)
    (ref * grad_out.cpu().double()).sum().backward()
    check_forward(out, ref, atol=1e-6 * (1 + math.log(V)))
    check_grad(p.grad, x.grad, grad_tolerance("kl", p, q, T, grad_out))


@impl_param
@pytest.mark.parametrize("seed, case", [(950976877, "3x1000-bfloat16-T1.0-s30-inf0.3"),
                                        (64, "3x1000-bfloat16-T1.0-s30-inf0.3"),
                                        (565, "3x2-float16-T1.0-s10"),
                                        (684, "3x2-float16-T1.0-s10")])
def test_kl_seeds_that_found_the_tolerances_floor(impl, seed, case):
    """Seeds a random search found failing before grad_tolerance counted each log-sum-exp's own
    epsilon: a row whose p is one-hot to float32 (log p = 0 where float64 has -8e-12) and fp16's
    two-entry rows."""
    torch.manual_seed(seed)
    test_kl_matches_float64_reference(impl, next(c for c in CASES if case_id(c) == case))


@impl_param
def test_kl_gradient_at_a_one_hot_p_hand_worked(impl):
    """p = softmax([0, -25]), q = softmax([0, -17]): off the argmax p has e^-25 and q e^-17, both
    below float32's epsilon of 1. At the argmax d KL / d x_0 = p_0 (log p_0 - log q_0 - KL) =
    e^-25 (25 - 17) + O(e^-34) = 1.111e-10 in float64; float32 rounds log p_0, log q_0 and KL to 0
    and gets 0. That is right to float32's precision (an epsilon of each log-sum-exp), which the
    tolerance must allow; the entry off the argmax, -1.111e-10, float32 gets to 1e-6."""
    dev = device_for(impl)
    p = torch.tensor([[0.0, -25.0]], device=dev, requires_grad=True)
    q = torch.tensor([[0.0, -17.0]], device=dev)
    call(impl, "kl", p, q).sum().backward()
    x, ref = ref_kl(p, q, 1.0)
    ref.sum().backward()
    assert x.grad[0, 0].item() == pytest.approx(8 * math.exp(-25), rel=1e-6)
    assert p.grad[0, 1].item() == pytest.approx(-8 * math.exp(-25), rel=1e-6)
    check_grad(p.grad, x.grad, grad_tolerance("kl", p, q, 1.0, torch.ones(1, device=dev)))


@impl_param
def test_kl_properties_and_hand_worked(impl):
    dev = device_for(impl)
    # KL >= 0 at every scale, including nearly identical distributions
    for scale in (1e-3, 1.0, 1e4):
        p = make_logits((64, 300), scale, torch.float32, device=dev)
        q = p + 1e-4 * scale * torch.randn_like(p)
        assert (call(impl, "kl", p, q) >= 0).all()
        # KL(p || p) = 0, exactly, also with -inf entries
        p = make_logits((64, 300), scale, torch.float32, 0.3, device=dev)
        assert (call(impl, "kl", p, p.clone()) == 0).all()
    # p = [1/2, 1/2], q = [1/4, 3/4]: KL = 1/2 log 2 + 1/2 log(2/3) = 1/2 log(4/3)
    p = torch.zeros(1, 2, device=dev)
    q = torch.tensor([[1.0, 3.0]], device=dev).log()
    assert call(impl, "kl", p, q).item() == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6)


@impl_param
def test_kl_infinite_entries(impl):
    dev = device_for(impl)
    p = torch.tensor([[0.0, 1.0, NEG_INF], [0.0, 1.0, 2.0]], device=dev)
    q = torch.tensor([[0.5, 0.0, 3.0], [0.5, 0.0, NEG_INF]], device=dev)
    out = call(impl, "kl", p, q)
    # row 0: p_2 = 0 where q_2 > 0 contributes 0 log 0 = 0; row 1: q_2 = 0 < p_2 gives +inf
    _, ref = ref_kl(p, q, 1.0)
    assert torch.isfinite(ref[0]) and ref[1] == math.inf
    check_forward(out, ref, atol=1e-6)


def test_kl_rejects_reference_that_requires_grad():
    p, q = torch.randn(2, 5, requires_grad=True), torch.randn(2, 5, requires_grad=True)
    with pytest.raises(ValueError, match="logits_q requires grad"):
        kernels.kl(p, q)
    with pytest.raises(ValueError, match="same shape"):
        kernels.kl(p, torch.randn(2, 6))
    kernels.kl(p, q.detach())  # fine


# ---------------------------------------------------------------------------------------------
# entropy
# ---------------------------------------------------------------------------------------------
@impl_param
@case_param
def test_entropy_matches_float64_reference(impl, case):
    lead, V, dtype, T, scale, ninf, small = case
    logits = make_logits(lead + (V,), scale, dtype, ninf, device_for(impl)).requires_grad_()
    grad_out = torch.randn(lead, device=logits.device)

    out = call(impl, "entropy", logits, temperature=T, small_steps=small)
    (out * grad_out).sum().backward()

    x, ref = ref_entropy(logits, T)
    (ref * grad_out.cpu().double()).sum().backward()
    check_forward(out, ref, atol=1e-6)
    check_grad(logits.grad, x.grad, grad_tolerance("entropy", logits, None, T, grad_out))


@impl_param
def test_entropy_properties_and_hand_worked(impl):
    dev = device_for(impl)
    V = 1000
    assert call(impl, "entropy", torch.zeros(3, V, device=dev)).tolist() == pytest.approx(
        [math.log(V)] * 3, rel=1e-6)
    one_hot = torch.full((2, V), NEG_INF, device=dev)
    one_hot[:, 17] = 5.0
    assert call(impl, "entropy", one_hot).tolist() == pytest.approx([0.0, 0.0], abs=1e-7)
    assert call(impl, "entropy", torch.zeros(1, 2, device=dev)).item() == pytest.approx(math.log(2),
                                                                                        rel=1e-6)
    for scale in (1e-3, 1.0, 1e4):
        h = call(impl, "entropy", make_logits((64, V), scale, torch.float32, device=dev))
        assert (h >= 0).all() and (h <= math.log(V) * (1 + 1e-6)).all()


# ---------------------------------------------------------------------------------------------
# Shapes and strides: slices, transposes, 4-D; and the row bookkeeping itself.
# ---------------------------------------------------------------------------------------------
@impl_param
@pytest.mark.parametrize("layout", ["sliced", "transposed", "4d", "rows_across_batches"])
def test_non_contiguous_inputs(impl, layout):
    dev = device_for(impl)
    V = 37
    if layout == "sliced":  # model(idx)[:, :-1]: [2, 6, V] out of [2, 7, V]
        base = make_logits((2, 7, V), 2.0, torch.float32, device=dev)
        view = lambda t: t[:, :-1]
    elif layout == "transposed":  # stride(-1) != 1
        base = make_logits((2, V, 6), 2.0, torch.float32, device=dev)
        view = lambda t: t.transpose(1, 2)
    elif layout == "4d":
        base = make_logits((2, 3, 4, V), 2.0, torch.float32, device=dev)
        view = lambda t: t
    else:  # short sliced rows: a PyTorch-path chunk spans several batch entries (and is copied)
        base = make_logits((7, 3, V), 2.0, torch.float32, device=dev)
        view = lambda t: t[:, :-1]
    base.requires_grad_()
    logits = view(base)
    other = view(make_logits(base.shape, 2.0, torch.float32, device=dev))
    targets = torch.randint(0, V, logits.shape[:-1], device=dev)
    ones = torch.ones(logits.shape[:-1])
    for name, args, ref_fn in [
        ("logprobs", (logits, targets), ref_logprobs),
        ("kl", (logits, other), ref_kl),
        ("entropy", (logits,), ref_entropy),
    ]:
        base.grad = None
        out = call(impl, name, *args, small_steps=True)
        assert out.shape == logits.shape[:-1]
        out.sum().backward()  # the grad of .sum() reaches the kernels expanded (stride 0)
        x, ref = ref_fn(*args, 1.0)
        ref.sum().backward()
        check_forward(out, ref, atol=1e-5)
        tol = grad_tolerance(name, logits, args[1] if len(args) > 1 else None, 1.0, ones)
        check_grad(base.grad, _scatter_back(base, view, x.grad), _scatter_back(base, view, tol))


def _scatter_back(base, view, grad_view):
    """The gradient w.r.t. base of a function of view(base), given the gradient w.r.t. the view."""
    b = torch.zeros(base.shape, dtype=torch.float64, requires_grad=True)
    view(b).backward(grad_view)
    return b.grad


def test_rows_are_views_for_slices():
    x = torch.randn(2, 7, 11)
    assert as_rows(x[:, :-1]).data_ptr() == x.data_ptr()  # no copy of a sliced [B, T-1, V]
    x3 = as_rows(torch.randn(6, 4, 5))
    for chunk_rows in (1, 3, 4, 10, 100):
        ranges = chunk_ranges(x3, chunk_rows)
        assert [r for a, b in ranges
                for r in range(a, b)] == list(range(24))                  # every row once, in order
        assert all(b - a <= chunk_rows for a, b in ranges)
        for a, b in ranges:
            assert torch.equal(take_rows(x3, a, b), x3.reshape(24, 5)[a:b])


# ---------------------------------------------------------------------------------------------
# The edge-case table: one list of awkward inputs, each with the result the math gives, run
# through every function on both paths. Each case is two rows: the edge row, and a healthy row
# (so that a NaN leaking across rows is caught). Expected values are written down, or computed
# by the plain-Python float64 formulas below (never by the code under test); NaN means the
# function must return NaN there, never a number.
# ---------------------------------------------------------------------------------------------
NAN, INF = float("nan"), float("inf")
LOG2, LOG3 = math.log(2), math.log(3)
MIN_T, MAX_T = kernels.MIN_TEMPERATURE, kernels.MAX_TEMPERATURE


def _log_softmax(xs, temp):
    """log softmax(xs / temp) of a list of floats with at least one finite entry, in float64."""
    xs = [x / temp for x in xs]
    m = max(xs)
    lse = m + math.log(sum(math.exp(x - m) for x in xs))
    return [x - lse for x in xs]


def formula_logprobs(logits, target, temp=1.0):
    """logprob = log p_t, d/d logits = (onehot - p) / temp."""
    logp = _log_softmax(logits, temp)
    return logp[target], [((v == target) - math.exp(lp)) / temp for v, lp in enumerate(logp)]


def formula_kl(a, b, temp=1.0):
    """KL = sum_v p_v (log p_v - log q_v) over p_v > 0, d/d a = p (log p - log q - KL) / temp."""
    logp, logq = _log_softmax(a, temp), _log_softmax(b, temp)
    kl = sum(math.exp(lp) * (lp - lq) for lp, lq in zip(logp, logq) if lp > -INF)
    return kl, [math.exp(lp) * (lp - lq - kl) / temp if lp > -INF else 0.0
                for lp, lq in zip(logp, logq)]


def formula_entropy(logits, temp=1.0):
    """H = -sum_v p_v log p_v over p_v > 0, d/d logits = -p (log p + H) / temp."""
    logp = _log_softmax(logits, temp)
    h = -sum(math.exp(lp) * lp for lp in logp if lp > -INF)
    return h, [-math.exp(lp) * (lp + h) / temp if lp > -INF else 0.0 for lp in logp]


def formula_linear(hidden, weight, targets, temp=1.0):
    """linear_logprobs from logits = hidden @ weight.T: values, d hidden = dx @ weight and
    d weight = dx.T @ hidden, with dx = (onehot - p) / temp per row."""
    values, dx = [], []
    for h, t in zip(hidden, targets):
        value, d = formula_logprobs([sum(hc * wc for hc, wc in zip(h, w)) for w in weight], t, temp)
        values.append(value)
        dx.append(d)
    grad_h = [[sum(d[v] * weight[v][c] for v in range(len(weight))) for c in range(len(weight[0]))]
              for d in dx]
    grad_w = [[sum(dx[n][v] * hidden[n][c] for n in range(len(hidden)))
               for c in range(len(weight[0]))] for v in range(len(weight))]
    return values, grad_h, grad_w


def row_case(case_id, fn, edge, value, grad, temp=1.0, atol=(1e-6, 1e-6)):
    """A case for logprobs / kl / entropy: edge = the edge row's inputs (logits and target, p and
    q, or logits), with its expected value and gradient row; a healthy row of the same V is
    appended, with its expectation from the formula. atol: (value, gradient) absolute tolerances."""
    V = len(edge[0])
    healthy = {1: ([2.0], [-1.0], 0), 3: ([0.0, 1.0, 3.0], [1.0, 0.0, -1.0], 2)}[V]
    if fn == "logprobs":
        rows = [edge, (healthy[0], healthy[2])]
        ok_value, ok_grad = formula_logprobs(healthy[0], healthy[2], temp)
    elif fn == "kl":
        rows = [edge, (healthy[0], healthy[1])]
        ok_value, ok_grad = formula_kl(healthy[0], healthy[1], temp)
    else:
        rows = [edge, (healthy[0],)]
        ok_value, ok_grad = formula_entropy(healthy[0], temp)
    # logits [2, V] (and q [2, V] or targets [2])
    inputs = [torch.tensor([r[i] for r in rows]) for i in range(len(edge))]
    return pytest.param(fn, inputs, temp, [[value, ok_value]], [[grad, ok_grad]], atol,
                        id=f"{fn}-{case_id}")


def linear_case(case_id, hidden, weight, targets, value=None, grad_h=None, grad_w=None, temp=1.0,
                atol=(1e-6, 1e-6)):
    """A case for linear_logprobs(hidden [N, C], weight [V, C], targets [N]); what is not given
    comes from formula_linear."""
    if value is None:
        value, grad_h, grad_w = formula_linear(hidden, weight, targets, temp)
    C = len(weight[0])
    inputs = [torch.tensor(hidden).reshape(-1, C), torch.tensor(weight),
              torch.tensor(targets, dtype=torch.long)]
    return pytest.param("linear_logprobs", inputs, temp, [value], [grad_h, grad_w], atol,
                        id=f"linear_logprobs-{case_id}")


NAN3 = [NAN] * 3
W3 = [[1.0, 0.0], [-1.0, 1.0], [2.0, -1.0]]  # linear_logprobs: weight [V = 3, C = 2]
H_OK = [0.5, 1.0]  # a healthy hidden row: logits [0.5, 0.5, 0]
# its log-prob at target 1, its hidden gradient
OK_VALUE, OK_GRAD_H, _ = formula_linear([H_OK], W3, [1])
EDGE_CASES = [
    # --- logprobs: (logits row, target) -> log p_t, gradient row -----------------------------
    row_case("nan_logit", "logprobs", ([0.0, NAN, 1.0], 0), NAN, NAN3),
    row_case("pos_inf_logit", "logprobs", ([0.0, INF, 1.0], 0), NAN, NAN3),
    row_case("pos_inf_target", "logprobs", ([0.0, INF, 1.0], 1), NAN, NAN3),  # inf / inf: undefined
    row_case("neg_inf_logit", "logprobs", ([0.0, -INF, 0.0], 0), math.log(0.5), [0.5, 0.0, -0.5]),
    row_case("target_at_neg_inf", "logprobs", ([0.0, -INF, 0.0], 1), -INF, [-0.5, 1.0, -0.5]),
    row_case("all_neg_inf", "logprobs", ([-INF] * 3, 0), NAN, NAN3),
    row_case("tiny_temp_argmax", "logprobs", ([0.0, 1.0, 2.0], 0), -2000.0, [1000.0, 0.0, -1000.0],
             temp=MIN_T),
    row_case("tiny_temp", "logprobs", ([0.0, 1e-3, 2e-3], 1),
             *formula_logprobs([0.0, 1e-3, 2e-3], 1, MIN_T),
             temp=MIN_T, atol=(1e-6, 1e-3)),
    row_case("huge_temp", "logprobs", ([0.0, 1.0, 2.0], 2),
             *formula_logprobs([0.0, 1.0, 2.0], 2, MAX_T), temp=MAX_T,
             atol=(1e-6, 1e-9)),
    row_case("V1", "logprobs", ([5.0], 0), 0.0, [0.0]),
    row_case("V1_neg_inf", "logprobs", ([-INF], 0), NAN, [NAN]),
    # --- kl: (p row, q row) -> KL(p || q), gradient row w.r.t. p ------------------------------
    row_case("nan_in_p", "kl", ([0.0, NAN, 1.0], [0.0, 0.0, 0.0]), NAN, NAN3),
    row_case("nan_in_q", "kl", ([0.0, 0.0, 1.0], [0.0, NAN, 0.0]), NAN, NAN3),
    row_case("pos_inf_in_p", "kl", ([0.0, INF, 1.0], [0.0, 0.0, 0.0]), NAN, NAN3),
    row_case("pos_inf_in_q", "kl", ([0.0, 0.0, 1.0], [0.0, INF, 1.0]), NAN, NAN3),
    # p = [1/2, 0, 1/2], q = [1/4, 1/4, 1/2]: KL = 1/2 log 2; gradient p (log p - log q - KL)
    row_case("neg_inf_in_p", "kl", ([0.0, -INF, 0.0], [0.0, 0.0, LOG2]), LOG2 / 2,
             [LOG2 / 4, 0.0, -LOG2 / 4]),
    # 0 log 0/0 = 0
    row_case("zero_in_both", "kl", ([0.0, -INF, 0.0], [0.0, -INF, 0.0]), 0.0, [0.0, 0.0, 0.0]),
    # q = 0 < p: KL = +inf; its gradient p (log p - log q - inf) is NaN there and -inf elsewhere
    row_case("q_zero_under_p", "kl", ([0.0, 0.0, 0.0], [0.0, -INF, 0.0]), INF, [-INF, NAN, -INF]),
    row_case("all_neg_inf_p", "kl", ([-INF] * 3, [0.0, 0.0, 0.0]), NAN, NAN3),
    row_case("all_neg_inf_q", "kl", ([0.0, 0.0, 0.0], [-INF] * 3), NAN, NAN3),
    # temp 1e-3: p = one-hot at 2, q = one-hot at 0 (up to e^-1000): KL = 2000, gradient 0
    row_case("tiny_temp_argmax", "kl", ([0.0, 1.0, 2.0], [2.0, 1.0, 0.0]), 2000.0, [0.0, 0.0, 0.0],
             temp=MIN_T),
    row_case("tiny_temp", "kl", ([0.0, 1e-3, 2e-3], [2e-3, 0.0, 1e-3]),
             *formula_kl([0.0, 1e-3, 2e-3], [2e-3, 0.0, 1e-3], MIN_T), temp=MIN_T,
             atol=(1e-6, 1e-3)),
    row_case("huge_temp", "kl", ([0.0, 1.0, 2.0], [2.0, 1.0, 0.0]),
             *formula_kl([0.0, 1.0, 2.0], [2.0, 1.0, 0.0], MAX_T), temp=MAX_T, atol=(3e-7, 1e-9)),
    row_case("V1", "kl", ([5.0], [-3.0]), 0.0, [0.0]),
    # --- entropy: (logits row,) -> H, gradient row --------------------------------------------
    row_case("nan_logit", "entropy", ([0.0, NAN, 1.0],), NAN, NAN3),
    row_case("pos_inf_logit", "entropy", ([0.0, INF, 1.0],), NAN, NAN3),
    # p = [1/4, 0, 3/4]
    row_case("neg_inf_logit", "entropy", ([0.0, -INF, LOG3],), *formula_entropy([0.0, -INF, LOG3])),
    row_case("all_neg_inf", "entropy", ([-INF] * 3,), NAN, NAN3),
    row_case("tiny_temp_argmax", "entropy", ([0.0, 1.0, 2.0],), 0.0, [0.0, 0.0, 0.0], temp=MIN_T),
    row_case("tiny_temp", "entropy", ([0.0, 1e-3, 2e-3],),
             *formula_entropy([0.0, 1e-3, 2e-3], MIN_T), temp=MIN_T,
             atol=(1e-6, 1e-3)),
    row_case("huge_temp", "entropy", ([0.0, 1.0, 2.0],), *formula_entropy([0.0, 1.0, 2.0], MAX_T),
             temp=MAX_T,
             atol=(1e-6, 1e-9)),
    row_case("V1", "entropy", ([5.0],), 0.0, [0.0]),
    # --- linear_logprobs: (hidden [2, C], weight [V, C], targets [2]) -> log-probs, d hidden, d
    # weight a NaN or inf in hidden_0: token 0 NaN (and its hidden gradient), token 1 intact, all of
    # d weight NaN
    linear_case("nan_hidden", [[NAN, 1.0], H_OK], W3, [0, 1], [NAN, OK_VALUE[0]],
                [[NAN, NAN], OK_GRAD_H[0]], [[NAN, NAN]] * 3),
    linear_case("inf_hidden", [[INF, 1.0], H_OK], W3, [0, 1], [NAN, OK_VALUE[0]],
                [[NAN, NAN], OK_GRAD_H[0]], [[NAN, NAN]] * 3),
    linear_case("nan_weight", [[0.0, 1.0], H_OK], [[1.0, 0.0], [NAN, 1.0], [2.0, -1.0]], [0, 1],
                [NAN, NAN],
                [[NAN, NAN]] * 2, [[NAN, NAN]] * 3),
    # temp 1e-3, C = 1: logits [0, 1, 2] -> dx = [1000, 0, -1000]; logits [0, .5, 1] at its argmax
    # -> dx = 0
    linear_case("tiny_temp_argmax", [[1.0], [0.5]], [[0.0], [1.0], [2.0]], [0, 2], [-2000.0, 0.0],
                [[-2000.0], [0.0]], [[1000.0], [0.0], [-1000.0]], temp=MIN_T),
    linear_case("huge_temp", [[1.0, 2.0], H_OK], W3, [0, 2], temp=MAX_T, atol=(1e-6, 1e-9)),
    linear_case("V1", [[1.0, 2.0], H_OK], [[0.3, -0.2]], [0, 0], [0.0, 0.0], [[0.0, 0.0]] * 2,
                [[0.0, 0.0]]),
]
EMPTY_CASES = ["logprobs", "kl", "entropy", "linear_logprobs"]


def _run_case(impl, fn, inputs, temp):
    """Call the function on the case's inputs (moved to the path's device); returns its value and
    the gradients of value.sum() w.r.t. the differentiable inputs."""
    dev = device_for(impl)
    inputs = [x.to(dev) for x in inputs]
    wrt = inputs[:2] if fn == "linear_logprobs" else inputs[:1]
    for x in wrt:
        x.requires_grad_()
    suffix = "_torch" if impl == "torch_path" else "_triton"
    value = getattr(kernels, fn + suffix)(*inputs, temp)
    return value, torch.autograd.grad(value.sum(), wrt)


@impl_param
@pytest.mark.parametrize("fn, inputs, temp, value, grads, atol", EDGE_CASES)
def test_edge_cases(impl, fn, inputs, temp, value, grads, atol):
    got, got_grads = _run_case(impl, fn, inputs, temp)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.cpu().double(), torch.tensor(value[0], dtype=torch.float64),
                               rtol=1e-5, atol=atol[0], equal_nan=True)
    for g, want in zip(got_grads, grads):
        torch.testing.assert_close(g.cpu().double(), torch.tensor(want, dtype=torch.float64),
                                   rtol=1e-5, atol=atol[1], equal_nan=True)


@impl_param
@pytest.mark.parametrize("fn", EMPTY_CASES)
def test_edge_case_empty(impl, fn):
    """N = 0 rows: an empty float32 result, empty gradients (linear_logprobs: d weight = 0)."""
    if fn == "linear_logprobs":
        inputs = [torch.zeros(0, 4), torch.randn(5, 4), torch.zeros(0, dtype=torch.long)]
    else:
        x = torch.zeros(2, 0, 3)
        inputs = {"logprobs": [x, torch.zeros(2, 0, dtype=torch.long)], "kl": [x, x.clone()],
                  "entropy": [x]}[fn]
    value, grads = _run_case(impl, fn, inputs, 1.0)
    assert value.shape == inputs[0].shape[:-1] and value.dtype == torch.float32
    assert grads[0].shape == inputs[0].shape
    if fn == "linear_logprobs":
        assert grads[1].shape == inputs[1].shape and (grads[1] == 0).all()


@pytest.mark.parametrize("bad", [0.0, -1.0, NAN, INF, 1e-30, 0.999 * MIN_T, 1.001 * MAX_T, 1e30])
def test_temperature_range(bad):
    """Temperatures outside [MIN_TEMPERATURE, MAX_TEMPERATURE] raise on every function and path,
    naming the value and the range; the bounds themselves are accepted."""
    x = torch.randn(2, 5)
    t = torch.zeros(2, dtype=torch.long)
    calls = [("logprobs", (x, t)), ("kl", (x, x)), ("entropy", (x,)),
             ("linear_logprobs", (x, torch.randn(3, 5), t))]
    for name, args in calls:
        for suffix in ("", "_torch", "_triton"):
            with pytest.raises(ValueError,
                               match=rf"temperature must lie in \[0.001, 1000\]"
                                     rf".*got {re.escape(repr(float(bad)))}"):
                getattr(kernels, name + suffix)(*args, temperature=bad)
        for ok in (MIN_T, MAX_T):
            assert getattr(kernels, name + "_torch")(*args, temperature=ok).isfinite().all()


# ---------------------------------------------------------------------------------------------
# Arguments, dispatch, and Triton being optional.
# ---------------------------------------------------------------------------------------------
def test_logprobs_argument_checks():
    x = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="targets shape"):
        kernels.logprobs(x, torch.zeros(2, dtype=torch.long))
    with pytest.raises(TypeError, match="integer"):
        kernels.logprobs(x, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="vocabulary"):
        kernels.entropy(torch.zeros(3, 0))


def test_dispatch():
    """CPU tensors go to Triton exactly when this process was started with TRITON_INTERPRET=1."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON
    expect = "Triton" if interpreted else "Torch"
    x = torch.randn(2, 5, requires_grad=True)
    grad_fn = kernels.logprobs(x, torch.zeros(2, dtype=torch.long)).grad_fn
    assert type(grad_fn).__name__ == f"_Logprobs{expect}Backward"
    assert type(kernels.kl(x, x.detach()).grad_fn).__name__ == f"_KL{expect}Backward"
    assert type(kernels.entropy(x).grad_fn).__name__ == f"_Entropy{expect}Backward"
    w = torch.randn(3, 5, requires_grad=True)
    out = kernels.linear_logprobs(x, w, torch.zeros(2, dtype=torch.long))
    assert type(out.grad_fn).__name__ == f"_LinearLogprobs{expect}Backward"
    if HAS_CUDA and HAS_TRITON:
        y = x.detach().cuda().requires_grad_()
        assert type(kernels.entropy(y).grad_fn).__name__ == "_EntropyTritonBackward"


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child_env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def test_pytorch_path_works_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch, kernels\n"
        "assert not kernels.HAS_TRITON\n"
        "x = torch.randn(3, 11, requires_grad=True)\n"
        "w = torch.randn(5, 11, requires_grad=True)\n"
        "(kernels.logprobs(x, torch.tensor([1, 2, 3])).sum() + kernels.kl(x, x.detach() + 1).sum()"
        " + kernels.entropy(x).sum()"
        " + kernels.linear_logprobs(x, w, torch.tensor([0, 4, 2])).sum()).backward()\n"
        "assert w.grad.isfinite().all()\n"
        "assert x.grad.isfinite().all()\n"
        "try:\n    kernels.entropy_triton(x)\n"
        "except RuntimeError as e:\n    assert 'not installed' in str(e)\n"
        "else:\n    raise AssertionError('entropy_triton ran without triton')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], env=_child_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.skipif(not HAS_TRITON or HAS_CUDA or TRITON_INTERPRET,
                    reason="Triton cases run in this process (CUDA or TRITON_INTERPRET=1), or "
                           "Triton is missing")
@pytest.mark.slow
def test_interpreted_kernels_subprocess():
    """Run this file's `triton_path` and `dispatch` tests under TRITON_INTERPRET=1 in a child."""
    cmd = [sys.executable, "-m", "pytest", os.path.abspath(__file__), "-q", "-n", "0", "-p",
           "no:cacheprovider", "-k", "triton_path or dispatch"]
    run = subprocess.run(cmd, env=_child_env(TRITON_INTERPRET="1"), cwd=REPO, capture_output=True,
                         text=True, timeout=900)
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, tail
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], tail
    print(run.stdout.splitlines()[-1])  # e.g. "63 passed in 40s"


@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU with ~12 GB free")
def test_int64_row_offsets_cuda():
    """N * V > 2^31 elements: row offsets must be computed in int64."""
    N, V = 16384, 151936  # 2.49e9 elements, bf16: 5 GB
    logits = torch.randn(N, V, device="cuda", dtype=torch.bfloat16)
    targets = torch.randint(0, V, (N,), device="cuda")
    out = kernels.logprobs(logits, targets)
    h = kernels.entropy(logits)
    last = slice(N - 4, N)  # rows whose offsets pass 2^31
    _, ref = ref_logprobs(logits[last], targets[last], 1.0)
    check_forward(out[last], ref, atol=1e-6)
    _, ref = ref_entropy(logits[last], 1.0)
    check_forward(h[last], ref, atol=1e-6)
