"""Benchmarks for kernels/ (not tests: nothing here asserts a timing).

    python bench/kernels.py              # CPU section; the GPU section too when CUDA is available
    python bench/kernels.py --section cpu
    python bench/kernels.py --section gpu
    python bench/kernels.py --section gpu --gpu_vs 151936 --gpu_kernels linear_logprobs  # one each
    python bench/kernels.py --section linear  # linear_logprobs on CPU (~8 GB for the naive path)

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

GPU (when available): forward and forward + backward at N = 16384 rows, V in {50257, 151936},
bfloat16, of each kernel against eager PyTorch, torch.compile of the same and Liger-Kernel where it
has the operation (recorded as "not installed" otherwise): logprobs (Liger's cross entropy,
negated), kl (Liger's KL divergence, after the log-softmaxes it needs), entropy (Liger has none) and
linear_logprobs from hidden states of width C = 896 (Liger's fused linear cross entropy). Reports
time, the bandwidth of the bytes that must move against a device-to-device copy of the logits in the
same run, and peak allocated memory; every variant is checked against eager before it is timed.
Targets for logprobs: forward >= 80% of copy bandwidth; forward + backward >= 2x eager. At
V = 151936, N * V > 2^31: the kernels' int64 row offsets are exercised. No GPU was lent to this
project yet: the GPU figures are not measured (bench/gpu.py runs this section and writes
results/gpu.md).
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
parser.add_argument("--gpu_vs", type=str, default="50257,151936",
                    help="GPU: vocabulary sizes, comma-separated")
parser.add_argument("--gpu_kernels", type=str, default="logprobs,kl,entropy,linear_logprobs",
                    help="GPU: the kernels to time, comma-separated")
parser.add_argument("--repeats", type=int, default=3,
                    help="CPU: timed steps per variant (median reported)")
parser.add_argument("--threads", type=int, default=0,
                    help="CPU: torch threads (0: torch's default)")
parser.add_argument("--linear_n", type=int, default=4096, help="linear: tokens")
parser.add_argument("--linear_c", type=int, default=896, help="linear: channels (hidden width)")
parser.add_argument("--linear_v", type=int, default=151936, help="linear: vocabulary size")
parser.add_argument("--linear_repeats", type=int, default=1,
                    help="linear: timed steps per variant (median reported)")
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
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [N]


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
        fn(torch.randn(8, V, requires_grad=True), targets[:8]).sum().backward()  # warm up
    else:
        fn = naive_linear_logprobs if variant == "linear_naive" else kernels.linear_logprobs_torch
        inputs = [torch.randn(N, C).requires_grad_(),                # hidden
                  (torch.randn(V, C) / C**0.5).requires_grad_()]     # weight
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
    print(f"== CPU: forward + backward of token log-probs, N={N}, V={V}, float32, "
          f"{threads} torch threads")
    print(f"   logits {mib:.0f} MiB; their gradient {mib:.0f} MiB (in both variants' peak extra)")
    results = {}
    for variant in ("naive", "fused"):
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--_cpu_variant", variant,
             "--cpu_n", str(N), "--cpu_v", str(V),
             "--repeats", str(args.repeats), "--threads", str(args.threads)],
            capture_output=True, text=True, check=True,
            env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
        )
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    naive, fused = results["naive"], results["fused"]
    names = {"naive": "naive log_softmax().gather()", "fused": "kernels.logprobs_torch"}
    print(f"   {'variant':<30} {'peak extra MiB':>15} {'beyond grad MiB':>16} "
          f"{'peak total MiB':>15} {'time s':>8}")
    for k in ("naive", "fused"):
        r = results[k]
        print(f"   {names[k]:<30} {r['peak_extra_mib']:>15.0f} {r['peak_extra_mib'] - mib:>16.0f} "
              f"{r['before_mib'] + r['peak_extra_mib']:>15.0f} {r['time_s']:>8.3f}")
    total = lambda r: r["before_mib"] + r["peak_extra_mib"]
    print(f"   ratio fused/naive: "
          f"peak extra {fused['peak_extra_mib'] / naive['peak_extra_mib']:.2f}x, "
          f"peak total (process, logits included) {total(fused) / total(naive):.2f}x, "
          f"time {fused['time_s'] / naive['time_s']:.2f}x  (target: peak <= 0.6x)")


def linear_section(args):
    N, C, V = args.linear_n, args.linear_c, args.linear_v
    threads = args.threads or torch.get_num_threads()
    logits_mib = N * V * 4 / 2**20
    print(f"== CPU: forward + backward of log-probs from hidden states, N={N}, C={C}, V={V}, "
          f"float32, {threads} torch threads")
    print(f"   hidden {N * C * 4 / 2**20:.0f} MiB, weight {V * C * 4 / 2**20:.0f} MiB "
          f"(and their gradients, in both variants' peak extra); "
          f"the naive path's logits {logits_mib:.0f} MiB each")
    results = {}
    for variant in ("linear_naive", "linear_fused"):
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--_cpu_variant", variant,
             "--cpu_n", str(N), "--cpu_v", str(V), "--linear_c", str(C),
             "--repeats", str(args.linear_repeats), "--threads", str(args.threads)],
            capture_output=True, text=True, check=True,
            env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
        )
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    names = {"linear_naive": "naive (h @ W.T).log_softmax.gather",
             "linear_fused": "kernels.linear_logprobs_torch"}
    print(f"   {'variant':<36} {'peak extra MiB':>15} {'peak total MiB':>15} {'time s':>8}")
    for k in ("linear_naive", "linear_fused"):
        r = results[k]
        total = r["before_mib"] + r["peak_extra_mib"]
        print(f"   {names[k]:<36} {r['peak_extra_mib']:>15.0f} {total:>15.0f} {r['time_s']:>8.2f}")
    naive, fused = results["linear_naive"], results["linear_fused"]
    print(f"   ratio fused/naive: "
          f"peak extra {fused['peak_extra_mib'] / naive['peak_extra_mib']:.3f}x, "
          f"time {fused['time_s'] / naive['time_s']:.2f}x  "
          f"(targets: peak extra <= 0.1x, time <= 1.5x)")


# =============================================================================================
# GPU.
# =============================================================================================
def liger():
    """Liger-Kernel's losses if it is installed, else None (its rows then say "not installed")."""
    try:
        from liger_kernel.transformers import (LigerCrossEntropyLoss,
                                               LigerFusedLinearCrossEntropyLoss, LigerKLDIVLoss)
    except ImportError:
        return None
    return {"ce": LigerCrossEntropyLoss(reduction="none"),
            "flce": LigerFusedLinearCrossEntropyLoss(reduction="none"),
            "kl": LigerKLDIVLoss(reduction="none", log_target=True)}


def gpu_cases(N, V, device, dtype=torch.bfloat16, C=896, liger_ops=None):
    """The GPU comparison, one case per kernel:
    {name: (inputs, bytes forward, bytes forward+backward, variants)},
    variants {label: fn(*inputs) -> per-row values}, the first the eager reference. Small sizes run
    on a CPU too: tests/test_gpu_bench.py checks every non-Triton variant against the reference."""
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(N, V, device=device, dtype=dtype, generator=g).requires_grad_()
    ref = torch.randn(N, V, device=device, dtype=dtype, generator=g)
    targets = torch.randint(0, V, (N,), device=device, generator=g)
    hidden = (torch.randn(N, C, device=device, dtype=dtype, generator=g)
              * C ** -0.5).requires_grad_()
    weight = torch.randn(V, C, device=device, dtype=dtype, generator=g).requires_grad_()
    size = N * V * logits.element_size()
    eager_kl = lambda p, q: (torch.softmax(p.float(), -1)
                             * (torch.log_softmax(p.float(), -1)
                                - torch.log_softmax(q.float(), -1))).sum(-1)
    eager_entropy = lambda x: -(torch.softmax(x.float(), -1)
                                * torch.log_softmax(x.float(), -1)).sum(-1)
    eager_linear = lambda h, w, t: naive_linear_logprobs(h.float(), w.float(), t)
    cases = {
        "logprobs": ((logits, targets), size + 12 * N, 3 * size + 24 * N,
                     {"eager": naive_logprobs,
                      "torch.compile": torch.compile(naive_logprobs, dynamic=False),
                      "kernels (Triton)": kernels.logprobs}),
        "kl": ((logits, ref), 2 * size + 4 * N, 4 * size + 8 * N,
               {"eager": eager_kl, "torch.compile": torch.compile(eager_kl, dynamic=False),
                "kernels (Triton)": kernels.kl}),
        "entropy": ((logits,), size + 4 * N, 3 * size + 8 * N,
                    {"eager": eager_entropy,
                     "torch.compile": torch.compile(eager_entropy, dynamic=False),
                     "kernels (Triton)": kernels.entropy}),
        "linear_logprobs": ((hidden, weight, targets), (N + V) * C * hidden.element_size() + 12 * N,
                            3 * (N + V) * C * hidden.element_size() + 24 * N,
                            {"eager": eager_linear,
                             "torch.compile": torch.compile(eager_linear, dynamic=False),
                             "kernels (Triton)": kernels.linear_logprobs}),
    }
    if liger_ops is not None:
        cases["logprobs"][3]["Liger-Kernel"] = lambda x, t: -liger_ops["ce"](x, t)
        # Liger's KLDivLoss(y_pred = log q, y_true = log p) is KL(p || q) per element: summed over V
        log_q_p = lambda p, q: (torch.log_softmax(q.float(), -1), torch.log_softmax(p.float(), -1))
        cases["kl"][3]["Liger-Kernel"] = lambda p, q: liger_ops["kl"](*log_q_p(p, q)).sum(-1)
        cases["linear_logprobs"][3]["Liger-Kernel"] = lambda h, w, t: -liger_ops["flce"](w, h, t)
    return cases


def copier(x):
    """A function copying x into a buffer of its size, device to device: the bandwidth to match."""
    dst = torch.empty_like(x, requires_grad=False)
    return lambda: dst.copy_(x.detach())


def gpu_section(args):
    import triton  # only needed here

    dev = torch.device("cuda")
    N = args.gpu_n
    liger_ops = liger()
    print(f"== GPU: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, "
          f"triton {triton.__version__}, "
          f"Liger-Kernel {'installed' if liger_ops else 'not installed'}; "
          f"N={N} rows, bfloat16, T=1")
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200)  # ms, mean over reps
    for V in [int(v) for v in args.gpu_vs.split(",")]:
        cases = gpu_cases(N, V, dev, liger_ops=liger_ops)
        logits = cases["logprobs"][0][0]
        size = logits.numel() * logits.element_size()
        copy_bw = 2 * size / bench(copier(logits)) / 1e6                  # GB/s of a read + write
        print(f"\n   V={V}: logits {size / 2**30:.2f} GiB, N*V = {N * V:.3g}; "
              f"copy {copy_bw:.0f} GB/s")
        for name, (inputs, bytes_fwd, bytes_fwd_bwd, variants) in cases.items():
            if name not in args.gpu_kernels.split(","):
                continue
            grads = [x for x in inputs if x.requires_grad]
            with torch.no_grad():
                want = variants["eager"](*inputs).float()
            print(f"   {name}: {'variant':<20} {'fwd ms':>8} {'% copy':>7} {'fwd+bwd ms':>11} "
                  f"{'% copy':>7} {'peak GiB':>9} {'max |d|':>9}")
            rows = {}
            for label, fn in variants.items():
                def fwd():
                    with torch.no_grad():
                        fn(*inputs)

                def fwd_bwd():
                    fn(*inputs).float().sum().backward()

                try:
                    with torch.no_grad():
                        diff = (fn(*inputs).float() - want).abs().max().item()
                    fwd_bwd()                             # compile / warm up
                except Exception as e:                    # noqa: BLE001 - a variant that cannot run
                    print(f"      {label:<20} failed: {type(e).__name__}: {str(e)[:120]}")
                    continue
                torch.cuda.synchronize()
                for x in grads:
                    x.grad = None
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                fwd_bwd()
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**30
                t_f = bench(fwd)
                t_fb = triton.testing.do_bench(fwd_bwd, warmup=10, rep=100, grad_to_none=grads)
                rows[label] = (t_f, t_fb)
                print(f"      {label:<20} {t_f:>8.3f} "
                      f"{100 * bytes_fwd / t_f / 1e6 / copy_bw:>6.0f}% {t_fb:>11.3f} "
                      f"{100 * bytes_fwd_bwd / t_fb / 1e6 / copy_bw:>6.0f}% {peak:>9.2f} "
                      f"{diff:>9.2e}")
            if "kernels (Triton)" in rows:
                t_f, t_fb = rows["kernels (Triton)"]
                ratios = ", ".join(f"{t / t_f:.2f}x / {tb / t_fb:.2f}x {label}"
                                   for label, (t, tb) in rows.items()
                                   if label != "kernels (Triton)")
                print(f"      speed-up of kernels.{name} (fwd / fwd+bwd): {ratios}")
        del cases, logits
        torch.cuda.empty_cache()


if __name__ == "__main__":
    args = parser.parse_args()
    if args._cpu_variant:
        cpu_child(args._cpu_variant, args.cpu_n, args.cpu_v, args.repeats, args.threads,
                  args.linear_c)
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
