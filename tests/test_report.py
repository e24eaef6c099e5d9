"""plumbing/live.py and plumbing/plot.py: a run seen while it goes (--report_to tensorboard: the
event files read back hold exactly what metrics.jsonl holds) and afterwards (python -m
plumbing.plot: one PNG of the panels the run logged)."""
import importlib.util
import json
import os

import pytest

import evaluation
import task
from conftest import ROOT, refuses_all, run_script, task_args
from hf.checkpoint import load_checkpoint
from hf.tokenizer import Tokenizer
from plumbing import live, plot

TINY_SFT = os.path.join(ROOT, "tests", "fixtures", "tiny_sft.pt")
TINY = ["--init", TINY_SFT, "--steps", "2", "--log_every", "1", "--eval_every", "1", "--eval_n",
        "8", "--prompts_per_step", "4", "--group_size", "4"]


def rows_of(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def scalars(folder):
    """{tag: {step: value}} of the TensorBoard event files in `folder`, as TensorBoard reads them
    (a purge honoured)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(folder, size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)}
            for tag in events.Tags()["scalars"]}


def test_tensorboard_mirrors_every_number_the_log_writes(tmp_path):
    """Every number of every row at its step (float32, as TensorBoard keeps them); a fresh run in
    the same folder replaces the earlier one's curves, as it replaces its log (a shorter run of
    another seed: none of the first run's third step is left)."""
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    for seed, steps in (("0", "3"), ("1", "2")):
        p = run_script("grpo.py", TINY + ["--out", str(out), "--report_to", "tensorboard",
                                          "--seed", seed, "--steps", steps])
        assert p.returncode == 0, p.stderr
        rows, seen = rows_of(out / "grpo"), scalars(str(out / "grpo"))
        numbers = {(k, r["step"]): v for r in rows for k, v in r.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        assert {(k, s) for k, steps in seen.items() for s in steps} == set(numbers)
        for (k, s), v in numbers.items():
            assert seen[k][s] == pytest.approx(v, rel=1e-6, abs=1e-30), (k, s)
        assert any(k == "loss" and v != 0 for (k, _), v in numbers.items())


def test_a_tracker_unknown_or_not_installed_is_refused_before_any_work(tmp_path):
    missing = importlib.util.find_spec("tensorboard") is None
    cases = [(["--report_to", "wandb"], ["--report_to wandb: unknown", "allowed: none, "
                                                                       "tensorboard"])]
    if missing:
        cases.append((["--report_to", "tensorboard"], ["pip install tensorboard"]))
    refuses_all("grpo.py", cases, tmp_path)
    assert not (tmp_path / "out0").exists()


def test_a_finished_runs_folder_draws_its_own_plot(tmp_path):
    out = tmp_path / "run"
    assert run_script("grpo.py", TINY + ["--out", str(out)]).returncode == 0
    path, keys = plot.plot(str(out / "grpo"))
    assert path == str(out / "grpo" / "plot.png") and os.path.getsize(path) > 10_000
    assert keys == ["reward_mean", "kl_exact", "completion_len", "eval_accuracy"]
    with pytest.raises(ValueError, match="no metrics.jsonl"):
        plot.plot(str(tmp_path))
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n')
    with pytest.raises(ValueError, match="none of reward_mean"):
        plot.plot(str(tmp_path))


class Stream:
    """A terminal or a log file, as Progress sees it."""

    def __init__(self, tty):
        self.tty, self.text = tty, ""

    def isatty(self):
        return self.tty

    def write(self, text):
        self.text += text

    def flush(self):
        pass


def test_a_long_phase_says_how_far_along_it_is_on_one_line_or_a_line_each():
    said = []
    quiet = live.Progress("evaluating", said.append, after=3600, stream=Stream(False))
    quiet(1, 2)
    assert said == []                                    # a short phase says nothing
    log = live.Progress("evaluating", said.append, after=0, stream=Stream(False))
    log(1, 2), log(2, 2)
    assert [s.split(" (")[0] for s in said] == ["evaluating: 1/2", "evaluating: 2/2"]
    terminal = Stream(True)
    shown = live.Progress("evaluating", said.append, after=0, stream=terminal)
    shown(1, 2), shown(2, 2)
    assert len(said) == 2 and terminal.text.count("\r") == 2 and terminal.text.endswith(" s)\n")
    assert terminal.text.count("\n") == 1                # one line, updated in place


def test_the_evaluation_reports_each_batch_of_both_passes():
    task.use(task_args())
    model, _ = load_checkpoint(TINY_SFT)
    seen = []
    prompts = task.eval_prompts()[:300]                  # two batches of 256 a pass
    out = evaluation.evaluate(model, Tokenizer(), prompts, num_samples=1,
                              progress=lambda done, total: seen.append((done, total)))
    assert seen == [(256, 600), (300, 600), (556, 600), (600, 600)]
    assert out == evaluation.evaluate(model, Tokenizer(), prompts, num_samples=1)
