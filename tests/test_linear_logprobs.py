"""Tests for kernels.linear_logprobs: log softmax((hidden @ weight.T) / temp)[targets] without the
logits, through both the PyTorch and the Triton path (its edge cases are in test_kernels.py's
EDGE_CASES table).

Every value and both gradients are checked against a float64 reference written here from the
equation (logits = hidden @ weight.T in float64, then log_softmax and gather), on fresh random
inputs each run (replay a failure with KERNELS_TEST_SEED=<seed>). As in test_kernels.py, the
Triton cases run on a GPU when there is one, and otherwise in a child pytest under
TRITON_INTERPRET=1 (`test_interpreted_linear_logprobs_subprocess`), at small sizes: tl.dot is
slow in the interpreter.

Tolerances, from what each path computes. Products of float32, bfloat16 or float16 inputs are
exact in float32, and both paths sum them in float32, so a logit is off by at most a few eps32
times sum_c |hidden_c weight_vc| / temp; a log-prob by twice that. The gradients come back in the
inputs' dtype (rtol: that dtype's rounding), and the Triton path rounds dx = grad (onehot - p) /
temp to the inputs' dtype before the two gradient products, as PyTorch's own bfloat16 backward
does: that costs eps(dtype) times sum_v |dx_v| |weight_vc| (d hidden) or sum_n |dx_n| |hidden_nc|
(d weight). A wrong formula (a missing 1/temp, onehot or softmax term) is off by the size of
those sums itself.
"""

import importlib
import math
import os
import subprocess
import sys

import pytest
import torch

import kernels
from kernels import HAS_TRITON, TRITON_INTERPRET
# the same autouse fixtures as test_kernels.py: NaN-filled torch.empty, a fresh seed
from test_kernels import fresh_seed, nan_filled_empty  # noqa: F401

HAS_CUDA = torch.cuda.is_available()
TRITON_HERE = HAS_TRITON and (HAS_CUDA or TRITON_INTERPRET)
IMPLS = ["torch_path"] + (["triton_path"] if TRITON_HERE else [])
EPS32 = torch.finfo(torch.float32).eps
# unit roundoff of each dtype
EPS = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def device_for(impl):
    return "cuda" if impl == "triton_path" and HAS_CUDA else "cpu"


def call(impl, hidden, weight, targets, temperature, small_chunks=False):
    if impl == "torch_path":
        chunks = {"chunk_rows": 3, "chunk_vocab": 16} if small_chunks else {}
        return kernels.linear_logprobs_torch(hidden, weight, targets, temperature, **chunks)
    return kernels.linear_logprobs_triton(hidden, weight, targets, temperature)


def reference(hidden, weight, targets, temperature):
    """float64, from the equation: (value, d value.sum()/d hidden, d/d weight, dx, logits)."""
    h = hidden.detach().cpu().double().requires_grad_()
    w = weight.detach().cpu().double().requires_grad_()
    logits = (h @ w.T) / temperature  # [..., V]
    logp = torch.log_softmax(logits, dim=-1)
    value = logp.gather(-1, targets.cpu().long().unsqueeze(-1)).squeeze(-1)
    return value, h, w, logp.detach()


def check(impl, hidden, weight, targets, temperature, grad_out, base=None, small_chunks=False):
    """Run forward + backward on one path and compare value and both gradients with the float64
    reference. base: the leaf that `hidden` is a view of (for sliced inputs)."""
    base = hidden if base is None else base
    out = call(impl, hidden, weight, targets, temperature, small_chunks)
    assert out.dtype == torch.float32 and out.shape == targets.shape
    (out * grad_out).sum().backward()

    value, h, w, logp = reference(hidden, weight, targets, temperature)
    (value * grad_out.cpu().double()).sum().backward()
    dtype = hidden.dtype
    hd, wd = hidden.detach().cpu().double(), weight.detach().cpu().double()
    # value: x = logits / temp is off by a few eps32 of sum_c |h_c w_vc| / temp (largest in the row)
    x_err = 8 * EPS32 * (hd.abs() @ wd.abs().T).amax(-1, keepdim=True) / temperature  # [..., 1]
    torch.testing.assert_close(out.detach().cpu().double(), value.detach(), rtol=1e-5,
                               atol=1e-6 + 2 * x_err.max().item())
    # gradients: per entry of dx = (grad / temp)(onehot - p), the rounding of dx to the inputs'
    # dtype and float32 sums (relative to onehot + p), p's own error from x's (p * 2 x_err), and
    # float32 underflow; carried through the products with |weight| or |hidden|; plus the
    # result's rounding to the inputs' dtype.
    p = logp.exp()
    onehot = torch.nn.functional.one_hot(targets.cpu().long(), weight.shape[0]).double()
    g = grad_out.cpu().double().abs().unsqueeze(-1) / temperature  # [..., 1]
    tiny = torch.finfo(torch.float32).tiny  # p below it underflows to 0 in float32
    # dx is stored in the inputs' dtype, and an entry below its smallest normal number loses more
    # than EPS: float16 keeps subnormals, rounded to half their spacing (EPS * tiny, 3e-8);
    # bfloat16's are flushed to zero (the interpreter's conversion), an error up to tiny (1.2e-38).
    # Absolute, not relative to dx
    dx_sub = {torch.float16: EPS[dtype] * torch.finfo(dtype).tiny,
              torch.bfloat16: torch.finfo(dtype).tiny}.get(dtype, 0.0)
    # [..., V]
    dx_err = g * ((4 * EPS[dtype] + 16 * EPS32) * (onehot + p) + 4 * x_err * p + 2 * tiny) + dx_sub
    tol_h = dx_err @ wd.abs()  # [..., C]
    tol_w = dx_err.reshape(-1, dx_err.shape[-1]).T @ hd.reshape(-1, hd.shape[-1]).abs()  # [V, C]
    for name, got, ref, tol in [("hidden", base.grad, h.grad, tol_h),
                                ("weight", weight.grad, w.grad, tol_w)]:
        # the gradient of the slice, placed in the base's shape
        if name == "hidden" and base is not hidden:
            ref_full = torch.zeros(base.shape, dtype=torch.float64)
            tol_full = torch.zeros(base.shape, dtype=torch.float64)
            ref_full[:, :-1], tol_full[:, :-1] = ref, tol
            ref, tol = ref_full, tol_full
        assert got.dtype == dtype and got.shape == ref.shape, name
        err = (got.cpu().double() - ref).abs()
        # spacing of the dtype's subnormals (fp16: 6e-8)
        subnormal = 2 * EPS[dtype] * torch.finfo(dtype).tiny
        bound = 2 * EPS[dtype] * ref.abs() + tol + subnormal
        worst = (err / bound).argmax()
        assert (err <= bound).all(), (
            f"d {name}: {int((err > bound).sum())} / {err.numel()} entries off; worst: "
            f"got {got.flatten()[worst].item():.6g}, ref {ref.flatten()[worst].item():.6g}, "
            f"bound {bound.flatten()[worst].item():.3g}")


# (leading shape of hidden, C, V, dtype, temperature, scale of hidden): odd C and V (none a
# multiple of the 16..128 blocks; 37 and 131 prime), V = 1, N = 1, N past one token block (70),
# C past one channel step (70), bf16 and fp16, temperatures != 1, and large logits (hidden scale
# 300: |logits| ~ 1e3, so exp underflows to 0 for most entries; no log-prob may become -inf).
CASES = [
    ((5,), 24, 37, torch.float32, 1.0, 1.0),
    ((1,), 17, 1, torch.float32, 0.5, 1.0),
    ((1,), 8, 131, torch.float32, 2.0, 1.0),
    ((2, 7), 40, 300, torch.bfloat16, 0.7, 1.0),
    ((70,), 70, 130, torch.float16, 2.0, 1.0),
    ((6,), 20, 50, torch.float32, 1.0, 300.0),
    ((4,), 33, 19, torch.bfloat16, 1.0, 300.0),
]


def case_id(c):
    lead, C, V, dtype, temp, scale = c
    return f"{'x'.join(map(str, lead))}xC{C}-V{V}-{str(dtype)[6:]}-T{temp}-s{scale:g}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_matches_float64_reference(impl, case):
    lead, C, V, dtype, temp, scale = case
    dev = device_for(impl)
    hidden = (scale * torch.randn(*lead, C)).to(dtype).to(dev).requires_grad_()
    weight = (torch.randn(V, C) / C**0.5).to(dtype).to(dev).requires_grad_()
    targets = torch.randint(0, V, lead, device=dev)
    grad_out = torch.randn(lead, device=dev)
    check(impl, hidden, weight, targets, temp, grad_out)
    if scale > 1:
        # no -inf from large logits
        assert torch.isfinite(call(impl, hidden, weight, targets, temp)).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_sliced_hidden_and_chunking(impl):
    """hidden[:, :-1], the RL slice (not flattenable as a view), and, on the PyTorch path, chunks of
    3 tokens x 16 vocabulary entries (ragged in both)."""
    dev = device_for(impl)
    base = torch.randn(3, 6, 20, device=dev).requires_grad_()
    weight = (torch.randn(45, 20, device=dev) / 20**0.5).requires_grad_()
    targets = torch.randint(0, 45, (3, 5), device=dev)
    check(impl, base[:, :-1], weight, targets, 0.8, torch.randn(3, 5, device=dev), base=base,
          small_chunks=True)


@pytest.mark.skipif(not TRITON_HERE, reason="runs in test_interpreted_linear_logprobs_subprocess")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_path_backward_in_chunks(dtype, monkeypatch):
    """The Triton backward with its dlogits in chunks of 128 tokens (the least it takes; 300 tokens:
    128, 128 and a ragged 44), d weight summed over the chunks in float32, against the float64
    reference: as at a real vocabulary, where a chunk is 1664 tokens. The same gradients as one
    chunk, within the rounding of each chunk's product."""
    # (kernels.linear_logprobs is the function)
    module = importlib.import_module("kernels.linear_logprobs")
    monkeypatch.setattr(module, "DLOGITS_BYTES", 1)
    assert module.chunk_rows(300, 40, dtype) == 128
    dev = device_for("triton_path")
    hidden = torch.randn(300, 24).to(dtype).to(dev).requires_grad_()
    weight = (torch.randn(40, 24) / 24**0.5).to(dtype).to(dev).requires_grad_()
    check("triton_path", hidden, weight, torch.randint(0, 40, (300,), device=dev), 0.9,
          torch.randn(300, device=dev))


@pytest.mark.parametrize("impl", IMPLS)
def test_hand_worked(impl):
    """C = 1, hidden [[log 2]], weight [[0], [1], [log 3 / log 2]]: logits [0, log 2, log 3], so
    p = [1, 2, 3] / 6; target 2: log(1/2), d hidden = sum_v dx_v w_v, d weight_v = dx_v h."""
    dev = device_for(impl)
    h = torch.tensor([[math.log(2)]], device=dev, requires_grad=True)
    w = torch.tensor([[0.0], [1.0], [math.log(3) / math.log(2)]], device=dev, requires_grad=True)
    out = call(impl, h, w, torch.tensor([2], device=dev), 1.0)
    assert out.item() == pytest.approx(math.log(0.5), rel=1e-6)
    out.sum().backward()
    dx = [-1 / 6, -2 / 6, 1 - 3 / 6]  # onehot - p
    assert h.grad.item() == pytest.approx(
        sum(d * wv for d, wv in zip(dx, [0.0, 1.0, math.log(3) / math.log(2)])), rel=1e-5)
    assert w.grad.flatten().tolist() == pytest.approx([d * math.log(2) for d in dx], rel=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_frozen_weight_gets_no_gradient(impl):
    """A weight that does not require grad is not differentiated (its backward kernel is skipped),
    and d hidden is unchanged."""
    dev = device_for(impl)
    h = torch.randn(4, 16, device=dev, requires_grad=True)
    w = torch.randn(20, 16, device=dev)
    t = torch.randint(0, 20, (4,), device=dev)
    call(impl, h, w, t, 1.0).sum().backward()
    grad_frozen = h.grad.clone()
    h.grad = None
    w.requires_grad_()
    call(impl, h, w, t, 1.0).sum().backward()
    assert w.grad is not None and torch.equal(h.grad, grad_frozen)


def test_argument_checks():
    h, w, t = torch.randn(3, 8), torch.randn(10, 8), torch.zeros(3, dtype=torch.long)
    with pytest.raises(TypeError, match="same dtype"):
        kernels.linear_logprobs(h, w.double(), t)
    with pytest.raises(ValueError, match=r"weight \[V, C\]"):
        kernels.linear_logprobs(h, torch.randn(10, 7), t)
    with pytest.raises(ValueError, match="targets shape"):
        kernels.linear_logprobs(h, w, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"target 10 .*\[0, 10\)"):
        kernels.linear_logprobs_torch(h, w, torch.tensor([0, 10, 1]))


@pytest.mark.skipif(not TRITON_HERE, reason="runs in test_interpreted_linear_logprobs_subprocess")
def test_triton_path_out_of_range_is_nan():
    dev = device_for("triton_path")
    out = kernels.linear_logprobs_triton(torch.randn(3, 8, device=dev),
                                         torch.randn(10, 8, device=dev),
                                         torch.tensor([0, 10, -1], device=dev))
    assert out[0].isfinite() and out[1].isnan() and out[2].isnan()


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(not HAS_TRITON or HAS_CUDA or TRITON_INTERPRET,
                    reason="Triton cases run in this process, or Triton is missing")
@pytest.mark.slow
def test_interpreted_linear_logprobs_subprocess():
    """Run this file's `triton_path` tests under TRITON_INTERPRET=1 in a child pytest."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "pytest", os.path.abspath(__file__), "-q", "-n", "0", "-p",
           "no:cacheprovider", "-k", "triton_path"]
    run = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, tail
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], tail
    print(run.stdout.splitlines()[-1])
