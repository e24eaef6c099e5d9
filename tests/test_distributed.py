"""More than one process (torchrun, gloo on CPU): for fixed rollouts, one process with a batch of P
prompts and two processes with P/2 each in --grad_accum 2 micro-batches must make the same update:
the same weights after it, and the same loss and pre-clip gradient norm (both scale with the
normalisers, which AdamW's first step does not: a wrong token count would still give nearly the same
weights). Then a real torchrun run of grpo.py, and its resume."""
import argparse
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import task
from conftest import ROOT, as_a_process, task_args
from hf.checkpoint import load_checkpoint, save_checkpoint
from hf.tokenizer import Tokenizer
from model import GPT, GPTConfig

WORKER = os.path.join(ROOT, "tests", "ddp_worker.py")


DONE = object()                         # update((DONE, ...)): a run already waited for


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, nproc, env=None):
    """Start `args` as one process, or as nproc processes under torchrun: the Popen."""
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, **(env or {})}
    env["OMP_NUM_THREADS"] = "1"                     # two processes on two cores
    if nproc == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), *args]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def finished(p, timeout=300):
    """Wait for the Popen p: its CompletedProcess."""
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    return subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)


def start_update(script, flags, out, nproc=1, grad_accum=1):
    """Start one update step of `script` (or the case's own --steps, which comes after) on fixed
    rollouts, SGD in place of AdamW; update() reads it. Several run at once (a process importing
    torch leaves a core idle)."""
    os.makedirs(out)
    start = os.path.join(out, "start.pt")            # the starting weights, recorded by the worker
    # reward_model: --n_train = batch
    one_step = ["--epochs", "1"] if script == "reward_model" else ["--steps", "1"]
    # clipping out of the way (TRPO has none): a gradient wrong by a constant factor moves the
    # weights, not only the logged loss and norm
    no_clip = [] if script == "trpo" else ["--grad_clip", "1e9"]
    p = launch([WORKER, script, *one_step, *no_clip, *flags, "--log_every", "1",
                "--eval_every", "1", "--eval_n", "1", "--grad_accum", str(grad_accum),
                "--out", out], nproc,
               env={"DDP_WORKER_INIT": start})
    return p, script, out


def update(started):
    """The started update's result: (the change of every weight, the last step's logged metrics)."""
    p, script, out = started
    if p is not DONE:
        p = finished(p)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    name = "rm" if script == "reward_model" else script
    model, _ = load_checkpoint(os.path.join(out, f"{name}.pt"))
    rows = [json.loads(line) for line in open(os.path.join(out, name, "metrics.jsonl"))]
    start = torch.load(os.path.join(out, "start.pt"))
    return {k: p.detach() - p0 for (k, p), p0 in zip(model.named_parameters(), start)}, rows[-1]


def assert_same_update(a, b, keys):
    (da, ma), (db, mb) = a, b
    scale = max(d.abs().max().item() for d in da.values())
    assert scale > 0                                               # the step did update the weights
    for k in da:
        # atol: float32 rounding of w - w0
        worst = ((db[k] - da[k]).abs() / (1e-4 * da[k].abs() + 1e-4 * scale)).max().item()
        torch.testing.assert_close(db[k], da[k], rtol=1e-4, atol=1e-4 * scale,
                                   msg=f"{k}: off by {worst:.2f} x the tolerance "
                                       f"(scale {scale:.3g})")
    for k in keys:
        assert mb[k] == pytest.approx(ma[k], rel=1e-5, abs=1e-7), (k, ma[k], mb[k])


# Every micro-batch of every rank carries gradient: all prompts are precedence problems
# (--precedence_share 1), on which the fixed rollouts' left-to-right completions are wrong, so every
# group has a reward spread (no group with all advantages 0, which would hide a micro-batch whose
# gradient is counted twice).
RL = ["--prompts_per_step", "4", "--group_size", "4", "--precedence_share", "1"]
CASES = {
    "sft": ("sft", ["--batch_size", "8", "--n_layer", "1", "--n_head", "2", "--n_embd", "32"],
            ["loss", "grad_norm"]),
    "grpo seq": ("grpo", RL + ["--loss_agg", "seq", "--mu", "2"],
                 ["loss", "grad_norm", "kl_exact", "reward_mean"]),
    "grpo token": ("grpo", RL + ["--loss_agg", "token", "--mu", "2"],
                   ["loss", "grad_norm", "kl_exact"]),
    "grpo dr_grpo": ("grpo", RL + ["--loss_agg", "dr_grpo", "--mu", "2"],
                     ["loss", "grad_norm", "kl_exact"]),
    "reinforce++": ("reinforce", RL + ["--baseline", "reinforce_pp"],
                    ["loss", "grad_norm", "kl_exact"]),
    "ppo": ("ppo", ["--reward", "verifier", "--minibatches", "1", "--ppo_epochs", "2",
                    "--batch_size", "8"],
            # the value loss: every row has gradient
            ["pg_loss", "vf_loss", "approx_kl", "gold_accuracy", "kl"]),
    # DPO, IPO, ORPO, online DPO, SimPO: at their default lr, warmed up, the first update is below
    # what float32 resolves in the weights (1e-7 of weights near 0.1); SGD's lr 0.1 at once
    "dpo": ("dpo", ["--batch_size", "8", "--n_pairs", "64", "--lr", "0.1", "--warmup", "0"],
            ["loss", "grad_norm", "reward_margin"]),
    "ipo": ("ipo", ["--batch_size", "8", "--n_pairs", "64", "--lr", "0.1", "--warmup", "0"],
            ["loss", "grad_norm", "reward_margin"]),
    "rloo": ("rloo", RL, ["loss", "grad_norm", "kl_exact", "reward_mean"]),
    # multiturn.py on the worker's planned games (four kinds a group: every group has a spread)
    "multiturn gigpo": ("multiturn", ["--prompts_per_step", "4", "--group_size", "4", "--credit",
                                      "gigpo"], ["loss", "grad_norm", "kl_exact", "found"]),
    "reward_model": ("reward_model", ["--batch_size", "8", "--n_train", "8"],
                     ["loss", "grad_norm", "train_margin"]),
    "simpo": ("simpo", ["--batch_size", "8", "--n_pairs", "64", "--lr", "0.1", "--warmup", "0"],
              ["loss", "grad_norm", "reward_margin"]),
    "orpo": ("orpo", ["--batch_size", "8", "--n_pairs", "64", "--lr", "0.1", "--warmup", "0"],
             ["loss", "grad_norm", "reward_margin", "nll"]),
    # KTO: two steps, the second from weights that have moved (lr 0.3), where the KL estimate behind
    # z0, the mean log-ratio of the mismatched pairs (prompt k, completion k+1 of the whole step's
    # batch), is not 0
    "kto": ("kto", ["--batch_size", "8", "--n_examples", "64", "--steps", "2", "--lr", "0.3",
                    "--warmup", "0"],
            ["loss", "grad_norm", "kl_estimate", "z0", "desirable_reward"]),
    # online DPO: three fixed samples per precedence prompt, one of them the left-to-right path
    # (wrong, mostly)
    "online_dpo": ("online_dpo", ["--batch_size", "8", "--group_size", "3",
                                  "--precedence_share", "1", "--lr", "0.1", "--warmup", "0"],
                   ["loss", "grad_norm", "reward_margin", "informative"]),
    # distill: the teacher is tiny_sft with its weights moved (moved_teacher), so that every token's
    # KL has a gradient
    "distill exact": ("distill", RL + ["--teacher", "TEACHER", "--reward_weight", "1"],
                      ["loss", "grad_norm", "kl_exact", "kl_forward", "reward_mean",
                       "teacher_reward"]),
    "distill topk": ("distill", RL + ["--teacher", "TEACHER", "--estimator", "topk", "--topk", "4"],
                     ["loss", "grad_norm", "kl_exact", "kl_forward"]),
    # self-distillation: the teacher is the same weights with the verified answer in its prompts
    "self_distill": ("self_distill", RL, ["loss", "grad_norm", "kl_forward", "reward_mean",
                                          "teacher_reward"]),
    # TRPO: the gradient, every Fisher-vector product and the line search's KL and gain are sums of
    # the ranks' shares
    "trpo": ("trpo", RL + ["--cg_iters", "4", "--beta", "0.3"],
             ["grad_norm", "step_norm", "kl_step", "kl_full_step", "improvement", "kl_exact"]),
    # expert iteration (--steps 1 is --rounds 1): 8 prompts, each with an accepted sample (the fixed
    # completions), two fine-tuning steps of 4; every rank fine-tunes on its share of the same
    # gathered data
    "expert_iteration": ("expert_iteration",
                         ["--prompts_per_round", "8", "--samples_per_prompt", "4",
                          "--batch_size", "4", "--epochs", "1", "--precedence_share", "1"],
                         ["loss", "grad_norm", "data_size", "reward_mean"]),
    # ORM and PRM (ddp_worker: "orm" is prm.py --train orm; --steps is dropped): two steps of 8
    # completions, each with at least one read position and label
    "orm": ("orm", ["--n_prompts", "8", "--samples_per_prompt", "2", "--batch_size", "8",
                    "--epochs", "1"],
            ["loss", "grad_norm", "train_accuracy"]),
    "prm": ("prm", ["--train", "prm", "--n_prompts", "8", "--samples_per_prompt", "2",
                    "--batch_size", "8", "--epochs", "1"],
            ["loss", "grad_norm", "train_accuracy"]),
}


@pytest.fixture(scope="module")
def moved_teacher(tiny_sft, tmp_path_factory):
    """tiny_sft with noise added to every weight: a teacher the student (tiny_sft itself) differs
    from."""
    model, ckpt = load_checkpoint(tiny_sft)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    path = str(tmp_path_factory.mktemp("moved_teacher") / "teacher.pt")
    save_checkpoint(path, model, ckpt["tokenizer"])
    return path


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.slow
def test_two_processes_and_grad_accum_make_the_same_update_as_one_process(case, tiny_sft, tmp_path,
                                                                          request):
    """1 process, and 2 processes x 2 micro-batches: the same update (a normaliser per micro-batch
    or per process, or an all-reduce before the last micro-batch, which counts the first twice,
    would differ). For sft and grpo also 1 process x 2 micro-batches, so that a difference there
    points at the micro-batches rather than the processes (each script's normalisers go through the
    same run.all_sum and run.micro_batches)."""
    script, flags, keys = CASES[case]
    if "TEACHER" in flags:
        flags = [request.getfixturevalue("moved_teacher") if f == "TEACHER" else f for f in flags]
    flags = flags + (["--init", tiny_sft] if script != "sft" else [])
    runs = [start_update(script, flags, str(tmp_path / "one")),
            start_update(script, flags, str(tmp_path / "two_accum"), nproc=2, grad_accum=2)]
    if case in ("sft", "grpo seq"):
        runs.append(start_update(script, flags, str(tmp_path / "accum"), grad_accum=2))
    if case in FSDP_TOO:                                # and --fsdp: DDP's weights within 1e-5
        runs.append(start_update(script, flags + ["--fsdp"], str(tmp_path / "fsdp"), nproc=2,
                                 grad_accum=2))
    one, *others = [update(r) for r in runs]
    for other in others:
        assert_same_update(one, other, keys)
    if case in FSDP_TOO:
        ddp, fsdp = (load_checkpoint(os.path.join(r[2], f"{script}.pt"))[1]["model"]
                     for r in (runs[1], runs[-1]))
        for k in ddp:
            torch.testing.assert_close(fsdp[k], ddp[k], rtol=0, atol=1e-5, msg=k)
    if script == "kto":                                 # the mismatched pairs' estimate is compared
        assert abs(one[1]["kl_estimate"]) > 1e-3 and one[1]["z0"] == max(0.0, one[1]["kl_estimate"])
    if script == "online_dpo":
        # 6 of 8 informative: 9-9*1 and 5-3*1 tie (left to right gives the right answer too); 3 on
        # each rank, so every micro-batch of every rank carries gradient, and the dropped ties leave
        # the normaliser global
        assert one[1]["informative"] == 0.75 and one[1]["ties"] == 2


@pytest.fixture(scope="module")
def tool_init(tmp_path_factory):
    """A random policy for the tool task (agent.py's planned episodes need no skill)."""
    task.use(task_args("toolcalc"))
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("tool_init") / "init.pt")
    tok = Tokenizer()
    save_checkpoint(path, GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=96, n_layer=2,
                                        n_head=2, n_embd=32)), tok.name)
    task.use(task_args())
    return path


# --fsdp against DDP, both on 2 processes x 2 micro-batches: above, for sft, ppo (two models in one
# optimizer) and dpo; here grpo over two steps of two passes with the clip acting (the second
# step's rollouts scored by the whole copy, refreshed from the shards), grpo's LoRA adapters and the
# agent
FSDP_TOO = ("sft", "ppo", "dpo")
FSDP_CASES = {
    "grpo": ("grpo", RL + ["--mu", "2", "--steps", "2"], ["loss", "grad_norm", "kl_exact",
                                                          "approx_kl", "clip_frac"]),
    "grpo --lora_rank 2": ("grpo", RL + ["--lora_rank", "2"],
                           ["loss", "grad_norm", "kl_exact"]),
    "agent": ("agent", ["--steps", "2", "--mu", "2", "--prompts_per_step", "4", "--group_size", "4",
                        "--precedence_share", "0.5", "--max_new_tokens", "34", "--init", "TOOL"],
              ["loss", "grad_norm", "kl_exact", "reward_mean"]),
    "multiturn": ("multiturn", ["--steps", "2", "--prompts_per_step", "4", "--group_size", "4",
                                "--credit", "returns"], ["loss", "grad_norm", "kl_exact", "found"]),
}


@pytest.mark.parametrize("case", list(FSDP_CASES))
@pytest.mark.slow
def test_fsdp_makes_the_same_update_as_ddp(case, tiny_sft, tmp_path, request):
    """2 processes with --fsdp (FSDP2 shards, summed reduce-scatters, the global-norm clip, the
    whole state gathered into the checkpoint) and 2 with DDP: the same weights after the update
    (within 1e-5) and the same logged metrics. A block left out of the shards would train on rank
    0's gradient alone, and a reduce-scatter that averages would halve the step."""
    script, flags, keys = FSDP_CASES[case]
    flags = [request.getfixturevalue("tool_init") if f == "TOOL" else f for f in flags]
    flags = flags + (["--init", tiny_sft] if script not in ("sft", "agent") else [])
    if script != "sft":
        flags += ["--grad_clip", "0.5"]             # the clip acts: its norm must be the whole one
    runs = [start_update(script, flags, str(tmp_path / "ddp"), nproc=2, grad_accum=2),
            start_update(script, flags + ["--fsdp"], str(tmp_path / "fsdp"), nproc=2,
                         grad_accum=2)]
    for p, _, _ in runs:
        p = finished(p)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (wa, ma), (wb, mb) = [(load_checkpoint(os.path.join(out, f"{script}.pt"))[1]["model"],
                           [json.loads(line) for line in
                            open(os.path.join(out, script, "metrics.jsonl"))][-1])
                          for _, _, out in runs]
    if "--lora_rank" in flags:                                   # B starts at 0
        moved = max(v.abs().max().item() for k, v in wa.items() if "lora_B" in k)
        assert moved > 1e-3
    else:                               # the updates relative to their size (sft's are 2e-5)
        assert_same_update(*[update((DONE, script, out)) for _, _, out in runs], keys)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=1e-5, msg=k)
    for k in keys:
        assert mb[k] == pytest.approx(ma[k], rel=1e-5, abs=1e-7), (k, ma[k], mb[k])


def test_fsdp_shards_every_block_then_the_root_and_sums_the_gradients():
    """In a group of one: every block its own FSDP unit, then the root; every parameter of the twin
    sharded (a DTensor), none of the whole model's; the twin's gradient summed (divide factor 1);
    the whole copy follows the optimizer, and whole_state is the copy's state in float32."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from plumbing.distributed import Distributed
    from model import Block

    with as_a_process():                                  # a process of a group of one
        run = Distributed()
        run.args, run.device = argparse.Namespace(fsdp=True, grad_accum=1), "cpu"
        run.processes()
        run.join()
        try:
            torch.manual_seed(0)
            model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=16))
            before = {k: v.clone() for k, v in model.state_dict().items()}
            twin = run.ddp(model)
            blocks = [m for m in twin.modules() if isinstance(m, Block)]
            assert len(blocks) == 3 and all(isinstance(b, FSDPModule) for b in blocks)
            assert isinstance(twin, FSDPModule)
            assert all(isinstance(p, DTensor) for p in twin.parameters())
            assert not any(isinstance(p, DTensor) for p in model.parameters())
            optimizer = torch.optim.SGD(twin.parameters(), lr=1.0)
            run.follow(optimizer)
            idx = torch.randint(0, 64, (2, 8))
            twin(idx, targets=idx[:, 1:]).sum().backward()
            grad = {k: p.grad.full_tensor().clone() for k, p in twin.named_parameters()}
            reference = GPT(model.config)
            reference.load_state_dict(before)
            reference(idx, targets=idx[:, 1:]).sum().backward()
            for k, p in reference.named_parameters():          # the sum over the one rank: itself
                torch.testing.assert_close(grad[k], p.grad, rtol=1e-5, atol=1e-6, msg=k)
            optimizer.step()
            state = run.whole_state(model)
            for k, v in model.state_dict().items():            # the copy moved with the shards
                torch.testing.assert_close(v, before[k] - dict(reference.named_parameters()).get(
                    k, reference.lm_head.weight).grad, msg=k)
                assert torch.equal(state[k], v)
        finally:
            run.leave()


@pytest.mark.slow
def test_a_nan_loss_on_one_rank_stops_every_rank(tiny_sft, tmp_path):
    """Rank 1 alone sees a NaN loss: both ranks stop at once with one message (a rank that left
    alone would leave the other waiting in the next all-reduce until the backend's timeout, here the
    test's)."""
    p = finished(launch([WORKER, "grpo", *RL, "--steps", "2", "--init", tiny_sft,
                         "--out", str(tmp_path)], nproc=2, env={"DDP_WORKER_NAN_RANK": "1"}),
                 timeout=120)
    assert p.returncode != 0
    assert p.stderr.count("the loss is not finite on rank 1 of 2 at "
                          "step 1") == 1, p.stderr[-3000:]                          # rank 0 says it


@pytest.mark.slow
def test_torchrun_grpo_writes_from_rank_0_and_resumes(tiny_sft, tmp_path):
    out = str(tmp_path)
    flags = ["grpo.py", "--prompts_per_step", "4", "--group_size", "2", "--log_every", "1",
             "--eval_every", "2", "--eval_n", "8", "--init", tiny_sft, "--out", out]
    p = finished(launch(flags + ["--steps", "2"], nproc=2))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("done: 2 steps") == 1                       # rank 0 alone reports
    rows = [json.loads(line) for line in open(os.path.join(out, "grpo", "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["samples"] == 2 * 4 * 2
    _, ckpt = load_checkpoint(os.path.join(out, "grpo.pt"))
    # every rank's sampling stream is kept
    assert ckpt["step"] == 2 and len(ckpt["generators"]) == 2
    assert not torch.equal(ckpt["generators"][0], ckpt["generators"][1])
    p = finished(launch(flags + ["--steps", "3", "--resume"], nproc=2))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "resuming from" in p.stdout
    assert [json.loads(line)["step"]
            for line in open(os.path.join(out, "grpo", "metrics.jsonl"))] == [0, 1, 2, 3]
    assert load_checkpoint(os.path.join(out, "grpo.pt"))[1]["step"] == 3


@pytest.mark.slow
def test_an_fsdp_checkpoint_is_one_processs_and_resumes_on_another_number_of_processes(
        tiny_sft, tmp_path):
    """torchrun --fsdp on 2 processes writes what one process writes (whole tensors, the optimizer
    state by index), resumes in one process without --fsdp, and that one's checkpoint resumes on
    2 processes with --fsdp again."""
    out = str(tmp_path)
    flags = ["grpo.py", "--prompts_per_step", "4", "--group_size", "2", "--log_every", "1",
             "--eval_every", "2", "--eval_n", "4", "--init", tiny_sft, "--out", out]
    p = finished(launch(flags + ["--steps", "2", "--fsdp"], nproc=2))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    model, ckpt = load_checkpoint(os.path.join(out, "grpo.pt"))
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    assert {k: v.shape for k, v in ckpt["model"].items()} == shapes
    moments = ckpt["optimizer"]["state"]
    assert [moments[i]["exp_avg"].shape for i in range(len(moments))] == \
        [p.shape for p in model.parameters()]
    p = finished(launch(flags + ["--steps", "3", "--resume"], nproc=1))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "resuming from" in p.stdout and "written by 2 process(es)" in p.stdout
    p = finished(launch(flags + ["--steps", "4", "--resume", "--fsdp"], nproc=2))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert [json.loads(line)["step"]
            for line in open(os.path.join(out, "grpo", "metrics.jsonl"))] == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_a_resumed_fsdp_run_takes_the_uninterrupted_runs_next_step(tiny_sft, tmp_path):
    """Its weights and its loss, not only its step count: 2 steps and a resume to 3 on 2 processes
    with --fsdp equal 3 steps in one go, metrics.jsonl (times aside) and every tensor. Groups of 8
    at a high learning rate, so that the steps move the weights (at --group_size 2 every group
    ties: loss and gradient 0, and a twin left at --init would pass)."""
    flags = lambda out: ["grpo.py", "--prompts_per_step", "4", "--group_size", "8", "--lr", "3e-3",
                         "--log_every", "1", "--eval_every", "2", "--eval_n", "4", "--init",
                         tiny_sft, "--out", out, "--fsdp"]
    cut, whole = str(tmp_path / "cut"), str(tmp_path / "whole")
    for p in [finished(q) for q in (launch(flags(cut) + ["--steps", "2"], nproc=2),
                                    launch(flags(whole) + ["--steps", "3"], nproc=2))]:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    p = finished(launch(flags(cut) + ["--steps", "3", "--resume"], nproc=2))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # times aside, and the sampled pass@1 of the cut run's last step (2) that the whole run's
    # step 2 has not (evaluation.py: at the first and the last step)
    rows = lambda out: [{k: v for k, v in json.loads(line).items()
                         if k not in ("elapsed_s", "tokens_per_sec", "eval_pass_at_1")}
                        for line in open(os.path.join(out, "grpo", "metrics.jsonl"))]
    assert rows(cut) == rows(whole) and [r["step"] for r in rows(cut)] == [0, 1, 2, 3]
    assert all(r["grad_norm"] > 0 and r["loss"] != 0 for r in rows(cut)[1:]), rows(cut)
    a, b = (load_checkpoint(os.path.join(out, "grpo.pt"))[1] for out in (cut, whole))
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    start = load_checkpoint(tiny_sft)[1]["model"]
    assert not all(torch.equal(a["model"][k], start[k]) for k in start)    # the steps moved it


@pytest.mark.slow
def test_two_machines_are_two_torchrun_launches_and_make_one_machines_run(tiny_sft, tmp_path):
    """Two torchrun launches as two nodes of one process each (--nnodes 2, --node_rank, a localhost
    rendezvous), with --fsdp: the same metrics as 2 processes on one node."""
    flags = ["grpo.py", "--fsdp", "--steps", "2", "--prompts_per_step", "4", "--group_size", "2",
             "--log_every", "1", "--eval_n", "4", "--init", tiny_sft]
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
           "OMP_NUM_THREADS": "1"}
    port = str(free_port())
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                               "--nproc_per_node", "1", "--node_rank", str(rank), "--master_addr",
                               "127.0.0.1", "--master_port", port, *flags, "--out",
                               str(tmp_path / "nodes")], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for rank in (0, 1)]
    one = launch(flags + ["--out", str(tmp_path / "one")], nproc=2)
    for p in [*nodes, one]:
        p = finished(p)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    timing = ("elapsed_s", "tokens_per_sec")
    rows = [[{k: v for k, v in json.loads(line).items() if k not in timing}
             for line in open(tmp_path / out / "grpo" / "metrics.jsonl")]
            for out in ("nodes", "one")]
    assert len(rows[0]) == 3 and rows[0] == rows[1]


@pytest.mark.slow
def test_fsdp_with_what_it_cannot_serve_is_one_line_before_anything_is_written(tiny_sft, tmp_path):
    for argv, words in ((["trpo.py", "--fsdp"], "--fsdp: trpo.py cannot shard"),
                        (["grpo.py", "--fsdp", "--offload_optimizer"],
                         "--fsdp with --offload_optimizer")):
        out = str(tmp_path / "out")
        p = finished(launch(argv + ["--init", tiny_sft, "--out", out], nproc=1))
        assert p.returncode != 0 and words in p.stderr and p.stderr.count("\n") == 1, p.stderr
        assert not os.path.exists(out)


@pytest.mark.slow
def test_a_batch_that_does_not_split_over_the_processes_is_refused(tiny_sft, tmp_path):
    p = finished(launch(["grpo.py", "--prompts_per_step", "3", "--init", tiny_sft,
                         "--out", str(tmp_path)], nproc=2))
    assert (p.returncode != 0
            and "--prompts_per_step 3 must split evenly over 2 processes" in p.stdout + p.stderr)


@pytest.mark.parametrize("engine", [[], ["--fsdp"]], ids=["ddp", "fsdp"])
@pytest.mark.slow
def test_a_killed_rank_stops_the_others_with_one_line_naming_the_checkpoint(engine, tiny_sft,
                                                                             tmp_path):
    """kill -9 of rank 1 mid-run: rank 0 stops within seconds with one line naming the last
    checkpoint (intact) and the resume command, no backend traceback, the lock released."""
    import re
    import signal
    import time
    out = str(tmp_path)
    p = launch(["grpo.py", "--prompts_per_step", "4", "--group_size", "2", "--eval_every", "1",
                "--eval_n", "4", "--steps", "500", "--init", tiny_sft, "--out", out, *engine],
               nproc=2)
    ckpt, started = os.path.join(out, "grpo.pt"), time.time()
    while not os.path.exists(ckpt) and time.time() - started < 120 and p.poll() is None:
        time.sleep(0.1)
    time.sleep(1.0)
    ranks = {}
    for pid in open(f"/proc/{p.pid}/task/{p.pid}/children").read().split():
        environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        ranks[next(e for e in environ if e.startswith(b"RANK="))] = int(pid)
    os.kill(ranks[b"RANK=1"], signal.SIGKILL)
    p = finished(p, timeout=60)          # a rank left waiting would hang until the backend's 30 min
    assert p.returncode != 0
    line = re.search(r"error: another process of this run stopped; the last checkpoint is (\S+) "
                     r"\(step (\d+)\); continue with: torchrun --standalone --nproc_per_node 2 "
                     r"grpo.py .*--resume\n", p.stderr)
    assert line and line.group(1) == ckpt, p.stderr[-3000:]
    assert "pair.cc" not in p.stderr and "[rank0]" not in p.stderr, p.stderr[-3000:]
    assert load_checkpoint(ckpt)[1]["step"] == int(line.group(2))
    assert not os.path.exists(os.path.join(out, "grpo.lock"))
