"""lora.py: the adapter against y = W x + (alpha / r) B A x written here in float64 (forward and
gradient, fused projections part by part), the exact start, what trains, the reference that shares
the weights, merged and unmerged sampling, checkpoints; the flags through the scripts (refusals, a
resumed run). grpo.py's exact update with --lora_rank is in tests/test_updates.py."""
import math
import os

import pytest
import torch

from conftest import refuses_all, run_script
from hf.checkpoint import load_checkpoint, save_checkpoint
from lora import LoRALinear, adapters, add_adapters, base_model, merge, projections, trainable
from model import GPT, GPTConfig
from sampler import generate

LLAMA = dict(vocab_size=50, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, pos="rope",
             norm="rmsnorm", mlp="swiglu", mlp_hidden=48, bias=False, qkv_bias=True,
             tie_embeddings=False, dropout=0.0)
GPT2 = dict(vocab_size=50, block_size=32, n_layer=2, n_head=4, n_embd=32, dropout=0.0)
# sft.py --pos rope (the tool task's default): rotary, a GELU MLP
ROPE_GELU = {**GPT2, "pos": "rope"}


def tiny(config, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**config)).eval()


def randomize_b(model, seed=1):
    """Non-zero B everywhere (B = 0 at the start would hide a wrong B A product)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                for b in m.lora_B.values():
                    b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    return model


# -----------------------------------------------------------------------------
# The adapter: forward and gradient in float64, part by part

@pytest.mark.parametrize("adapted", [("q", "k", "v"), ("q", "v"), ("k",)])
def test_a_fused_projection_adds_each_parts_own_b_a_forward_and_gradient(adapted):
    torch.manual_seed(0)
    base = torch.nn.Linear(6, 4 + 2 + 2, bias=True).double()
    layer = LoRALinear(base, (4, 2, 2), ("q", "k", "v"), set(adapted), rank=3, alpha=5.0).double()
    randomize_b(layer)
    x = torch.randn(2, 3, 6, dtype=torch.float64)
    g = torch.randn(2, 3, 8, dtype=torch.float64)                    # dL/dy of L = sum(y * g)
    y = layer(x)
    (y * g).sum().backward()
    W, b, s = base.weight.detach(), base.bias.detach(), 5.0 / 3
    rows = {"q": slice(0, 4), "k": slice(4, 6), "v": slice(6, 8)}
    want = x @ W.T + b                                     # W x + bias
    for n in adapted:
        A, B = layer.lora_A[n].detach(), layer.lora_B[n].detach()
        want[..., rows[n]] += s * (x @ A.T) @ B.T          # + (alpha / r) B A x on this part's rows
        gn = g[..., rows[n]].reshape(-1, rows[n].stop - rows[n].start)   # (N, out_n)
        xn = x.reshape(-1, 6)                                             # (N, in)
        # dL/dB = s g (A x)^T
        assert torch.allclose(layer.lora_B[n].grad, s * gn.T @ (xn @ A.T), atol=1e-12)
        # dL/dA = s B^T g x^T
        assert torch.allclose(layer.lora_A[n].grad, s * B.T @ gn.T @ xn, atol=1e-12)
    assert torch.allclose(y, want, atol=1e-12)
    assert (sorted(layer.lora_A) == sorted(adapted) and base.weight.grad is None
            and base.bias.grad is None)
    delta = torch.zeros(8, 6, dtype=torch.float64)      # (alpha / r) B A on the adapted parts' rows
    for n in adapted:
        delta[rows[n]] = s * layer.lora_B[n].detach() @ layer.lora_A[n].detach()
    assert torch.allclose(layer.delta_weight().double(), delta, atol=1e-6)   # merge's, in float32


def test_initialisation_is_pefts_and_the_adapted_model_starts_exactly_where_it_was():
    for config in (LLAMA, GPT2):
        model = tiny(config)
        idx = torch.randint(0, 50, (2, 9))
        before = model(idx).detach()
        add_adapters(model, rank=4, alpha=8.0)
        assert torch.equal(model(idx).detach(), before)              # B = 0: not close, equal
        for m in model.modules():
            if isinstance(m, LoRALinear):
                # kaiming_uniform(a = sqrt 5): U(-1/sqrt in, .)
                bound = 1 / math.sqrt(m.base.in_features)
                for a in m.lora_A.values():
                    assert (a.abs().max() <= bound and a.abs().max() > 0.8 * bound
                            and a.shape[0] == 4)
                assert all((b == 0).all() for b in m.lora_B.values())


def test_targets_sit_on_the_projections_they_name():
    model = add_adapters(tiny(LLAMA), rank=2, alpha=2.0, targets=["q", "v", "down"])
    c = model.config
    attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
    assert attn.c_attn.names == ["q", "k", "v"] and attn.c_attn.adapted == ["q", "v"]
    assert attn.c_attn.lora_B["q"].shape == (c.n_head * c.head_size, 2)
    assert attn.c_attn.lora_B["v"].shape == (c.kv_heads * c.head_size, 2)
    assert not isinstance(attn.c_proj, LoRALinear) and not isinstance(mlp.c_fc, LoRALinear)
    assert (mlp.c_proj.adapted == ["down"]
            and mlp.c_proj.lora_A["down"].shape == (2, LLAMA["mlp_hidden"]))
    assert len(adapters(model)) == 2 * 3 * c.n_layer                # (A, B) x (q, v, down) x layers
    gpt2 = add_adapters(tiny(GPT2), rank=2, alpha=2.0)
    assert sorted(projections(gpt2)) == ["down", "o", "qkv", "up"] and gpt2.lora["targets"] == [
        "qkv", "o", "up", "down"]
    assert (isinstance(gpt2.blocks[1].mlp[0], LoRALinear)
            and isinstance(gpt2.blocks[1].mlp[2], LoRALinear))
    # the targets are what the model has: no gate
    rope = add_adapters(tiny(ROPE_GELU), rank=2, alpha=2.0)
    assert rope.lora["targets"] == ["q", "k", "v", "o", "up", "down"]
    assert (rope.blocks[0].attn.c_attn.adapted == ["q", "k", "v"]
            and rope.blocks[0].mlp[0].adapted == ["up"])


@pytest.mark.parametrize("config, targets, rank, words", [
    (GPT2, ["q"], 2, ["'q'", "qkv, o, up, down"]),        # a Llama name on GPT-2's fused projection
    (LLAMA, ["qkv"], 2, ["'qkv'", "q, k, v, o, gate, up, down"]),
    (GPT2, None, 33, ["--lora_rank 33", "1 to 32"]),      # past the narrowest projection (width 32)
    (GPT2, None, 0, ["--lora_rank 0", "1 to 32"]),
    (ROPE_GELU, ["gate"], 2, ["'gate'", "q, k, v, o, up, down"]),   # rotary positions, no gated MLP
    # --lora_targets , (not: every projection)
    (GPT2, [], 2, ["--lora_targets is empty", "qkv, o, up, down"]),
])
def test_a_target_or_rank_the_model_cannot_have_is_refused(config, targets, rank, words):
    with pytest.raises(ValueError) as e:
        add_adapters(tiny(config), rank=rank, alpha=1.0, targets=targets)
    assert all(w in str(e.value) for w in words), str(e.value)


# -----------------------------------------------------------------------------
# What trains, the reference, merging

def test_only_the_adapters_train_and_the_reference_is_the_base_sharing_its_weights():
    model = add_adapters(tiny(LLAMA), rank=4, alpha=8.0)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    ref = base_model(model)
    assert {id(p) for p in trainable(model)} == {id(p) for p in adapters(model)}
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    n_adapters = sum(p.numel() for p in adapters(model))
    # the base: no adapters
    assert sum(p.numel() for p in ref.parameters()) == model.num_params() - n_adapters
    shared = {p.data_ptr() for p in model.parameters()}
    assert all(p.data_ptr() in shared for p in ref.parameters())     # no second copy
    idx = torch.randint(0, 50, (3, 10))
    start = ref(idx).detach()
    opt = torch.optim.AdamW(trainable(model), lr=1e-2)
    for _ in range(3):
        loss = model(idx).logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert torch.equal(ref(idx), start)                               # the reference did not move
    assert not torch.allclose(model(idx), start, atol=1e-4)           # the policy did
    assert (getattr(ref, "lora", None) is None
            and not any(isinstance(m, LoRALinear) for m in ref.modules()))


def test_merged_and_unmerged_weights_sample_the_same_tokens_in_float32():
    model = randomize_b(add_adapters(tiny(LLAMA), rank=4, alpha=16.0))
    merged = merge(model)
    idx = torch.randint(0, 50, (4, 8))
    mask = torch.ones_like(idx, dtype=torch.float32)
    mask[0, :3] = 0                                                   # left padding
    assert torch.allclose(merged(idx, mask), model(idx, mask), atol=1e-5)
    # B A is in it
    assert not torch.allclose(merged(idx, mask), base_model(model)(idx, mask), atol=1e-2)
    for T in (0.0, 1.5):
        a = generate(model, idx, mask, 12, eos_id=[0, 1], num_samples=3, temperature=T,
                     generator=torch.Generator().manual_seed(3), mode="eager")
        b = generate(merged, idx, mask, 12, eos_id=[0, 1], num_samples=3, temperature=T,
                     generator=torch.Generator().manual_seed(3), mode="eager")
        assert all(torch.equal(x, y) for x, y in zip(a, b)), T
    assert (all(p.requires_grad for p in merged.parameters())
            and getattr(merged, "lora", None) is None)
    W = model.blocks[1].attn.c_attn
    q = LLAMA["n_head"] * 8                             # q's rows of the fused c_attn (head size 8)
    assert torch.allclose(merged.blocks[1].attn.c_attn.weight[:q], W.base.weight[:q]
                          + 4.0 * W.lora_B["q"] @ W.lora_A["q"], atol=1e-6)     # alpha / r = 16 / 4


def test_a_lora_checkpoint_keeps_its_adapters_and_loads_merged(tmp_path):
    model = randomize_b(add_adapters(tiny(GPT2), rank=3, alpha=6.0, targets=["qkv", "down"]))
    path = str(tmp_path / "m.pt")
    save_checkpoint(path, model, "gpt2-bytes", step=5)
    loaded, ckpt = load_checkpoint(path)
    assert ckpt["lora"] == {"rank": 3, "alpha": 6.0, "targets": ["qkv", "down"]}
    assert sum("lora_A" in k for k in ckpt["model"]) == 2 * 2          # (qkv, down) x layers
    assert torch.equal(ckpt["model"]["blocks.0.attn.c_attn.lora_B.qkv"],
                       model.blocks[0].attn.c_attn.lora_B["qkv"])
    reference = merge(model)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(),
                                                 reference.state_dict().values()))
    assert not any(isinstance(m, LoRALinear) for m in loaded.modules())


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_compact_base_holds_half_its_bytes_and_moves_no_number(device, tmp_path):
    """lora.compact (a LoRA run on a GPU): frozen weights equal to their bfloat16 rounding (a
    bfloat16 checkpoint's) are kept in bfloat16. Under bfloat16 autocast and without it, the logits
    and the adapters' gradients are the float32 base's bit for bit; so are the merged weights
    (float32), a saved and loaded checkpoint and the sampler's bfloat16 copy. A base that bfloat16
    would round is left as it is (the control)."""
    import copy

    import sampler
    from lora import compact
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA here")
    model = tiny(LLAMA)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())                          # a bfloat16 checkpoint's numbers
    full = randomize_b(add_adapters(model, rank=4, alpha=16.0)).to(device)
    small = copy.deepcopy(full)
    assert compact(small)
    bases = [m.base.weight for m in small.modules() if isinstance(m, LoRALinear)]
    assert len(bases) == 4 * 2 and all(w.dtype == torch.bfloat16 for w in bases)
    nbytes = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())
    assert nbytes(small) == nbytes(full) - sum(2 * w.numel() for w in bases)
    idx = torch.randint(0, 50, (3, 9), device=device)
    mask = torch.ones(3, 9, device=device)
    mask[0, :2] = 0
    for on in (True, False):
        outs, grads = [], []
        for m in (full, small):
            m.zero_grad()
            with torch.autocast(device, dtype=torch.bfloat16, enabled=on):
                logits = m(idx, mask)
            logits.float().square().mean().backward()
            outs.append(logits)
            grads.append([p.grad for p in adapters(m)])
        assert outs[0].dtype == outs[1].dtype and torch.equal(outs[0], outs[1]), on
        assert all(torch.equal(a, b) for a, b in zip(*grads)), on
    merged = merge(small)
    assert all(p.dtype == torch.float32 for p in merged.parameters())
    assert all(torch.equal(a, b) for a, b in zip(merge(full).state_dict().values(),
                                                 merged.state_dict().values()))
    save_checkpoint(str(tmp_path / "m.pt"), small, "gpt2-bytes")
    loaded, _ = load_checkpoint(str(tmp_path / "m.pt"), device=device)
    assert all(torch.equal(a, b) for a, b in zip(merged.state_dict().values(),
                                                 loaded.state_dict().values()))
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
        copies = [list(sampler.sampling_copy(m, torch.bfloat16).parameters())
                  for m in (full, small)]
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(*copies))
    # float32 numbers bfloat16 would round: all of them, or one weight of one base
    rounded = randomize_b(add_adapters(tiny(LLAMA), rank=4, alpha=16.0))
    assert not compact(rounded) and all(p.dtype == torch.float32 for p in rounded.parameters())
    one = copy.deepcopy(full).cpu()
    last = [m.base.weight for m in one.modules() if isinstance(m, LoRALinear)][-1]
    with torch.no_grad():
        last[0, 0] = torch.nextafter(last[0, 0], torch.tensor(math.inf))   # 1 ulp of float32
    assert not compact(one) and all(p.dtype == torch.float32 for p in one.parameters())


# -----------------------------------------------------------------------------
# The flags, through the scripts

def test_the_scripts_refuse_bad_lora_flags_before_any_work(tiny_sft, tmp_path):
    cases = [(["--init", tiny_sft, "--lora_rank", "4", "--lora_targets", "q,v"],
              ["--lora_targets", "'q'"]),
             (["--init", tiny_sft, "--lora_rank", "4096"], ["--lora_rank 4096", "1 to 64"]),
             (["--init", tiny_sft, "--lora_rank", "-1"], ["--lora_rank", "-1"]),
             # sft.pt: not built
             (["--lora_rank", "4", "--lora_targets", "gate"], ["--lora_targets", "'gate'"]),
             (["--init", tiny_sft, "--lora_rank", "4", "--lora_targets", ","],
              ["--lora_targets is empty"])]
    refuses_all("grpo.py", cases, tmp_path)
    refuses_all("sft.py", [(["--lora_rank", "4"], ["--lora_rank 4", "--init"])], tmp_path)
    assert sorted(os.listdir(tmp_path)) == [], os.listdir(tmp_path)  # no output folder left behind


def test_grpo_with_lora_trains_only_adapters_and_resumes_exactly(tiny_sft, tmp_path):
    flags = ["--init", tiny_sft, "--prompts_per_step", "4", "--group_size", "4", "--log_every", "1",
             "--eval_every", "100", "--eval_n", "8", "--lora_rank", "4", "--lora_targets", "qkv,o"]
    env = {"OMP_NUM_THREADS": "1"}
    p = run_script("grpo.py", flags + ["--steps", "3", "--out", str(tmp_path / "a")], env=env)
    assert p.returncode == 0, p.stderr
    assert "LoRA: rank 4, alpha 32 on qkv, o" in p.stdout
    run_script("grpo.py", flags + ["--steps", "2", "--out", str(tmp_path / "b")], env=env)
    p = run_script("grpo.py", flags + ["--steps", "3", "--out", str(tmp_path / "b"), "--resume"],
                   env=env)
    assert p.returncode == 0 and "resuming from" in p.stdout, p.stderr
    start = torch.load(tiny_sft, map_location="cpu", weights_only=False)["model"]
    a = torch.load(tmp_path / "a" / "grpo.pt", map_location="cpu", weights_only=False)
    b = torch.load(tmp_path / "b" / "grpo.pt", map_location="cpu", weights_only=False)
    assert a["lora"]["rank"] == 4 and a["step"] == b["step"] == 3
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k           # the resumed run is the uninterrupted one
        base = k.replace(".base.", ".")
        if "lora_" not in k:
            assert torch.equal(v, start[base]), k        # every weight of the model stays as it was
    assert any(not torch.equal(v, torch.zeros_like(v))
               for k, v in a["model"].items() if "lora_B" in k)
    # --resume with other LoRA settings than the checkpoint's: one line naming the flag (it was two
    # lines cut mid-shape), the checkpoint untouched
    plain = flags[:-4]                            # flags without --lora_rank 4 --lora_targets qkv,o
    assert run_script("grpo.py", plain + ["--steps", "1", "--out", str(tmp_path / "c")],
                      env=env).returncode == 0
    b_out, c_out = ["--out", str(tmp_path / "b")], ["--out", str(tmp_path / "c")]
    refuses_all("grpo.py", [
        (plain + ["--lora_rank", "2", "--lora_targets", "qkv,o", "--steps", "5", "--resume"]
         + b_out, ["--lora_rank 2, but", "with --lora_rank 4", "resume with --lora_rank 4"]),
        (plain + ["--steps", "5", "--resume"] + b_out,
         ["trained with LoRA adapters (--lora_rank 4)"]),
        (flags + ["--lora_alpha", "8", "--steps", "5", "--resume"] + b_out,
         ["--lora_alpha 8, but", "32"]),
        (flags[:-1] + ["qkv", "--steps", "5", "--resume"] + b_out,
         ["--lora_targets qkv, but", "qkv,o"]),
        (flags + ["--steps", "5", "--resume"] + c_out,
         ["without LoRA", "without --lora_rank 4"])], tmp_path)
    assert torch.load(tmp_path / "b" / "grpo.pt", map_location="cpu",
                      weights_only=False)["step"] == 3
