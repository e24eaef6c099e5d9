"""Every Triton kernel compiles for real GPUs, checked on a machine without one.

The interpreter (TRITON_INTERPRET=1, used by the other kernel tests) runs a kernel's Python on
numpy: it never lowers it to GPU code, so a kernel can pass every interpreted test and still fail
to compile on a GPU (an unsupported op, a layout the backend rejects, too much shared memory).
Here each kernel goes through Triton's real pipeline, ahead of time, for sm_80 (A100) and sm_90
(H100): Triton IR -> LLVM -> PTX -> cubin, the last step by the ptxas binary that ships inside the
triton wheel (nothing else is needed: no CUDA toolkit, no driver). It is done for float32,
bfloat16 and float16 inputs, at the block sizes each file's own `launch_config` picks for
V = 258, 50257 and 151936 (and, for linear_logprobs, N = 4096 tokens of C = 896 channels), each
distinct (kernel, dtype, blocks, warps) once: kernels/aot.py builds the list and compiles.

A test fails on any compile error, and when a program would need more shared memory than the
GPU has (Triton only checks that when a kernel is loaded onto a device). Registers and spills
are not asserted here; bench/kernel_registers.py prints them.

Time: about 90 compilations, ~1-2 minutes on 2 CPU cores with an empty Triton cache; a few seconds
when Triton's cache (~/.triton/cache) already holds them (a cache hit is the same binary: the
key covers the source, the options and the Triton version). Skipped when Triton is missing or
when this process interprets the kernels (TRITON_INTERPRET=1: there is nothing to compile then).
"""

import importlib

import pytest

from kernels import HAS_TRITON, TRITON_INTERPRET

pytestmark = pytest.mark.skipif(not HAS_TRITON or TRITON_INTERPRET,
                                reason="needs Triton, with compiled (not interpreted) kernels: "
                                       "run without TRITON_INTERPRET")

if HAS_TRITON and not TRITON_INTERPRET:
    from kernels import aot

    JOBS = aot.jobs()
else:
    JOBS = []
ARCHS = [80, 90]


@pytest.mark.parametrize("arch", ARCHS, ids=[f"sm_{a}" for a in ARCHS])
@pytest.mark.parametrize("job", JOBS, ids=[job.name.replace(" ", "-") for job in JOBS])
def test_kernel_compiles(job, arch):
    compiled = aot.compile_kernel(job, arch)  # raises on any error, ptxas's included
    assert len(compiled.asm["cubin"]) > 0 and f".target sm_{arch}" in compiled.asm["ptx"]
    assert compiled.metadata.num_warps == job.num_warps
    assert compiled.metadata.shared <= aot.SHARED_MEMORY[arch], (
        f"{job.name} needs {compiled.metadata.shared} bytes of shared memory; "
        f"sm_{arch} has {aot.SHARED_MEMORY[arch]}")


def test_every_kernel_is_listed():
    """A kernel added to a kernel file but not to kernels/aot.py's lists would go uncompiled
    here."""
    import triton

    defined = set()
    for name in ("logprobs", "kl", "entropy", "linear_logprobs", "invariant"):
        module = importlib.import_module(f"kernels.{name}")  # (`kernels.logprobs` is the function)
        defined |= {v.__name__ for k, v in vars(module).items()
                    if k.endswith("_kernel") and isinstance(v, triton.runtime.JITFunction)}
    listed = {kernel.__name__ for kernel, _, _ in
              aot.ROW_KERNELS + aot.LINEAR_KERNELS + aot.INVARIANT_KERNELS}
    assert defined == listed
    assert {job.kernel.__name__ for job in JOBS} == listed


def test_jobs_use_the_launchers_blocks():
    """The blocks compiled are the ones the launchers pick, for each vocabulary size."""
    logprobs, kl = importlib.import_module("kernels.logprobs"), importlib.import_module(
        "kernels.kl")
    blocks = {(job.kernel.__name__, dict(job.constants)["BLOCK_V"])
              for job in JOBS if "BLOCK_V" in dict(job.constants)}
    for V in (258, 50257, 151936):
        assert ("_logprobs_fwd_kernel", logprobs.launch_config(V)["BLOCK_V"]) in blocks
        assert ("_kl_bwd_kernel", kl.launch_config(V)["BLOCK_V"]) in blocks
    # 258 -> 512; 50257 -> 4096
    assert ("_logprobs_fwd_kernel", 512) in blocks and ("_logprobs_fwd_kernel", 4096) in blocks
