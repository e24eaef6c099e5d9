"""Ahead-of-time compilation of every kernel in this package for a named NVIDIA GPU, on a machine
without one. Not needed to use the kernels: tests/test_kernel_compile.py uses it to prove that
each kernel compiles (Triton -> PTX -> cubin, with the ptxas that ships inside the triton wheel)
for sm_80 (A100) and sm_90 (H100) at the block sizes the launchers pick, and
bench/kernel_registers.py to report each compiled kernel's registers and spills.

    compiled = compile_kernel(job, arch=80)  # a CompiledKernel: .asm["ptx"], .asm["cubin"]
    ptxas_usage(compiled, arch=80)           # {"registers": 40, "spill_stores": 0, ...}

A job is one kernel at one input dtype and one set of compile-time constants (block sizes and
warps), as chosen by the kernel file's own `launch_config`; jobs() lists every distinct one for
the vocabularies asked for. What the JIT specialises at launch is mirrored for a contiguous
input (logits [4, 1024, V]; hidden [N, C] and weight [V, C]): pointers are marked 16-byte aligned
(torch's allocations are), each integer argument that is a multiple of 16 is marked so (this is
what lets loads be vectorised), and linear_logprobs' channel strides are the constant 1 (the JIT
turns an integer argument equal to 1 into a constant). A block size picked for several
vocabularies is compiled once, with the alignment of the largest of them.
"""

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import torch

from .common import triton
from .entropy import _entropy_bwd_kernel, _entropy_fwd_kernel
from .entropy import launch_config as entropy_config
from .invariant import MM_BLOCKS, _attention_kernel, _tiled_mm_kernel, attention_blocks
from .kl import _kl_bwd_kernel, _kl_fwd_kernel
from .kl import launch_config as kl_config
from .linear_logprobs import _linear_logprobs_dlogits_kernel, _linear_logprobs_fwd_kernel
from .linear_logprobs import launch_config as linear_config
from .logprobs import _logprobs_bwd_kernel, _logprobs_fwd_kernel
from .logprobs import launch_config as logprobs_config

TRITON_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
SHARED_MEMORY = {80: 163 * 1024, 90: 227 * 1024}  # bytes one program may use: A100, H100

# (kernel, its file's launch_config, the pointer arguments that carry the inputs' dtype; every
# other pointer is float32, except targets, int64)
ROW_KERNELS = [
    (_logprobs_fwd_kernel, logprobs_config, ("logits_ptr",)),
    (_logprobs_bwd_kernel, logprobs_config, ("logits_ptr", "grad_ptr")),
    (_kl_fwd_kernel, kl_config, ("p_ptr", "q_ptr")),
    (_kl_bwd_kernel, kl_config, ("p_ptr", "q_ptr", "grad_ptr")),
    (_entropy_fwd_kernel, entropy_config, ("logits_ptr",)),
    (_entropy_bwd_kernel, entropy_config, ("logits_ptr", "grad_ptr")),
]
LINEAR_KERNELS = [
    (_linear_logprobs_fwd_kernel, linear_config, ("hidden_ptr", "weight_ptr")),
    (_linear_logprobs_dlogits_kernel, linear_config, ("hidden_ptr", "weight_ptr", "dlogits_ptr")),
]
# --batch_invariant's (invariant.py): the one tile of its products; attention at head sizes 64
# (Qwen2.5-0.5B, Llama 3.2-1B) and 128 (Qwen2.5-7B, Llama 3-8B)
INVARIANT_KERNELS = [
    (_tiled_mm_kernel, lambda D: MM_BLOCKS, ("x_ptr", "w_ptr", "y_ptr")),
    (_attention_kernel, attention_blocks, ("q_ptr", "k_ptr", "v_ptr", "y_ptr")),
]


@dataclass(frozen=True)
class Job:
    kernel: object  # a triton JITFunction
    dtype: torch.dtype  # of the inputs (logits, or hidden and weight)
    dtype_ptrs: tuple  # the pointer arguments in that dtype
    constants: tuple  # ((name, value), ...): block sizes, and linear_logprobs' unit strides
    num_warps: int
    V: int  # the vocabulary whose launch this mirrors
    multiples_of_16: tuple  # the integer arguments that are multiples of 16 at that launch

    @property
    def name(self):
        consts = " ".join(f"{k}={v}" for k, v in self.constants if k.startswith("BLOCK"))
        return f"{self.kernel.__name__} {TRITON_DTYPES[self.dtype]} {consts} warps={self.num_warps}"


def jobs(vocab_sizes=(258, 50257, 151936), dtypes=tuple(TRITON_DTYPES), N=4096, C=896, T=1024):
    """Every distinct (kernel, dtype, compile-time constants, warps) the launchers pick for these
    vocabulary sizes: logits [N // T, T, V]; linear_logprobs with N tokens and C channels
    (Qwen2.5-0.5B's 896)."""
    found = {}  # one job per distinct (kernel, dtype, constants, warps), in order

    def add(kernel, dtype, dtype_ptrs, config, V, ints):
        config = dict(config)
        warps = config.pop("num_warps")
        multiples = tuple(name for name in kernel.arg_names
                          if name in ints and ints[name] % 16 == 0)
        job = Job(kernel, dtype, dtype_ptrs, tuple(sorted(config.items())), warps, V, multiples)
        found.setdefault((kernel.__name__, dtype, job.constants, warps), job)

    for dtype in dtypes:
        for V in sorted(vocab_sizes, reverse=True):  # largest first: its alignment is kept
            # the launchers' integers for logits [N // T, T, V]
            rows = {"T": T, "V": V, "stride_b": T * V, "stride_t": V, "p_stride_b": T * V,
                    "p_stride_t": V, "q_stride_b": T * V, "q_stride_t": V}
            for kernel, launch_config, dtype_ptrs in ROW_KERNELS:
                add(kernel, dtype, dtype_ptrs, launch_config(V), V, rows)
            # hidden, weight, dlogits
            linear = {"N": N, "V": V, "C": C, "stride_hn": C, "stride_wv": C, "stride_dn": V}
            for kernel, launch_config, dtype_ptrs in LINEAR_KERNELS:
                config = {**launch_config(N, V, C, dtype), "stride_hc": 1, "stride_wc": 1}
                add(kernel, dtype, dtype_ptrs, config, V, linear)
        for kernel, blocks, dtype_ptrs in INVARIANT_KERNELS:   # launched with 4 warps, row-wise
            for D in (64, 128):                                 # products on the GPU
                config = {**blocks(D), "IEEE": dtype == torch.float32, "ROWWISE": False,
                          "num_warps": 4}
                add(kernel, dtype, dtype_ptrs, config, 0, {})
    return sorted(found.values(),
                  key=lambda job: (TRITON_DTYPES[job.dtype], job.kernel.__name__, job.constants))


def signature(job):
    """The argument types of job.kernel, for triton.compile."""
    constants = dict(job.constants)
    sig = {}
    for name in job.kernel.arg_names:
        if name in constants:
            sig[name] = "constexpr"
        elif name in job.dtype_ptrs:
            sig[name] = "*" + TRITON_DTYPES[job.dtype]
        elif name == "targets_ptr":
            sig[name] = "*i64"
        elif name in ("m_ptr", "first_ptr"):                # invariant.py's mask and first keys
            sig[name] = "*i8" if name == "m_ptr" else "*i32"
        elif name.endswith("_ptr"):
            sig[name] = "*fp32"
        elif name in ("inv_temperature", "scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"  # sizes and strides
    return sig


def compile_kernel(job, arch):
    """Compile job for sm_<arch> (80, 90, ...): Triton's own pipeline, ptxas included; raises on
    any error. Returns the CompiledKernel."""
    sig = signature(job)
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(job.kernel.arg_names)
               if sig[name].startswith("*") or name in job.multiples_of_16}
    source = triton.compiler.ASTSource(fn=job.kernel, signature=sig, constexprs=dict(job.constants),
                                       attrs=aligned)
    target = triton.backends.compiler.GPUTarget("cuda", arch, 32)
    return triton.compile(source, target=target, options={"num_warps": job.num_warps})


def ptxas_usage(compiled, arch):
    """Registers per thread and spill bytes of a compiled kernel, from `ptxas -v` on its PTX (the
    CompiledKernel only learns n_regs and n_spills when it is loaded onto a GPU)."""
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"  # Triton targets sm_90a on Hopper
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        # the flags Triton's own ptxas call uses (triton/backends/nvidia/compiler.py), plus -v
        ptxas = triton.backends.nvidia.compiler.get_ptxas(arch).path  # Triton's: newer for sm_90+
        cmd = [ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={gpu}",
               ptx, "-o", os.path.join(tmp, "kernel.cubin")]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {"registers": registers, "spill_stores": int(spills.group(1)),
            "spill_loads": int(spills.group(2))}
