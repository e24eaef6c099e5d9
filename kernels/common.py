"""Plumbing shared by the three kernels: the optional Triton import, dispatch, argument checks,
and the row bookkeeping that lets both paths read [..., V] logits without copying them.

Nothing here does any math; the math lives in logprobs.py, kl.py and entropy.py.
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
        raise RuntimeError("Triton is not installed: use the PyTorch path (the `*_torch` functions)")
    if not (x.is_cuda or TRITON_INTERPRET):
        raise RuntimeError(
            "the Triton path needs CUDA tensors, or TRITON_INTERPRET=1 set before `kernels` is "
            f"imported (got a tensor on {x.device})"
        )


def check_temperature(temperature) -> float:
    temperature = float(temperature)
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    return temperature


def check_logits(logits: torch.Tensor, name: str = "logits") -> None:
    if not logits.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {logits.dtype}")
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"{name} must have a non-empty last (vocabulary) dim, got shape {tuple(logits.shape)}")


# ---------------------------------------------------------------------------------------------
# Rows. Both paths see logits [..., V] as B*R rows of V unit-stride elements, through a view
# [B, R, V] with arbitrary strides on B and R. The common case this buys is the RL one,
# `model(idx)[:, :-1]`: a [B, T-1, V] slice that no 2-D view can describe, which
# `.reshape(-1, V)` would silently copy (3.3 GB at N = 16k, V = 50k, float32).
# ---------------------------------------------------------------------------------------------
def as_rows(x: torch.Tensor) -> torch.Tensor:
    """View x [..., V] as [B, R, V] with stride 1 on V; copy only when no such view exists."""
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


def chunk_ranges(x3: torch.Tensor, max_rows: int):
    """Split the B*R rows of x3 [B, R, V] into [start, stop) ranges of at most max_rows rows,
    each inside one b (R >= max_rows) or made of whole b's (R < max_rows), so take_rows can
    slice it with plain indexing."""
    B, R, _ = x3.shape
    if R == 0:
        return []
    if R >= max_rows or B == 1:
        return [(b * R + r, b * R + min(r + max_rows, R)) for b in range(B) for r in range(0, R, max_rows)]
    step = (max_rows // R) * R
    return [(start, min(start + step, B * R)) for start in range(0, B * R, step)]


def take_rows(x3: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of x3 [B, R, V] flattened to [B*R, V], as a [stop - start, V] tensor:
    a view inside one b, else a copy of just these rows (bounded by the chunk size)."""
    B, R, V = x3.shape
    b, r = divmod(start, R)
    if stop <= (b + 1) * R:
        return x3[b, r : r + stop - start]
    return x3[b : stop // R].reshape(-1, V)


def rows_per_chunk(V: int, chunk_bytes: int = 32 * 2**20) -> int:
    """Rows per PyTorch-path chunk: one float32 [rows, V] temporary is about chunk_bytes."""
    return max(1, chunk_bytes // (4 * V))


def default_block(V: int, max_block: int = 4096) -> int:
    """Triton block along V: the whole row when it fits, else max_block elements per step."""
    return min(triton.next_power_of_2(V), max_block)


def num_warps(block: int) -> int:
    """Warps per program: 8 for long blocks (each thread then holds <= 16 elements), else 4."""
    return 8 if block >= 2048 else 4
