"""plumbing/run.py and the scripts' run behaviour, one test per class of bad input or inconsistency:
every numeric flag of every script refused at parse time when non-finite or out of range; limits
known at start checked at start; device errors that say device; any working directory; the metrics
log consistent with the checkpoint across kills and Ctrl-C; one run per output folder;
--eval_every on its own; resume refusing what it should not resume."""
import argparse
import glob
import importlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import plumbing
from conftest import ROOT, as_a_process, refused, run_script, run_scripts
from hf.checkpoint import load_checkpoint, save_checkpoint
from model import GPT, GPTConfig
from plumbing import flags
from plumbing import loading
from plumbing import parking
from plumbing.lock import OutputLock, _start_ticks

SCRIPTS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "*.py"))
                 if "\ndef parse_args(" in open(p).read())


def script_parser(name, monkeypatch):
    """The ArgumentParser a script builds (captured from flags.parser as the script calls it)."""
    module = importlib.import_module(name)
    made = []

    def recording(doc):
        made.append(flags.parser(doc))
        return made[-1]

    monkeypatch.setattr(module, "parser", recording)
    module.parse_args([])                                            # the defaults parse
    return module, made[0]


def numeric_actions(parser):
    return [a for a in parser._actions if a.option_strings and a.option_strings[0] != "--help"
            and (isinstance(a.type, flags._Number) or a.type in (int, float)
                 or (isinstance(a.default, (int, float)) and not isinstance(a.default, bool)))]


def bad_values(action):
    """Text values the flag must refuse: non-finite ones and the first value past each bound."""
    t = action.type
    values = ["nan", "inf", "-inf", "x"]
    for op, b in t.bounds:
        step = 1 if t.kind is int else 1e-9 * max(1.0, abs(b))
        values.append(str({"gt": b, "ge": b - step, "lt": b, "le": b + step}[op]))
    return values


def test_the_scripts_are_found():
    assert {"sft", "grpo", "rloo", "reinforce", "reward_model", "ppo", "dpo", "ipo"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_numeric_flag_is_range_checked_at_parse_time(name, monkeypatch, capsys):
    module, parser = script_parser(name, monkeypatch)
    actions = numeric_actions(parser)
    assert actions, name
    for action in actions:
        flag = action.option_strings[0]
        assert isinstance(action.type, flags._Number), f"{name}.py {flag} has no range-checked type"
        if action.default is not None:
            action.type(str(action.default))                         # the default itself is allowed
        for value in bad_values(action):
            with pytest.raises(SystemExit) as e:
                # "=": argparse reads "-inf" as an option otherwise
                module.parse_args([f"{flag}={value}"])
            assert e.value.code == 2
            err = capsys.readouterr().err
            assert flag in err and value in err and "allowed" in err, (flag, value, err)


def test_number_types_accept_the_boundary_they_include():
    assert flags.Float(ge=0, le=1)("0") == 0.0 and flags.Float(ge=0, le=1)("1") == 1.0
    assert flags.Int(ge=1)("1") == 1
    assert flags.Float(gt=0)("1e9") == 1e9 and flags.Int(ge=1)("10000000000") == 10 ** 10
    for t, text in ((flags.Float(gt=0), "0"), (flags.Float(lt=1), "1"), (flags.Int(ge=1), "1.5"),
                    (flags.Float(ge=1), "1e39"), (flags.Float(ge=0), "1000000001")):
        with pytest.raises(Exception):
            t(text)


# -----------------------------------------------------------------------------
# Limits and devices, checked before any work

TINY_RL = ["--prompts_per_step", "4", "--group_size", "2", "--log_every", "1", "--eval_every", "2",
           "--eval_n", "8"]


@pytest.mark.parametrize("script", ["grpo", "rloo", "reinforce"])
def test_max_new_tokens_past_the_context_is_refused_before_any_work(script, tiny_sft, tmp_path):
    p = run_script(f"{script}.py", TINY_RL
                   + ["--max_new_tokens", "60", "--init", tiny_sft, "--out", str(tmp_path)])
    refused(p, "--max_new_tokens 60", "block_size", "<= 58")
    # not even the step-0 evaluation ran
    assert not os.path.exists(tmp_path / script / "metrics.jsonl")


def test_what_can_be_refused_at_start_is_refused_before_building_a_prerequisite(tmp_path):
    """out/sft.pt is the missing default here: each of these is refused without building it
    first."""
    junk = tmp_path / "junk.pt"
    junk.write_bytes(os.urandom(2000))
    cases = [("trpo.py", ["--max_new_tokens", "100000"], ["--max_new_tokens 100000", "<= "]),
             ("trpo.py", ["--resume"], ["--resume", "no checkpoint at"]),
             ("grpo.py", ["--resume", "--out", str(tmp_path / "x")],
              ["--resume", "no checkpoint at"]),
             ("expert_iteration.py", ["--select", "rm", "--rm", str(junk)], ["--rm", "junk.pt"]),
             ("ppo.py", ["--rm", str(tmp_path / "missing.pt")],
              ["--rm", "no checkpoint at", "missing.pt"])]
    done = run_scripts([(script, args) for script, args, _ in cases], cwd=tmp_path, timeout=120)
    for p, (script, args, words) in zip(done, cases):
        refused(p, *words)
        assert "building it first" not in p.stdout, (script, args)
    assert not os.path.exists(tmp_path / "out" / "sft.pt")


def test_eval_n_past_the_held_out_problems_is_one_line(tiny_sft, tmp_path):
    p = run_script("grpo.py", TINY_RL + ["--steps", "1", "--eval_n", "513", "--init", tiny_sft,
                                         "--out", str(tmp_path)])
    refused(p, "--eval_n 513; allowed: 1 to 512, the held-out problems of --task arithmetic")
    assert os.listdir(tmp_path) == []


def write_run(out, steps, tiny_sft):
    assert run_script("grpo.py", TINY_RL
                      + ["--steps", str(steps), "--init", tiny_sft, "--out", out]).returncode == 0
    return {f: open(os.path.join(out, f), "rb").read()
            for f in ("grpo.pt", os.path.join("grpo", "metrics.jsonl"))}


def test_a_refused_run_leaves_the_folders_earlier_run_untouched(tiny_sft, tmp_path):
    out = str(tmp_path)
    earlier = write_run(out, 2, tiny_sft)
    for args in (["--init", str(tmp_path / "missing.pt")],
                 ["--init", tiny_sft, "--max_new_tokens", "60"],
                 ["--init", tiny_sft, "--device", "tpu"],
                 ["--init", tiny_sft, "--resume", "--steps", "1"]):
        p = run_script("grpo.py", TINY_RL + args + ["--out", out])
        assert p.returncode != 0, args
        assert {f: open(os.path.join(out, f), "rb").read() for f in earlier} == earlier, args
    p = run_script("grpo.py",
                   TINY_RL + ["--init", tiny_sft, "--resume", "--steps", "3", "--out", out])
    # the earlier run resumes
    assert p.returncode == 0 and steps_logged(out) == [0, 1, 2, 3], p.stderr


@pytest.mark.slow
def test_a_fresh_run_killed_before_its_first_checkpoint_leaves_no_older_checkpoint_beside_its_log(
    tiny_sft, tmp_path):
    """A fresh run replaces the folder's earlier run once its checks pass: killed before it saves,
    its log is never paired with the earlier run's checkpoint (a --resume then says there is nothing
    to resume)."""
    out = str(tmp_path)
    write_run(out, 3, tiny_sft)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.Popen([sys.executable, "grpo.py", "--prompts_per_step", "4", "--group_size", "2",
                          "--log_every", "2", "--eval_every", "1000", "--eval_n", "8",
                          "--steps", "1000", "--init", tiny_sft, "--out", out], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    for line in p.stdout:
        if line.startswith("step     2"):
            break
    p.kill()
    p.wait()
    assert not os.path.exists(os.path.join(out, "grpo.pt"))
    # this run logs even steps, the earlier every step
    logged = steps_logged(out)
    # even steps only (the kill may beat step 2's row): the earlier run's log, every step, is gone
    assert logged[:1] == [0] and all(s % 2 == 0 for s in logged), logged
    refused(run_script("grpo.py", TINY_RL
                       + ["--init", tiny_sft, "--resume", "--steps", "5", "--out", out]),
            "no checkpoint at")


@pytest.mark.slow
def test_ctrl_c_during_the_starting_evaluation_stops_at_once_and_leaves_nothing(tiny_sft, tmp_path):
    """The run still loads until its first evaluation has ended: a Ctrl-C then stops it at once
    (exit 130), nothing trained or written, no folder left; the same command then starts afresh
    and logs step 0 once."""
    out = str(tmp_path / "run")
    flags = ["--prompts_per_step", "2", "--group_size", "2", "--log_every", "1",
             "--eval_every", "1000", "--init", tiny_sft, "--out", out]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.Popen([sys.executable, "grpo.py", *flags, "--steps", "1000"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    # the start line; the evaluation of all 512 follows
    for line in p.stdout:
        if line.startswith("GRPO:"):
            break
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 130, stderr
    assert "SIGINT while loading: stopped; nothing was trained or written" in stdout, stdout
    assert "Traceback" not in stderr and not os.path.exists(out), stderr
    p = run_script("grpo.py", flags + ["--steps", "2"])
    assert p.returncode == 0, p.stderr
    assert steps_logged(out) == [0, 1, 2]


def test_the_resume_command_is_torchruns_under_torchrun(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    launcher = lambda world: plumbing.Run.launcher(type("R", (), {"world": world})())
    assert launcher(1) == "python"
    assert launcher(4) == "torchrun --standalone --nproc_per_node 4"
    assert launcher(8).startswith("torchrun --nnodes 2 --nproc_per_node 4")


def test_a_prerequisite_is_built_as_one_process_under_torchrun(monkeypatch, tmp_path):
    """build_missing's child must not inherit torchrun's variables: it would wait for a process
    group that never forms."""
    seen = {}

    def fake_run(cmd, env=None):
        seen["env"] = env
        open(tmp_path / "sft.pt", "w").close()
        return subprocess.CompletedProcess(cmd, 0)

    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                 "MASTER_ADDR": "x", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "r",
                 "GROUP_RANK": "0", "ROLE_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(loading.subprocess, "run", fake_run)
    path = str(tmp_path / "sft.pt")
    loading.build_missing(path, path, ["sft.py"])
    assert seen["env"] is not None and "PATH" in seen["env"]
    assert not [k for k in seen["env"] if k in loading.TORCHRUN_VARIABLES
                or k.startswith("TORCHELASTIC_")]


@pytest.mark.slow
def test_a_partial_prerequisite_is_continued_never_used_as_finished(monkeypatch, tmp_path,
                                                                     capsys):
    """A build stopped at step 2 of 4 (what Ctrl-C leaves at the default path): build_missing
    continues it with --resume and says so, and leaves the finished checkpoint; a partial one at
    another path is used with a note; a build its child stops (exit 130) stops the run with 130."""
    sft = ["sft.py", "--steps", "4", "--warmup", "1", "--batch_size", "8", "--n_layer", "1",
           "--n_head", "1", "--n_embd", "16", "--log_every", "1", "--eval_every", "2",
           "--eval_n", "8"]
    real = plumbing.Run.training

    def ctrl_c_after_step_2(self):
        self.interrupted = self.interrupted or self.step == 2
        return real(self)

    monkeypatch.setattr(plumbing.Run, "training", ctrl_c_after_step_2)
    p = run_script(sft[0], sft[1:] + ["--out", str(tmp_path)])
    monkeypatch.undo()
    path = str(tmp_path / "sft.pt")
    assert p.returncode == 130 and loading.progress(path) == (2, 4)
    loading.build_missing(path, str(tmp_path / "elsewhere.pt"), sft)
    assert "note: " in capsys.readouterr().out and loading.progress(path) == (2, 4)
    loading.build_missing(path, path, sft)
    assert "is a partial build (step 2 of 4): continuing it" in capsys.readouterr().out
    assert loading.progress(path) is None and load_checkpoint(path)[1]["step"] == 4
    rows = [json.loads(line) for line in open(tmp_path / "sft" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]

    os.remove(path)
    monkeypatch.setattr(loading.subprocess, "run",
                        lambda cmd, env=None: subprocess.CompletedProcess(cmd, 130))
    with pytest.raises(SystemExit) as stopped:
        loading.build_missing(path, path, sft)
    assert stopped.value.code == 130
    assert f"stopped while building {path}" in capsys.readouterr().out


def test_a_resume_under_another_thread_count_says_so(tmp_path):
    """The checkpoint keeps torch's thread count; a resume under another one names both (a run
    reproduces bit for bit only with the same count)."""
    sft = ["--steps", "2", "--warmup", "1", "--batch_size", "8", "--n_layer", "1", "--n_head", "1",
           "--n_embd", "16", "--log_every", "1", "--eval_every", "2", "--eval_n", "8",
           "--out", str(tmp_path)]
    assert run_script("sft.py", sft).returncode == 0
    path = tmp_path / "sft.pt"
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["threads"] == torch.get_num_threads() and ckpt["total_steps"] == 2
    p = run_script("sft.py", sft[2:] + ["--steps", "3", "--resume"])
    assert p.returncode == 0 and "torch threads" not in p.stdout
    ckpt = torch.load(path, weights_only=True)
    ckpt["threads"] += 1
    torch.save(ckpt, path)
    p = run_script("sft.py", sft[2:] + ["--steps", "4", "--resume"])
    assert p.returncode == 0, p.stderr
    assert f"torch threads {ckpt['threads']} -> {torch.get_num_threads()}" in p.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("script", ["dpo", "reward_model", "grpo"])
def test_an_unavailable_device_is_one_line_about_the_device(script, tiny_sft, tmp_path):
    p = run_script(f"{script}.py", ["--device", "cuda", "--init", tiny_sft, "--out", str(tmp_path)])
    refused(p, "cuda is not available here")
    # a good checkpoint is never blamed
    assert "corrupt" not in p.stderr and "truncated" not in p.stderr
    refused(run_script(f"{script}.py", ["--device", "tpu", "--out", str(tmp_path)]), "'tpu'",
            "allowed: cuda, mps, cpu")


def test_out_pointing_at_a_file_is_one_line(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    refused(run_script("grpo.py", ["--out", str(f)]), f"--out {f} is a file")


@pytest.mark.slow
def test_a_script_run_from_another_directory_builds_its_prerequisite_where_it_loads_it(tiny_sft,
                                                                                       tmp_path):
    """ppo.py run from elsewhere, with out/sft.pt there and no out/rm.pt: the reward model is built
    into that directory's out/ (from that out/sft.pt), then loaded from there."""
    os.makedirs(tmp_path / "out")
    shutil.copy(tiny_sft, tmp_path / "out" / "sft.pt")
    repo_rm = os.path.join(ROOT, "out", "rm.pt")
    before = os.path.getmtime(repo_rm) if os.path.exists(repo_rm) else None
    p = run_script("ppo.py", ["--steps", "1", "--batch_size", "8", "--eval_n", "8"], cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "building it first" in p.stdout and "done: 1 steps" in p.stdout
    assert (os.path.exists(tmp_path / "out" / "rm.pt")
            and os.path.exists(tmp_path / "out" / "ppo.pt"))
    # the repository's out/ untouched
    assert (os.path.getmtime(repo_rm) if os.path.exists(repo_rm) else None) == before


# -----------------------------------------------------------------------------
# The metrics log and the checkpoint

def steps_logged(out, name="grpo"):
    return [json.loads(line)["step"] for line in open(os.path.join(out, name, "metrics.jsonl"))]


def test_eval_every_is_honoured_on_its_own(tiny_sft, tmp_path):
    out = str(tmp_path)
    p = run_script("grpo.py", ["--prompts_per_step", "2", "--group_size", "2", "--eval_n", "4",
                               "--log_every", "2", "--eval_every", "3", "--steps", "8",
                               "--init", tiny_sft, "--out", out])
    assert p.returncode == 0, p.stderr
    rows = [json.loads(line) for line in open(os.path.join(out, "grpo", "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [0, 2, 3, 4, 6, 8]
    assert [r["step"] for r in rows if "eval_accuracy" in r] == [0, 3, 6, 8]


@pytest.mark.slow
def test_ctrl_c_stops_cleanly_and_resume_logs_each_step_once(tiny_sft, tmp_path):
    out = str(tmp_path / "sp ace")                                  # the resume command quotes it
    flags = ["--prompts_per_step", "2", "--group_size", "2", "--eval_n", "4", "--log_every", "1",
             "--eval_every", "1000",
             "--init", tiny_sft, "--out", out]
    args = [sys.executable, "grpo.py", *flags, "--steps", "1000"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env)
    for line in p.stdout:                                           # wait for the third logged step
        if line.startswith("step     3"):
            break
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 130 and "Traceback" not in stderr, stderr
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("stopped at step ") and "--resume" in last and "grpo.pt" in last, last
    stopped = int(last.split()[3])
    command = shlex.split(last.split("continue with: ")[1])
    assert command[:2] == ["python", "grpo.py"] and command[command.index("--out") + 1] == out, last
    # the message named the step it stopped at
    assert f"SIGINT: stopping after step {stopped} and" in stdout, stdout
    assert load_checkpoint(os.path.join(out, "grpo.pt"))[1]["step"] == stopped
    assert steps_logged(out) == list(range(stopped + 1))
    # a kill between logging a step and checkpointing it: the log runs ahead of the checkpoint, a
    # line cut short
    with open(os.path.join(out, "grpo", "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": stopped + 1, "orphan": True}) + "\n" + '{"step": 99')
    p = run_script("grpo.py", flags + ["--steps", str(stopped + 2), "--resume"])
    assert p.returncode == 0, p.stderr
    assert steps_logged(out) == list(range(stopped + 3))      # each step once, the orphan line gone
    assert not any("orphan" in line for line in open(os.path.join(out, "grpo", "metrics.jsonl")))


def test_resume_with_the_log_missing_still_finishes(tiny_sft, tmp_path):
    out = str(tmp_path)
    tiny = ["--batch_size", "8", "--n_pairs", "64", "--log_every", "1", "--eval_every", "2",
            "--eval_n", "8", "--init", tiny_sft, "--out", out]
    assert run_script("dpo.py", tiny + ["--steps", "2"]).returncode == 0
    os.remove(os.path.join(out, "dpo", "metrics.jsonl"))
    p = run_script("dpo.py", tiny + ["--steps", "3", "--resume"])
    assert p.returncode == 0, p.stderr
    # the summary's "before" comes from the checkpoint
    assert "done: 3 steps" in p.stdout and "->" in p.stdout
    assert steps_logged(out, "dpo") == [3]


@pytest.mark.parametrize("script", ["grpo", "agent", "multiturn"])
def test_non_finite_logits_stop_the_run_with_one_line(script, tiny_sft, tmp_path):
    """An --init whose weights hold NaN is refused at load, naming the tensor; one whose finite
    weights give infinite logits (the tied embedding at 1e38) reaches the sampler (generate, and
    episodes for agent.py and multiturn.py), which finds them not finite: the run stops with one
    error line, no traceback."""
    init = tiny_sft if script != "agent" else os.path.join(ROOT, "tests", "fixtures",
                                                            "tiny_tool_sft.pt")
    policy, ckpt = load_checkpoint(init)
    changes = (("nan", lambda w: w.fill_(float("nan"))), ("huge", lambda w: w.mul_(1e38)))
    for name, change in changes:
        with torch.no_grad():
            change(policy.wte.weight)
        path = str(tmp_path / f"{name}.pt")
        save_checkpoint(path, policy, ckpt["tokenizer"])
        p = run_script(f"{script}.py", TINY_RL + ["--steps", "1", "--init", path,
                                                   "--out", str(tmp_path / name)])
        if name == "nan":
            refused(p, path, "tensor wte.weight holds NaN or infinite values")
        else:
            refused(p, "the model's logits are not finite", "(step 1)", "lower --lr")
        assert not os.path.exists(tmp_path / name)      # nothing left: stopped before any step
        policy = load_checkpoint(init)[0]


def test_a_gradient_norm_that_is_not_finite_stops_the_step_before_the_optimizer():
    """clip_grad_norm hands its norm to check_finite, which stops the run with one line naming the
    gradient's norm; a finite norm passes."""
    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    seen = []
    run = type("R", (), {"twins": {}, "args": argparse.Namespace(lr=0.1),
                         "check_finite": lambda self, *a: seen.append(a)})()
    assert torch.isfinite(plumbing.Run.clip_grad_norm(run, model, 1.0))
    model.weight.grad[0, 0] = float("nan")
    assert not torch.isfinite(plumbing.Run.clip_grad_norm(run, model, 1.0))
    assert [a[1:] for a in seen] == [("lower --lr (now 0.1)", "the gradient's norm")] * 2
    assert torch.isfinite(seen[0][0]) and not torch.isfinite(seen[1][0])


# -----------------------------------------------------------------------------
# One run per output folder

def test_a_second_run_on_the_same_folder_is_refused_and_a_dead_lock_taken_over(tiny_sft, tmp_path):
    out = str(tmp_path)
    lock = os.path.join(out, "grpo.lock")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    me = {"pid": live.pid, "host": socket.gethostname(), "command": "pytest (a live run)",
          "started": "now", "start_ticks": _start_ticks(live.pid)}
    with open(lock, "w") as f:
        json.dump(me, f)
    try:
        p = run_script("grpo.py", TINY_RL + ["--steps", "1", "--init", tiny_sft, "--out", out])
    finally:
        live.kill()
        live.wait()
    refused(p, "another run is using this output folder", str(live.pid), "pytest (a live run)")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True)
    with open(lock, "w") as f:
        json.dump({**me, "pid": int(dead.stdout)}, f)                   # that process has exited
    open(os.path.join(out, "grpo.pt.tmp12345"), "w").close()            # an orphan of a killed save
    p = run_script("grpo.py", TINY_RL + ["--steps", "1", "--init", tiny_sft, "--out", out])
    assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(out)) == ["grpo", "grpo.pt"]            # lock released, orphan removed


@pytest.mark.parametrize("content", [
    [1, 2], 42, "text", {"host": "HOST"}, {"pid": 1e100, "host": "HOST"},
    {"pid": -1, "host": "HOST"}, {"pid": 2 ** 40, "host": "HOST"}, {"pid": "PID", "host": "HOST"},
    {"pid": "ME", "host": "HOST"},
    {"pid": 1, "host": "HOST", "start_ticks": -5}])
def test_a_lock_that_is_no_runs_is_taken_over(content, tmp_path):
    """A lock of another shape, a pid out of range, this process's own pid (the run itself: a
    container restarted on the same host name) or a live pid whose start time is not the lock's
    (a reused pid): no run holds it, so it is taken over, never a traceback or a refusal."""
    fill = {"HOST": socket.gethostname(), "PID": str(os.getpid()), "ME": os.getpid()}
    if isinstance(content, dict):
        content = {k: fill.get(v, v) if isinstance(v, str) else v for k, v in content.items()}
    path = tmp_path / "x.lock"
    path.write_text(json.dumps(content))
    lock = OutputLock(str(path))
    assert lock.held and json.loads(path.read_text())["pid"] == os.getpid()
    lock.release()
    assert not path.exists()


def test_a_live_run_on_another_host_or_with_its_own_start_time_keeps_its_lock(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        for owner in ({"pid": live.pid, "host": socket.gethostname(),
                       "start_ticks": _start_ticks(live.pid)},
                      {"pid": live.pid, "host": socket.gethostname()},          # an older lock
                      {"pid": 12345, "host": "another-machine"}):
            path = tmp_path / "x.lock"
            path.write_text(json.dumps(owner))
            with pytest.raises(SystemExit, match=f"pid {owner['pid']} on {owner['host']} since"):
                OutputLock(str(path))
    finally:
        live.kill()
        live.wait()


@pytest.mark.slow
def test_a_second_run_on_a_busy_output_folder_is_refused(tiny_sft, tmp_path):
    """A run holds its output folder's lock while it trains: a second one started on the same folder
    then is refused in one line and touches nothing; the first, stopped with Ctrl-C afterwards, has
    logged every step it took once. (The second starts once the lock exists, so that the two overlap
    whatever the machine's load.)"""
    out = str(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "grpo.py", *TINY_RL, "--steps", "100000", "--init", tiny_sft,
           "--out", out]
    first = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env)
    t = time.time()
    while not os.path.exists(os.path.join(out, "grpo.lock")):
        assert first.poll() is None and time.time() - t < 120, first.communicate()
        time.sleep(0.1)
    second = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert first.poll() is None                                    # still training
    first.send_signal(signal.SIGINT)
    stdout, stderr = first.communicate(timeout=120)
    assert first.returncode == 130, stdout[-2000:] + stderr[-2000:]
    refused(second, "another run is using this output folder")
    steps = steps_logged(out)
    assert steps == list(range(len(steps))) and len(steps) >= 1


# -----------------------------------------------------------------------------
# Resume checks what it resumes

def test_resume_refuses_another_init_another_scripts_checkpoint_and_a_lower_step_limit(tiny_sft,
                                                                                       tmp_path):
    out = str(tmp_path / "run")
    common = TINY_RL + ["--out", out]
    assert run_script("grpo.py", common + ["--steps", "2", "--init", tiny_sft]).returncode == 0
    other = str(tmp_path / "other_sft.pt")                     # the same weights under another path
    shutil.copy(tiny_sft, other)
    refused(run_script("grpo.py", common + ["--steps", "3", "--init", other, "--resume"]),
            "was trained from", tiny_sft)
    retrained = str(tmp_path / "retrained" / "sft.pt")         # the same path, other weights
    model, ckpt = load_checkpoint(tiny_sft)
    with torch.no_grad():
        model.wte.weight.add_(0.01)
    save_checkpoint(retrained, model, ckpt["tokenizer"], step=ckpt["step"])
    assert run_script("grpo.py", TINY_RL + ["--out", str(tmp_path / "r2"), "--steps", "1",
                                            "--init", retrained]).returncode == 0
    save_checkpoint(retrained, load_checkpoint(tiny_sft)[0], ckpt["tokenizer"], step=ckpt["step"])
    refused(run_script("grpo.py", TINY_RL
                       + ["--out", str(tmp_path / "r2"), "--steps", "2", "--init", retrained,
                          "--resume"]), "holds other weights now")
    refused(run_script("grpo.py", common + ["--steps", "1", "--init", tiny_sft, "--resume"]),
            "step 2", "limit of 1")
    shutil.copy(os.path.join(out, "grpo.pt"),
                os.path.join(out, "rloo.pt"))                          # another script's checkpoint
    refused(run_script("rloo.py", common + ["--steps", "3", "--init", tiny_sft, "--resume"]),
            "written by grpo.py", "rloo.py")
    refused(run_script("rloo.py", common[:-2]
                       + ["--out", str(tmp_path / "none"), "--init", tiny_sft, "--resume"]),
            "no checkpoint at")


def test_the_learning_rate_schedule_warms_up_linearly_then_decays_by_a_cosine_to_a_tenth():
    lr = plumbing.lr_schedule
    # warm-up: (step + 1) / warmup
    assert [lr(s, 1.0, 4, 14) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert (lr(4, 1.0, 4, 14) == 1.0
            and lr(14, 1.0, 4, 14) == pytest.approx(0.1))           # decay starts at 1, ends at 0.1
    assert lr(9, 2.0, 4, 14) == pytest.approx(2.0 * (0.1 + 0.9 * 0.5))   # half way: cos(pi / 2) = 0
    assert lr(20, 1.0, 4, 14) == pytest.approx(0.1)                     # past the end: stays at 0.1
    assert lr(100, 3e-4, 0, None) == 3e-4 and lr(0, 3e-4, 0, 10) == 3e-4  # no warm-up; constant


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_parked_weights_hold_memory_only_inside_with_and_come_back_bit_for_bit(device):
    """parking.Parked (the on-policy scripts' reference on a GPU): outside `with` no parameter
    holds memory where it lives; inside, the model computes what it did before, every time; a tied
    weight is parked once; on a GPU the host copy is pinned."""
    from model import GPT, GPTConfig
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA here")
    model = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=16)).to(device)
    assert model.lm_head.weight is model.wte.weight                 # tied: one storage, parked once
    x = torch.randint(0, 40, (2, 9), device=device)
    with torch.no_grad():
        before = model(x)[0]
    parked = parking.Parked(model.requires_grad_(False))
    assert len(parked.storages) == len(list(model.parameters()))
    assert sum(h.numel() for h in parked.host) == sum(p.nbytes for p in model.parameters())
    assert all(h.is_pinned() == (device == "cuda") for h in parked.host)
    for _ in range(2):
        assert all(p.untyped_storage().size() == 0 for p in model.parameters())
        with parked, torch.no_grad():
            assert torch.equal(model(x)[0], before)
    assert all(p.untyped_storage().size() == 0 for p in model.parameters())


def test_a_reference_is_parked_only_on_a_gpu_and_never_when_it_shares_the_policys_weights(tiny_sft):
    """Run.parked: a reference of its own on a GPU is Parked; on the CPU, or a LoRA policy's (its
    frozen weights are the policy's), nothing moves."""
    import contextlib
    import types

    from lora import add_adapters, base_model
    policy, _ = load_checkpoint(tiny_sft)
    ref, _ = load_checkpoint(tiny_sft)
    assert isinstance(plumbing.Run.parked(types.SimpleNamespace(device="cuda"), ref, policy),
                      parking.Parked)
    assert all(p.untyped_storage().size() == 0 for p in ref.parameters())
    cpu = plumbing.Run.parked(types.SimpleNamespace(device="cpu"), policy, ref)
    assert isinstance(cpu, contextlib.nullcontext)
    add_adapters(policy, 2, 4)
    shared = plumbing.Run.parked(types.SimpleNamespace(device="cuda"), base_model(policy), policy)
    assert isinstance(shared, contextlib.nullcontext)
    assert all(p.untyped_storage().size() > 0 for p in policy.parameters())


@pytest.mark.parametrize("script", ["grpo", "rloo", "reinforce"])
def test_the_parked_reference_is_away_while_sampling_and_updating_and_moves_no_number(
    script, tiny_sft, tmp_path, monkeypatch):
    """grpo, rloo and reinforce with the reference parked as on a GPU (here on the CPU): its weights
    are back for step 2's forwards and away for sampling and the update, and metrics.jsonl is the
    unparked run's line for line (times aside)."""
    from conftest import parked_runs
    module = importlib.import_module(script)
    argv = TINY_RL + ["--steps", "2", "--init", tiny_sft, "--device", "cpu"]
    assert parked_runs(module, argv, tmp_path, monkeypatch) == [2]          # a forward a step


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_parked_moments_are_on_the_device_only_inside_the_step_and_change_no_number(device):
    """parking.ParkedMoments (--offload_optimizer on a GPU): between AdamW's steps its moments hold
    no memory where they live; the step runs a chunk of parameters at a time, each chunk's moments
    alone on the device while it is stepped, every parameter once; three steps leave the weights and
    the moments bit for bit as plain AdamW's, and so does a step after the state is cleared; `with`
    brings them back; moments loaded from a checkpoint leave at once; on a GPU the host copies are
    pinned."""
    from model import GPT, GPTConfig
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA here")
    config = GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=16)
    models = [GPT(config).to(device) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
                  for m in models]
    parked = parking.ParkedMoments(optimizers[1], chunk_bytes=4096)
    moments = lambda opt: [t for st in opt.state.values() for k, t in st.items() if k != "step"]
    away = lambda opt: all(t.untyped_storage().size() == 0 for t in moments(opt))
    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(a, b))
    chunks = []

    def seen(opt, *_):                                  # what each of the optimizer's steps sees
        here = {id(p) for g in opt.param_groups for p in g["params"]}
        chunks.append(here)
        for p, st in opt.state.items():
            assert all((t.untyped_storage().size() > 0) == (id(p) in here)
                       for k, t in st.items() if k != "step")
    optimizers[1].register_step_pre_hook(seen)
    x = torch.randint(0, 40, (2, 9), device=device)
    for _ in range(3):
        for m, opt in zip(models, optimizers):
            m(x, targets=x[:, 1:]).sum().backward()
            opt.step()
            opt.zero_grad()
        assert away(optimizers[1])
    every = [id(p) for p in models[1].parameters()]
    per_step = len(chunks) // 3
    assert per_step > 3 and len(moments(optimizers[1])) == 2 * len(every)
    nbytes = {id(p): p.nbytes for p in models[1].parameters()}
    order = {i: n for n, i in enumerate(every)}
    for i in range(3):                                  # each parameter in one chunk of each step
        step = chunks[i * per_step:(i + 1) * per_step]
        assert sorted(p for c in step for p in c) == sorted(every)
        sizes = [sum(nbytes[p] for p in c) for c in step]    # packed: at most 4096 bytes a chunk
        assert all(s <= 4096 or len(c) == 1 for s, c in zip(sizes, step))    # (a bigger one alone)
        for a, b in zip(step, step[1:]):                # and full: the next one's first did not fit
            first = min(b, key=order.get)
            assert sum(nbytes[p] for p in a) + nbytes[first] > 4096
    assert same(models[0].parameters(), models[1].parameters())
    assert all(h.is_pinned() == (device == "cuda") for h in parked.host.values())
    with parked:
        state = optimizers[1].state_dict()
        assert same(moments(optimizers[0]), moments(optimizers[1]))
    assert away(optimizers[1])
    for opt in optimizers:                              # cleared (expert_iteration --restart)
        opt.state.clear()
    for m, opt in zip(models, optimizers):
        m(x, targets=x[:, 1:]).sum().backward()
        opt.step()
    assert same(models[0].parameters(), models[1].parameters())
    optimizers[0].load_state_dict(state)                # a resumed run's: away once parked
    parking.ParkedMoments(optimizers[0])
    assert away(optimizers[0])


def test_offloaded_moments_are_away_outside_the_step_and_a_resumed_run_moves_no_number(
        tiny_sft, tmp_path, monkeypatch):
    """grpo.py --offload_optimizer as on a GPU (here on the CPU): AdamW's moments are away whenever
    the sampler or a backward pass runs; stepped 4 kB of parameters at a time, a run of 2 steps
    (checkpointed with its moments) resumed to 4 logs what a plain run of 4 logs, line for line
    (times aside), and ends with its weights and moments bit for bit. On the CPU the flag moves
    nothing (Run.parked_moments)."""
    import contextlib
    import types

    import grpo
    from conftest import offloaded_runs
    cpu = types.SimpleNamespace(device="cpu", args=types.SimpleNamespace(offload_optimizer=True))
    assert isinstance(plumbing.Run.parked_moments(cpu, None), contextlib.nullcontext)
    argv = TINY_RL + ["--init", tiny_sft, "--device", "cpu"]
    parks = offloaded_runs(grpo, argv, tmp_path, monkeypatch, plain=["--steps", "4"],
                           offloaded=(["--steps", "2"], ["--steps", "4", "--resume"]))
    assert len(parks) == 2 and all(len(p.host) > 0 for p in parks)
    a, b = (torch.load(tmp_path / run / "grpo.pt", weights_only=False) for run in ("plain", "off"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


# A disk that fills up: from the n-th checkpoint written, torch.save's bytes go to /dev/full (the
# kernel's ENOSPC), its file made first as the real write would; with `lock`, the lock file's too.
FULL_DISK = """
import builtins, os, runpy, sys
import torch
saves, real_save, real_open = [], torch.save, os.open
def save(obj, f, *a, **k):
    name = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", "")
    if ".pt.tmp" in str(name):
        saves.append(name)
        if len(saves) >= {n} and isinstance(f, (str, os.PathLike)):
            open(f, "wb").close()
            return real_save(obj, "/dev/full")
        if len(saves) >= {n}:
            with open("/dev/full", "wb") as full:
                return real_save(obj, full)
    return real_save(obj, f, *a, **k)
def lock(path, flags, *a, **k):
    fd = real_open(path, flags, *a, **k)
    if {lock} and ".lock" in str(path):
        os.dup2(real_open("/dev/full", os.O_WRONLY), fd)
    return fd
def text(path, mode="r", *a, **k):
    if {lock} and ".lock" in str(path) and "w" in mode:
        builtin_open(path, mode).close()
        return builtin_open("/dev/full", mode)
    return builtin_open(path, mode, *a, **k)
builtin_open = builtins.open
torch.save, os.open, builtins.open = save, lock, text
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_a_full_disk_at_a_checkpoint_or_at_the_start_is_one_line_and_loses_nothing(tiny_sft,
                                                                                 tmp_path):
    out = tmp_path / "run"
    argv = ["grpo.py", *TINY_RL, "--init", tiny_sft, "--eval_every", "1", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", FULL_DISK.format(n=2, lock=False), *argv,
                        "--steps", "3"], cwd=ROOT, capture_output=True, text=True, env=env)
    ckpt = out / "grpo.pt"
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.strip() == (f"error: cannot write {ckpt} (No space left on device); {ckpt} "
                                f"is still step 1")
    assert load_checkpoint(str(ckpt))[1]["step"] == 1
    assert sorted(os.listdir(out)) == ["grpo", "grpo.pt"]            # no temporary file, no lock
    p = run_script("grpo.py", argv[1:] + ["--steps", "3", "--resume"])   # space again
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in open(out / "grpo" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    fresh = tmp_path / "fresh" / "deeper"
    p = subprocess.run([sys.executable, "-c", FULL_DISK.format(n=1, lock=True), *argv[:-1],
                        str(fresh), "--steps", "1"], cwd=ROOT, capture_output=True, text=True,
                       env=env)
    assert p.stderr.strip() == (f"error: cannot write to --out {fresh} (No space left on "
                                f"device)"), p.stderr[-2000:]
    assert not (tmp_path / "fresh").exists()                 # no folder, no lock


def test_resume_refuses_other_prompts_and_offloading_on_a_cpu_says_it_does_nothing(tiny_sft,
                                                                                  tmp_path):
    """--resume with another --task, --format or --chat than the checkpoint's is one line naming the
    flag and both values (the prompts would change midway); --offload_optimizer on a CPU says in one
    line that nothing moves."""
    out = str(tmp_path / "run")
    common = TINY_RL + ["--init", tiny_sft, "--out", out]
    p = run_script("grpo.py", common + ["--steps", "1", "--offload_optimizer"])
    assert p.returncode == 0, p.stderr[-2000:]
    assert ("note: --offload_optimizer parks AdamW's moments in host memory on CUDA only; on cpu "
            "nothing moves") in p.stdout
    for flags_, words in ((["--task", "countdown"], "--task countdown, but"),
                          (["--format", "r1"], "--format r1, but"),
                          (["--chat"], "--chat, but")):
        refused(run_script("grpo.py", common + ["--steps", "2", "--resume", *flags_]), words,
                "was trained with", "resume with", "without --resume")
    p = run_script("grpo.py", common + ["--steps", "2", "--resume"])
    assert p.returncode == 0, p.stderr[-2000:]


def test_a_checkpoint_is_on_disk_before_it_takes_its_name(tmp_path, monkeypatch):
    """fsync of the temporary file, then the rename: a crash between them cannot leave the name
    on a file the disk has not written."""
    from hf import checkpoint
    events, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(checkpoint.os, "fsync", lambda fd: (
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))), fsync(fd))[1])
    monkeypatch.setattr(checkpoint.os, "replace", lambda a, b: (
        events.append(("replace", os.path.abspath(a))), replace(a, b))[1])
    path = str(tmp_path / "x.pt")
    checkpoint.save_checkpoint(path, GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8)), "bytes")
    tmp = f"{path}.tmp{os.getpid()}"
    assert events == [("fsync", tmp), ("replace", tmp)] and os.path.exists(path)


def test_resume_refuses_other_tools_or_no_chat(tmp_path):
    """The flags as the checkpoint has them: a saved run with --chat --tools calculator, resumed
    with other tools or without --chat."""
    from types import SimpleNamespace
    run = plumbing.Run.__new__(plumbing.Run)
    run.ckpt_path = "out/agent.pt"
    saved = {"task": "toolcalc", "format": "plain", "chat": True, "tools": "calculator"}
    for changed, words in (({"tools": "specs:calculator"},
                            "error: --tools specs:calculator, but out/agent.pt was trained with "
                            "--tools calculator; resume with --tools calculator, or start afresh "
                            "without --resume"),
                           ({"chat": False, "tools": None}, "error: no --chat, but")):
        run.args = SimpleNamespace(**{**saved, **changed})
        with pytest.raises(SystemExit, match=words.replace("(", r"\(")):
            run._check_task_resume(saved)
    run.args = SimpleNamespace(**saved)
    run._check_task_resume(saved)
    for saved, changed, words in (     # every task that takes its own flags: its data, its rules
            ({"task": "gsm8k", "format": "plain", "data": ["a.jsonl"]}, {"data": ["b.jsonl"]},
             "error: --data b.jsonl, but out/agent.pt was trained with --data a.jsonl"),
            ({"task": "countdown", "format": "plain", "countdown_numbers": 3,
              "countdown_rule": "exactly"}, {"countdown_numbers": 4}, "--countdown_numbers 4, "),
            ({"task": "countdown", "format": "plain", "countdown_numbers": 3,
              "countdown_rule": "exactly"}, {"countdown_rule": "at_most"},
             "--countdown_rule at_most, ")):
        run.args = SimpleNamespace(**{**saved, **changed})
        with pytest.raises(SystemExit, match=words):
            run._check_task_resume(saved)


def test_a_cpu_run_takes_the_threads_other_work_leaves_free(monkeypatch):
    """Without OMP_NUM_THREADS: cores minus the cores busy with other work, rounded, at least 1, and
    the line naming it; with it set, nothing is chosen. busy_cores sees a busy process beside it."""
    cores = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert loading.pick_threads("cpu") is None and torch.get_num_threads() == before
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert loading.pick_threads("cuda") is None
        for busy, want in ((0.0, cores), (0.4, cores), (0.6, cores - 1), (cores - 0.4, 1),
                           (cores + 3.0, 1)):
            monkeypatch.setattr(loading, "busy_cores", lambda: busy)
            line = loading.pick_threads("cpu")
            assert torch.get_num_threads() == max(want, 1), (busy, line)
            assert line.startswith(f"{max(want, 1)} torch thread(s): {cores} cores, {busy:.1f}")
        monkeypatch.undo()
        spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.5)
            assert loading.busy_cores() >= 0.7           # more, never less, on a loaded machine
        finally:
            spin.kill()
            spin.wait()
    finally:
        torch.set_num_threads(before)


def test_the_threads_bench_runs_at_the_count_it_names(tiny_sft, monkeypatch):
    """bench/threads.py times each count it names, not the one the run would pick (cores + 1 is
    more than pick_threads ever gives), and leaves OMP_NUM_THREADS as it found it."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("threads_bench",
                                                  os.path.join(ROOT, "bench", "threads.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    want = len(os.sched_getaffinity(0)) + 1
    argv = ["--init", tiny_sft, "--steps", "3", "--prompts_per_step", "2", "--group_size", "2",
            "--log_every", "1", "--eval_every", "3", "--eval_n", "4"]
    with as_a_process():                         # threads and handlers put back after
        assert bench.seconds_a_step(argv, want) > 0
        assert torch.get_num_threads() == want and "OMP_NUM_THREADS" not in os.environ


def test_a_resumed_run_keeps_the_thread_count_it_chose(tmp_path, monkeypatch):
    """A run that chose 1 thread (a busy machine) resumes at 1 when the machine is idle, so that it
    continues bit for bit; its first line names the choice."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    flags = ["--init", os.path.join(ROOT, "tests", "fixtures", "tiny_sft.pt"), "--out",
             str(tmp_path), "--prompts_per_step", "2", "--group_size", "2", "--eval_n", "4"]
    monkeypatch.setattr(loading, "busy_cores", lambda: 64.0)
    p = run_script("grpo.py", flags + ["--steps", "1"])
    assert p.returncode == 0 and "1 torch thread(s)" in p.stdout.splitlines()[0], p.stdout
    monkeypatch.setattr(loading, "busy_cores", lambda: 0.0)
    p = run_script("grpo.py", flags + ["--steps", "2", "--resume"])
    assert p.returncode == 0 and "resuming from" in p.stdout, p.stderr
    assert "torch threads" not in p.stdout                    # no change of count to report
    assert load_checkpoint(str(tmp_path / "grpo.pt"))[1]["threads"] == 1
