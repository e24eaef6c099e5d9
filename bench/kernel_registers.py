"""Registers, spills and shared memory of every Triton kernel, compiled ahead of time for sm_80
(A100) and sm_90 (H100), on any machine (no GPU needed; Linux x86-64, where the triton wheel
ships ptxas).

    python bench/kernel_registers.py                 # all kernels, float32 / bfloat16 / float16
    python bench/kernel_registers.py --dtypes bf16   # one dtype

For each kernel at the block sizes its launcher picks for V = 258, 50257 and 151936 (and, for
linear_logprobs, N = 4096 tokens of C = 896 channels: Qwen2.5-0.5B), compiled once per distinct
(kernel, dtype, blocks, warps) by kernels/aot.py, it prints the registers per thread and the
bytes spilled to local memory, from `ptxas -v` on the kernel's PTX (the compiled kernel itself
only learns its register count when loaded onto a GPU), and the shared memory per program.

How to read it: 255 registers is the most a thread can have; a kernel that needs more spills
(stores and reloads values through local memory, i.e. the L1/L2 caches and DRAM) and slows down;
"spill 0/0" is the goal. Registers per thread times threads per program (32 * warps) also bounds
how many programs fit on an SM at once (65536 registers each on A100 and H100).
"""

import argparse
import os
import sys
import time

# the repository root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# compiled kernels, not interpreted ones (before kernels is imported)
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

from kernels import aot  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--archs", default="80,90",
                    help="compute capabilities, comma-separated (80: A100, 90: H100)")
parser.add_argument("--dtypes", default="fp32,bf16,fp16", help="input dtypes, comma-separated")
parser.add_argument("--vocab_sizes", default="258,50257,151936",
                    help="vocabulary sizes whose blocks are compiled")

if __name__ == "__main__":
    args = parser.parse_args()
    names = {v: k for k, v in aot.TRITON_DTYPES.items()}
    dtypes = tuple(names[d] for d in args.dtypes.split(","))
    jobs = aot.jobs(vocab_sizes=tuple(int(v) for v in args.vocab_sizes.split(",")), dtypes=dtypes)
    print("command: python " + " ".join(sys.argv))
    print(f"triton {aot.triton.__version__}, torch {torch.__version__}; {len(jobs)} kernels x "
          f"{len(args.archs.split(','))} targets")
    print(f"{'kernel':<36} {'dtype':<5} {'blocks':<26} {'warps':>5} {'arch':>6} {'regs':>5} "
          f"{'spill st/ld B':>14} {'smem B':>7}")
    start = time.perf_counter()
    for job in jobs:
        blocks = " ".join(f"{k[6:]}={v}" for k, v in job.constants if k.startswith("BLOCK"))
        for arch in (int(a) for a in args.archs.split(",")):
            compiled = aot.compile_kernel(job, arch)
            use = aot.ptxas_usage(compiled, arch)
            spills = f"{use['spill_stores']}/{use['spill_loads']}"
            print(f"{job.kernel.__name__:<36} {aot.TRITON_DTYPES[job.dtype]:<5} {blocks:<26} "
                  f"{job.num_warps:>5} {'sm_' + str(arch):>6} {use['registers']:>5} "
                  f"{spills:>14} {compiled.metadata.shared:>7}", flush=True)
    print(f"done in {time.perf_counter() - start:.0f} s")
