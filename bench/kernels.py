"""Benchmarks for kernels/ (not tests: nothing here asserts a timing).

    python bench/kernels.py              # CPU section; the GPU section too when CUDA is available
    python bench/kernels.py --section cpu
    python bench/kernels.py --section gpu
    python bench/kernels.py --section linear   # linear_logprobs on CPU (heavy: ~8 GB for the naive path)

CPU: peak memory and time of forward + backward of token log-probs, at N = 4096 tokens,
V = 50257, float32, for the PyTorch path (`kernels.logprobs_torch`) against the naive
`torch.log_softmax(logits, -1).gather(...)`. Target: memory beyond the logits and their
gradient is O(N); peak at most 0.6x the naive path's.

  How memory is measured. PyTorch's CPU allocator has no peak counter, so each variant runs in
  a fresh Python process, which: builds the logits and targets; reads its resident set size
  (RSS, from /proc/self/status); resets the kernel's peak-RSS counter (VmHWM, by writing "5"
  to /proc/self/clear_refs); runs forward + backward once; and reads VmHWM again. "peak extra"
  is that peak minus the RSS before the step: everything the step allocated at its worst
  moment, the gradient of the logits (N*V*4 bytes, the same for both) included. Large tensors
  are mmap'd by glibc and returned on free, so RSS follows live tensors closely. Linux only.
  Time: the median of --repeats further forward + backward steps in the same process.

Linear (CPU, not part of "all"): peak memory and time of forward + backward of log-probs from
hidden states, at N = 4096 tokens, C = 896 channels, V = 151936 (Qwen2.5-0.5B's LM head), float32,
for the PyTorch path (`kernels.linear_logprobs_torch`) against the naive
`torch.log_softmax(hidden @ weight.T, -1).gather(...)`, measured as above (a fresh process per
variant). "peak extra" includes the gradients of hidden and weight (V*C*4 = 545 MB, the same for
both). Targets: peak extra <= 0.1x the naive path's; time <= 1.5x.

GPU (when available): forward and forward + backward at N = 16384, V in {50257, 151936},
bfloat16, for the Triton path (`kernels.logprobs`) against `log_softmax().gather()` in eager
mode and under `torch.compile`. Reports achieved bandwidth (the bytes that must move / time:
forward reads the logits once, forward + backward reads them twice and writes the gradient
once; targets and per-row outputs are counted too) and its share of the bandwidth of a
device-to-device copy of the logits measured in the same run, and peak allocated memory.
Targets: forward >= 80% of copy bandwidth; forward + backward >= 2x faster than eager.
At V = 151936, N * V = 2.5e9 > 2^31, so this also exercises the kernels' int64 row offsets;
the results are checked against eager before timing.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the `kernels` package, not this file (bench/kernels.py)

import torch  # noqa: E402

import kernels  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--section", choices=["all", "cpu", "gpu", "linear"], default="all",
                    help="which benchmarks to run (all: cpu and gpu)")
parser.add_argument("--cpu_n", type=int, default=4096, help="CPU: tokens (rows)")
parser.add_argument("--cpu_v", type=int, default=50257, help="CPU: vocabulary size")
parser.add_argument("--gpu_n", type=int, default=16384, help="GPU: tokens (rows)")
parser.add_argument("--gpu_vs", type=str, default="50257,151936", help="GPU: vocabulary sizes, comma-separated")
parser.add_argument("--repeats", type=int, default=3, help="CPU: timed steps per variant (median reported)")
parser.add_argument("--threads", type=int, default=0, help="CPU: torch threads (0: torch's default)")
parser.add_argument("--linear_n", type=int, default=4096, help="linear: tokens")
parser.add_argument("--linear_c", type=int, default=896, help="linear: channels (hidden width)")
parser.add_argument("--linear_v", type=int, default=151936, help="linear: vocabulary size")
parser.add_argument("--linear_repeats", type=int, default=1, help="linear: timed steps per variant (median reported)")
parser.add_argument("--_cpu_variant", choices=["naive", "fused", "linear_naive", "linear_fused"],
                    help=argparse.SUPPRESS)  # child


# =============================================================================================
# The two ways of computing token log-probs. T = 1 so the naive path skips the division:
# the most favourable version of it.
# =============================================================================================
def naive_logprobs(logits, targets):
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V] float32, kept for backward
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [N]


def fused_logprobs(logits, targets):
    return kernels.logprobs(logits, targets)  # [N]; Triton on CUDA, the PyTorch path on CPU


def naive_linear_logprobs(hidden, weight, targets):
    logits = hidden @ weight.T  # [N, V] float32
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [N]; keeps [N, V]


# =============================================================================================
# CPU: one variant per fresh process.
# =============================================================================================
def _status_kib(key):
    return int(re.search(key + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1))


def cpu_child(variant, N, V, repeats, threads, C=None):
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    targets = torch.randint(0, V, (N,))
    if variant in ("naive", "fused"):
        fn = naive_logprobs if variant == "naive" else kernels.logprobs_torch
        inputs = [torch.randn(N, V).requires_grad_()]  # logits [N, V] float32, touched
        fn(torch.randn(8, V, requires_grad=True), targets[:8]).sum().backward()  # warm up the code paths
    else:
        fn = naive_linear_logprobs if variant == "linear_naive" else kernels.linear_logprobs_torch
        inputs = [torch.randn(N, C).requires_grad_(), (torch.randn(V, C) / C**0.5).requires_grad_()]  # hidden, weight
        fn(torch.randn(8, C, requires_grad=True), inputs[1][:300].detach().requires_grad_(),
           targets[:8] % 300).sum().backward()

    rss_before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS counter to the current RSS
    fn(*inputs, targets).sum().backward()
    peak = _status_kib("VmHWM")

    times = []
    for _ in range(repeats):
        for x in inputs:
            x.grad = None
        t0 = time.perf_counter()
        fn(*inputs, targets).sum().backward()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"peak_extra_mib": (peak - rss_before) / 1024, "before_mib": rss_before / 1024,
                      "time_s": statistics.median(times)}))


def cpu_section(args):
    N, V = args.cpu_n, args.cpu_v
    mib = N * V * 4 / 2**20
    threads = args.threads or torch.get_num_threads()
    print(f"== CPU: forward + backward of token log-probs, N={N}, V={V}, float32, {threads} torch threads")
    print(f"   logits {mib:.0f} MiB; their gradient {mib:.0f} MiB (in both variants' peak extra)")
    results = {}
    for variant in ("naive", "fused"):
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--_cpu_variant", variant, "--cpu_n", str(N),
             "--cpu_v", str(V), "--repeats", str(args.repeats), "--threads", str(args.threads)],
            capture_output=True, text=True, check=True, env={k: v for k,
                                                             v in os.environ.items() if k != "TRITON_INTERPRET"},
        )
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    naive, fused = results["naive"], results["fused"]
    names = {"naive": "naive log_softmax().gather()", "fused": "kernels.logprobs_torch"}
    print(f"   {'variant':<30} {'peak extra MiB':>15} {'beyond grad MiB':>16} {'peak total MiB':>15} {'time s':>8}")
    for k in ("naive", "fused"):
        r = results[k]
        print(f"   {names[k]:<30} {r['peak_extra_mib']:>15.0f} {r['peak_extra_mib'] - mib:>16.0f} "
              f"{r['before_mib'] + r['peak_extra_mib']:>15.0f} {r['time_s']:>8.3f}")
    total = lambda r: r["before_mib"] + r["peak_extra_mib"]
    print(f"   ratio fused/naive: peak extra {fused['peak_extra_mib'] / naive['peak_extra_mib']:.2f}x, "
          f"peak total (process, logits included) {total(fused) / total(naive):.2f}x, "
          f"time {fused['time_s'] / naive['time_s']:.2f}x  (target: peak <= 0.6x)")


def linear_section(args):
    N, C, V = args.linear_n, args.linear_c, args.linear_v
    threads = args.threads or torch.get_num_threads()
    logits_mib = N * V * 4 / 2**20
    print(f"== CPU: forward + backward of log-probs from hidden states, N={N}, C={C}, V={V}, float32, {threads} torch threads")
    print(f"   hidden {N * C * 4 / 2**20:.0f} MiB, weight {V * C * 4 / 2**20:.0f} MiB (and their gradients, in both "
          f"variants' peak extra); the naive path's logits {logits_mib:.0f} MiB each")
    results = {}
    for variant in ("linear_naive", "linear_fused"):
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--_cpu_variant", variant, "--cpu_n", str(N), "--cpu_v", str(V),
             "--linear_c", str(C), "--repeats", str(args.linear_repeats), "--threads", str(args.threads)],
            capture_output=True, text=True, check=True, env={k: v for k,
                                                             v in os.environ.items() if k != "TRITON_INTERPRET"},
        )
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    names = {"linear_naive": "naive (h @ W.T).log_softmax.gather", "linear_fused": "kernels.linear_logprobs_torch"}
    print(f"   {'variant':<36} {'peak extra MiB':>15} {'peak total MiB':>15} {'time s':>8}")
    for k in ("linear_naive", "linear_fused"):
        r = results[k]
        print(f"   {names[k]:<36} {r['peak_extra_mib']:>15.0f} {r['before_mib'] + r['peak_extra_mib']:>15.0f} {r['time_s']:>8.2f}")
    naive, fused = results["linear_naive"], results["linear_fused"]
    print(f"   ratio fused/naive: peak extra {fused['peak_extra_mib'] / naive['peak_extra_mib']:.3f}x, "
          f"time {fused['time_s'] / naive['time_s']:.2f}x  (targets: peak extra <= 0.1x, time <= 1.5x)")


# =============================================================================================
# GPU.
# =============================================================================================
def gpu_section(args):
    import triton  # only needed here

    dev = torch.device("cuda")
    N = args.gpu_n
    print(f"== GPU: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"   token log-probs, N={N}, bfloat16 logits, T=1")
    compiled = torch.compile(naive_logprobs, dynamic=False)
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200)  # ms, mean over reps

    for V in [int(v) for v in args.gpu_vs.split(",")]:
        logits = torch.randn(N, V, device=dev, dtype=torch.bfloat16).requires_grad_()
        targets = torch.randint(0, V, (N,), device=dev)
        size = N * V * logits.element_size()  # bytes of the logits
        per_row = 8 + 4  # target in, log-prob out
        bytes_fwd = size + N * per_row  # read the logits once
        bytes_fwd_bwd = 3 * size + 2 * N * per_row  # + backward: read them again, write the gradient

        # copy bandwidth of the same bytes: read + write
        dst = torch.empty_like(logits, requires_grad=False)
        copy_ms = bench(lambda: dst.copy_(logits.detach()))
        copy_bw = 2 * size / copy_ms / 1e6  # GB/s
        del dst

        # correctness against eager (also checks the int64 offsets when N * V > 2^31)
        with torch.no_grad():
            diff = (fused_logprobs(logits, targets) - naive_logprobs(logits, targets)).abs().max().item()
        print(f"\n   V={V}: logits {size / 2**30:.2f} GiB, N*V = {N * V:.3g}; copy {copy_bw:.0f} GB/s; "
              f"max |fused - eager| = {diff:.2e}")
        print(f"   {'variant':<28} {'fwd ms':>8} {'fwd GB/s':>9} {'% copy':>7} {'fwd+bwd ms':>11} {'GB/s':>7} "
              f"{'% copy':>7} {'peak GiB':>9}")

        rows = {}
        for name, fn in [("eager log_softmax.gather", naive_logprobs), ("torch.compile", compiled),
                         ("kernels.logprobs (Triton)", fused_logprobs)]:
            def fwd():
                with torch.no_grad():
                    fn(logits, targets)

            def fwd_bwd():
                fn(logits, targets).sum().backward()

            fwd()  # compile / warm up (torch.compile builds one graph per grad mode)
            fwd_bwd()
            torch.cuda.synchronize()
            logits.grad = None
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fwd_bwd()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            logits.grad = None
            t_f = bench(fwd)
            t_fb = triton.testing.do_bench(fwd_bwd, warmup=10, rep=100, grad_to_none=[logits])
            bw_f, bw_fb = bytes_fwd / t_f / 1e6, bytes_fwd_bwd / t_fb / 1e6
            rows[name] = (t_f, t_fb)
            print(f"   {name:<28} {t_f:>8.3f} {bw_f:>9.0f} {100 * bw_f / copy_bw:>6.0f}% {t_fb:>11.3f} {bw_fb:>7.0f} "
                  f"{100 * bw_fb / copy_bw:>6.0f}% {peak:>9.2f}")
            logits.grad = None
        t_f, t_fb = rows["kernels.logprobs (Triton)"]
        e_f, e_fb = rows["eager log_softmax.gather"]
        c_f, c_fb = rows["torch.compile"]
        print(f"   speed-up of kernels.logprobs: fwd {e_f / t_f:.2f}x eager, {c_f / t_f:.2f}x compile; "
              f"fwd+bwd {e_fb / t_fb:.2f}x eager, {c_fb / t_fb:.2f}x compile  (targets: fwd >= 80% copy; fwd+bwd >= 2x eager)")
        del logits, targets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    args = parser.parse_args()
    if args._cpu_variant:
        cpu_child(args._cpu_variant, args.cpu_n, args.cpu_v, args.repeats, args.threads, args.linear_c)
    else:
        print("command: python " + " ".join(sys.argv))
        if args.section in ("all", "cpu"):
            cpu_section(args)
        if args.section == "linear":
            linear_section(args)
        if args.section in ("all", "gpu"):
            if torch.cuda.is_available() and kernels.HAS_TRITON:
                gpu_section(args)
            else:
                print("== GPU: no CUDA device (or no Triton) here: GPU figures not measured")
