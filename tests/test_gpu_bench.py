"""bench/gpu.py on a machine without a GPU: it refuses with one line; what it runs, in which order;
the sampler/trainer agreement measurement (exactly 0 in float32, and it does see a batch-dependent
score); the records, the skipping of finished steps and the report, with stand-in commands."""
import importlib.util
import json
import os
import subprocess
import random
import sys

import pytest
import torch

import task
from conftest import ROOT, refused
from hf.tokenizer import Tokenizer
from model import GPT, GPTConfig, completion_logits

spec = importlib.util.spec_from_file_location("gpu_bench", os.path.join(ROOT, "bench", "gpu.py"))
gpu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu)


@pytest.mark.slow
def test_refuses_without_cuda_in_one_line_and_writes_nothing(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}                # hides a GPU where there is one
    for extra in ([], ["--measure_ratio"]):
        p = subprocess.run([sys.executable, "bench/gpu.py", "--out", str(tmp_path / "out"),
                            "--results", str(tmp_path / "gpu.md"), *extra], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
        refused(p, "needs a CUDA GPU")
        assert len(p.stderr.strip().split("\n")) == 1, p.stderr
        assert os.listdir(tmp_path) == []                               # nothing was run or written


def test_every_training_script_runs_and_each_after_what_it_loads():
    names = gpu.training_scripts()
    found = set()
    for f in os.listdir(ROOT):
        text = open(os.path.join(ROOT, f)).read() if f.endswith(".py") else ""
        if "def parse_args(" in text and ('"--init"' in text or f[:-3] in ("sft", "prm", "search")):
            found.add(f[:-3])
    assert set(names) == found and len(names) == len(found)
    assert (names[0] == "sft"
            and {"grpo", "rloo", "reinforce", "ppo", "dpo", "ipo", "reward_model"} <= set(names))
    before = lambda a, b: a not in names or b not in names or names.index(a) < names.index(b)
    assert (before("reward_model", "ppo") and before("reward_model", "expert_iteration")
            and before("prm", "search"))


def test_off_share_counts_deviations_above_the_tolerance():
    d = torch.tensor([0.0, 5e-4, 1e-3, 2e-3, 1.0])
    assert gpu.off_share(d) == 0.4                               # strictly above 1e-3: 2e-3 and 1.0
    assert gpu.off_share(d, 1e-2) == 0.2 and gpu.off_share(torch.zeros(0)) == 0.0


def sampled_batch():
    """A small random policy and a rollout from it: 4 prompts x 4 samples."""
    torch.manual_seed(0)
    tok = Tokenizer()
    policy = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32)).eval()
    with torch.no_grad():
        policy.wte.weight.mul_(10.0)
    prompts = task.sample_prompts(random.Random(0), 4)
    batch = task.rollout(policy, tok, prompts, 4, 1.0, max_new_tokens=8,
                         generator=torch.Generator().manual_seed(1))
    return policy, batch


def test_the_first_update_ratio_is_exactly_one_in_float32_on_the_cpu():
    """The measurement bench/gpu.py makes on a GPU, here where everything is float32: every split,
    every order, gradient on or off, gives ratio exactly 1."""
    policy, batch = sampled_batch()
    splits = gpu.micro_batch_splits(16, parts=(1, 2, 4, 16))
    assert len(splits) == 12
    for rows_list in (parts for _, parts in splits):
        # each split covers every row once
        assert sorted(torch.cat(rows_list).tolist()) == list(range(16))
    logits_fn, context = gpu.scoring_variants("cpu")["no autocast (float32 throughout)"]
    dev = gpu.first_update_deviation(policy, batch, logits_fn, context, splits)
    assert set(dev) == {name for name, _ in splits}
    for d in dev.values():
        assert d.numel() == int(batch[3].sum()) and float(d.max()) == 0.0


def test_the_measurement_sees_a_score_that_depends_on_the_micro_batch():
    """A scorer whose logits move with the micro-batch's size (as bfloat16 rounding can): the
    deviation is 0 for splits with the full batch's size and not 0 for the others, and the bf16-head
    scorer gives bf16 logits."""
    policy, batch = sampled_batch()

    def shifty(model, prompt, prompt_mask, tokens, mask):
        logits = completion_logits(model, prompt, prompt_mask, tokens, mask).clone()
        logits[..., 0] += 0.01 * prompt.size(0)         # one vocabulary entry, batch-size dependent
        return logits

    splits = gpu.micro_batch_splits(16, parts=(1, 4))
    dev = gpu.first_update_deviation(policy, batch, shifty, lambda: torch.no_grad(), splits)
    for name, d in dev.items():
        assert (float(d.max()) == 0.0) == name.startswith("1 micro-batch,"), name
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert gpu.completion_logits_bf16_head(policy, *batch[:4]).dtype == torch.bfloat16
        assert completion_logits(policy, *batch[:4]).dtype == torch.float32


def test_records_skip_finished_steps_and_the_report_has_every_command_and_figure(tmp_path,
                                                                                 monkeypatch):
    """main() with stand-in commands (a fake training script that writes a metrics.jsonl, a plain
    step, a failing one): each is recorded with its wall time and output, the report shows them, a
    re-run skips what finished and runs again what failed."""
    runs = tmp_path / "runs"
    marker = tmp_path / "ran.txt"
    fake_script = ("import json, os\n"
                   "os.makedirs('out/fake', exist_ok=True)\n"
                   "open('out/fake/metrics.jsonl', 'w').write("
                   "json.dumps({'step': 0, 'eval_accuracy': 0.5}) + '\\n'"
                   " + json.dumps({'step': 2, 'samples': 64, 'eval_accuracy': 0.75}) + '\\n')\n"
                   f"open({str(marker)!r}, 'a').write('x')\n"
                   "print('step 2 | something')\n"
                   "print('done: 2 steps in 1s | held-out greedy accuracy 0.500 -> 0.750')\n")
    plan = [("tests:x", "tests", "Some tests", [sys.executable, "-c", "print('3 passed in 0.1s')"],
             ROOT), ("script:fake", "scripts", "python fake.py",
                     [sys.executable, "-c", fake_script], str(runs)),
            ("ratio", "ratio", "Agreement",
             [sys.executable, "-c", "import sys; print('| a | b |'); sys.exit(3)"], ROOT)]
    monkeypatch.setattr(gpu, "steps", lambda args: plan)
    monkeypatch.setattr(gpu, "environment", lambda: {k: k.upper() for k in (
        "device", "capability", "memory", "torch", "cuda", "cudnn", "python", "triton",
        "liger-kernel", "numpy", "driver", "commit")})
    args = gpu.parse_args(["--out", str(runs), "--results", str(tmp_path / "gpu.md")])
    assert gpu.main(args) == 1                                          # the ratio step failed
    records = json.load(open(runs / "steps.json"))
    assert records["script:fake"]["metrics"] == {"fake": [0.5, 0.75, 64]}
    assert (records["script:fake"]["summary"].startswith("done: 2 steps")
            and records["ratio"]["returncode"] == 3)
    report = open(tmp_path / "gpu.md").read()
    for text in ("DEVICE", "TORCH", "LIGER-KERNEL", "3 passed in 0.1s", "fake: 0.500 -> 0.750",
                 "| 64 |", "done: 2 steps in 1s", "exit 3", "| a | b |"):
        assert text in report, text
    # finished steps skipped, the failed one re-run
    assert gpu.main(args) == 1 and marker.read_text() == "x"
    assert gpu.main(gpu.parse_args(["--out", str(runs), "--results", str(tmp_path / "gpu.md"),
                                    "--only", "fake", "--fresh"])) == 0
    assert marker.read_text() == "xx"
    with pytest.raises(SystemExit, match="--only nonsense: nonsense unknown; allowed: "):
        gpu.main(gpu.parse_args(["--out", str(runs), "--only", "nonsense"]))


def test_the_gpu_kernel_benchmark_compares_like_with_like():
    """bench/kernels.py's GPU section times, for each kernel, variants that must compute the same
    per-row values: on a CPU at small sizes, the kernels' own path (their PyTorch path here, Triton
    on a GPU) agrees with the eager reference the benchmark checks against, so a GPU run compares
    like with like. (torch.compile variants compile the same eager functions; Liger-Kernel's rows
    need CUDA.)"""
    spec = importlib.util.spec_from_file_location("kernels_bench",
                                                  os.path.join(ROOT, "bench", "kernels.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cases = bench.gpu_cases(6, 37, "cpu", dtype=torch.float32, C=8)
    assert set(cases) == {"logprobs", "kl", "entropy", "linear_logprobs"}
    for name, (inputs, bytes_fwd, bytes_fwd_bwd, variants) in cases.items():
        assert ({"eager", "torch.compile", "kernels (Triton)"} <= set(variants)
                and 0 < bytes_fwd < bytes_fwd_bwd)
        want = variants["eager"](*inputs)
        torch.testing.assert_close(variants["kernels (Triton)"](*inputs), want, rtol=1e-5,
                                   atol=1e-5, msg=name)
