"""Plumbing shared by the kernels: the optional Triton import, dispatch, argument checks, the
temperature range, and the row bookkeeping that lets both paths read [..., V] logits without
copying them.

Nothing here does any math; the math lives in logprobs.py, kl.py, entropy.py and
linear_logprobs.py.

Shapes use the scripts' letters: B batch, T time, V vocabulary, C channels (hidden width),
N = B * T rows (token positions). The temperature is written `temp`, never T.
"""

import math
import os

import torch

# ---------------------------------------------------------------------------------------------
# Triton is optional. Without it (e.g. on macOS) only the PyTorch path exists, and the
# `*_triton` functions raise. The stub lets the `@triton.jit` definitions in the kernel files
# parse; it is never launched.
# ---------------------------------------------------------------------------------------------
try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

    class _NoTriton:
        constexpr = None  # stands in for the `tl.constexpr` annotations

        @staticmethod
        def jit(fn):
            return fn

    triton = tl = _NoTriton()

# Triton decides between compiling a kernel and interpreting it (numpy, on the CPU) when the
# `@triton.jit` decorator runs, i.e. when this package is imported. We read the variable at the
# same moment so that the dispatch below always agrees with how the kernels were built: set
# TRITON_INTERPRET=1 before importing `kernels` (or triton), not after.
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def use_triton(x: torch.Tensor) -> bool:
    """The dispatch rule: Triton for CUDA tensors, or for any tensor under TRITON_INTERPRET=1."""
    return HAS_TRITON and (x.is_cuda or TRITON_INTERPRET)


def require_triton(x: torch.Tensor) -> None:
    if not HAS_TRITON:
        raise RuntimeError(
            "Triton is not installed: use the PyTorch path (the `*_torch` functions)")
    if not (x.is_cuda or TRITON_INTERPRET):
        raise RuntimeError(
            "the Triton path needs CUDA tensors, or TRITON_INTERPRET=1 set before `kernels` is "
            f"imported (got a tensor on {x.device})"
        )


# ---------------------------------------------------------------------------------------------
# Temperatures. Every kernel computes x = logits * (1 / temp) in float32 and scales its gradient
# by 1 / temp. What breaks first, for logits a model can emit (|logits| <= 65504, float16's
# largest; real ones are < 100):
#   - small temp: the gradient ~ 1 / temp overflows float16 (65504) below temp = 1.5e-5; x
#     itself is rounded to eps32 * |logits| / temp (1e-3 of a nat at |logits| = 20, temp = 1e-3,
#     as in any float32 log-softmax), and x overflows float32 (inf - inf = NaN) once
#     |logits| / temp > 3.4e38;
#   - large temp: the gradient ~ 1 / temp falls below float16's smallest normal number (6.1e-5)
#     above temp = 1.6e4, and softmax(logits / temp) is uniform to float32 precision.
# [1e-3, 1e3] stays well inside both limits, and reaches 50 times past the temperatures a sampler
# uses (0.05 to 20) on either side. Outside it, check_temperature raises instead of returning
# numbers that float32 cannot stand behind. The training scripts accept a narrower range for
# sampling (plumbing.MIN_TEMPERATURE, MAX_TEMPERATURE = 0.05, 20), inside this one.
# ---------------------------------------------------------------------------------------------
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 1e3


def check_temperature(temperature) -> float:
    """temperature as a float, or ValueError if it is outside [MIN_TEMPERATURE, MAX_TEMPERATURE]
    (NaN included)."""
    temperature = float(temperature)
    if not MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE:  # also False for NaN
        raise ValueError(
            f"temperature must lie in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}] "
            f"(kernels.MIN_TEMPERATURE, kernels.MAX_TEMPERATURE; outside it float32 cannot "
            f"represent logits / temperature or its gradient faithfully), got {temperature!r}"
        )
    return temperature


def check_logits(logits: torch.Tensor, name: str = "logits") -> None:
    if not logits.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {logits.dtype}")
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"{name} must have a non-empty last (vocabulary) dim, "
                         f"got shape {tuple(logits.shape)}")


def check_targets(targets: torch.Tensor, shape, device) -> None:
    """targets must be integers of the given shape (the inputs' shape less their last dim)."""
    if tuple(targets.shape) != tuple(shape):
        raise ValueError(f"targets shape {tuple(targets.shape)} "
                         f"must be the inputs' leading shape {tuple(shape)}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"targets must be an integer tensor, got {targets.dtype}")
    if targets.device != device:
        raise ValueError(f"targets are on {targets.device} but the inputs are on {device}")


def check_targets_in_range(targets: torch.Tensor, V: int) -> None:
    """PyTorch path only: raise on a target outside [0, V). (The Triton path does not check, which
    would cost a device-to-host sync, and returns NaN for that position instead.)"""
    if targets.numel() > 0:
        lo, hi = int(targets.min()), int(targets.max())
        if lo < 0 or hi >= V:
            raise ValueError(f"target {lo if lo < 0 else hi} is out of range: "
                             f"targets must lie in [0, {V})")


# ---------------------------------------------------------------------------------------------
# Rows. Both paths see logits [..., V] as N = B * T rows of V unit-stride elements, through a
# view [B, T, V] with arbitrary strides on B and T (B: all leading dims merged, T: the one
# before V). The common case this buys is the RL one, `model(idx)[:, :-1]`: a [B, T-1, V] slice
# that no 2-D view can describe, which `.reshape(-1, V)` would silently copy (3.3 GB at
# N = 16k, V = 50k, float32). Kernels find row n at base + (n // T) * stride_b + (n % T) * stride_t.
# ---------------------------------------------------------------------------------------------
def as_rows(x: torch.Tensor) -> torch.Tensor:
    """View x [..., V] as [B, T, V] with stride 1 on V; copy only when no such view exists."""
    V = x.shape[-1]
    if x.dim() <= 2:
        x3 = x.reshape(1, -1, V)  # always a view for 1-D and 2-D tensors
    else:
        B = math.prod(x.shape[:-2])
        try:
            x3 = x.view(B, x.shape[-2], V)  # merges the dims before the last two
        except RuntimeError:
            x3 = x.reshape(B, x.shape[-2], V)  # not mergeable: copy (rare)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()  # e.g. a transposed vocabulary dim: copy
    return x3


def chunk_ranges(x3: torch.Tensor, chunk_rows: int):
    """Split the N = B * T rows of x3 [B, T, V] into [start, stop) ranges of at most chunk_rows
    rows, each inside one b (T >= chunk_rows) or made of whole b's (T < chunk_rows), so that
    take_rows can slice it with plain indexing."""
    B, T, _ = x3.shape
    if T == 0:
        return []
    if T >= chunk_rows or B == 1:
        return [(b * T + t, b * T + min(t + chunk_rows, T)) for b in range(B)
                for t in range(0, T, chunk_rows)]
    step = (chunk_rows // T) * T
    return [(start, min(start + step, B * T)) for start in range(0, B * T, step)]


def take_rows(x3: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of x3 [B, T, V] flattened to [N, V], as a [stop - start, V] tensor:
    a view inside one b, else a copy of just these rows (bounded by the chunk size)."""
    B, T, V = x3.shape
    b, t = divmod(start, T)
    if stop <= (b + 1) * T:
        return x3[b, t : t + stop - start]
    return x3[b : stop // T].reshape(-1, V)


def rows_per_chunk(V: int, chunk_bytes: int = 32 * 2**20) -> int:
    """Rows per PyTorch-path chunk: one float32 [chunk_rows, V] temporary is about chunk_bytes."""
    return max(1, chunk_bytes // (4 * V))


def default_block(V: int, max_block: int = 4096) -> int:
    """Triton block along V: the whole row when it fits, else max_block elements per step."""
    return min(triton.next_power_of_2(V), max_block)


def num_warps(block: int) -> int:
    """Warps per program: 8 for long blocks (each thread then holds <= 16 elements), else 4."""
    return 8 if block >= 2048 else 4


def report(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> bool:
    """For the files' `__main__` self-checks: print got's max error against want, and OK/FAIL."""
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    ok = (got.shape == want.shape
          and torch.allclose(got.double(), want.double(), rtol=rtol, atol=atol))
    print(f"  {name:<28} max |error| {err:.2e}  {'OK' if ok else 'FAIL'}")
    return ok
