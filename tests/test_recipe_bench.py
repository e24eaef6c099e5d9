"""bench/recipe.py on the CPU at toy shapes: the Hugging Face folder it writes without transformers
(Qwen2's layout, an embedding larger than the tokenizer) loads here with the tokenizer's support,
and grpo.py's recipe runs on it end to end, every step timed. The GPU figures it measures are in
results/gpu.md."""
import json
import os

import pytest
import torch

from conftest import ROOT, run_script
from hf.checkpoint import from_pretrained, pretrained_config
from hf.tokenizer import Tokenizer


@pytest.mark.slow
def test_the_recipe_runs_grpo_on_a_folder_whose_embedding_outgrows_its_tokenizer(tmp_path):
    """70000 embedding rows, 65022 tokenizer ids (65000 ordinary, 22 special): a random policy at
    temperature 1 draws from the whole support, so a step samples ids near its end, and nothing past
    it (the run would die decoding one, as every Qwen2.5 run did). Two steps, each split into
    sampling, scoring and update."""
    out = tmp_path / "bench"
    p = run_script(os.path.join(ROOT, "bench", "recipe.py"),
                   ["--device", "cpu", "--tiny", "--steps", "2", "--max_new_tokens", "6",
                    "--out", str(out), "--json", str(tmp_path / "recipe.json")])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    result = json.load(open(tmp_path / "recipe.json"))
    assert [s["step"] for s in result["steps"]] == [1, 2] and "| 2 |" in p.stdout
    for s in result["steps"]:
        assert (s["sampling"] > 0 and s["scoring"] > 0 and s["update"] > 0
                and s["completion_tokens"] == 128 * 6)
    folder = str(out / "tiny-qwen2-shaped")
    config = pretrained_config(folder)
    assert (config.vocab_size, config.tokenizer_vocab) == (70000, 65022)
    model, tok = from_pretrained(folder), Tokenizer.from_pretrained(folder)
    assert (tok.vocab_size == 65022 and tok.eos_id == 65002
            and tok.decode(tok.encode("3,5,7:22=")) == "3,5,7:22=")
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).shape[-1] == 65022
    assert not (out / "recipe-run" / "grpo.pt").exists()            # the bench writes no checkpoint


def test_the_memory_ledger_counts_each_owner_once():
    """bench/recipe.py's Ledger.owners (here over CPU tensors): the policy's weights, its gradients,
    AdamW's two moments, the reference's weights and the sampler's bfloat16 copy, each storage
    once; a LoRA reference shares the policy's weights (nothing of its own); a released copy, a
    parked reference and parked moments hold nothing."""
    import sys
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import recipe
    from plumbing import parking
    import sampler
    from lora import add_adapters, base_model, trainable
    from model import GPT, GPTConfig
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                       mlp_hidden=64, norm="rmsnorm", pos="rope", mlp="swiglu", bias=False)
    gib = lambda tensors: sum(t.numel() * t.element_size() for t in tensors) / 2**30
    for lora in (False, True):
        policy = GPT(config)
        ref = base_model(add_adapters(policy, 2,
                                      4.0)) if lora else GPT(config).requires_grad_(False)
        optimizer = torch.optim.AdamW(trainable(policy))
        policy(torch.tensor([[1, 2, 3]]))[0].sum().backward()
        optimizer.step()
        ledger = recipe.Ledger("cpu")
        ledger.models, ledger.optimizers = [policy, ref], [optimizer]
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            twin = sampler.sampling_copy(policy, torch.bfloat16)
        got = ledger.owners()
        params = list(policy.parameters())
        linears = [p for m in twin.blocks.modules() if isinstance(m, torch.nn.Linear)
                   for p in m.parameters()]
        want = {"weights": gib(params), "gradients": gib(p.grad for p in trainable(policy)),
                "adamw": 2 * gib(trainable(policy)), "sampler copy": gib(linears)}
        if not lora:
            want["reference"] = gib(ref.parameters())
        assert (got.keys() == want.keys()
                and all(abs(got[k] - want[k]) < 1e-12 for k in want)), (lora, got, want)
        assert all(p.dtype == torch.bfloat16 for p in linears) and gib(linears) > 0
        sampler.release_copy(policy)
        assert "sampler copy" not in ledger.owners()
        if not lora:                                        # a parked reference: only inside `with`
            parked = parking.Parked(ref)
            assert "reference" not in ledger.owners()
            with parked:
                assert abs(ledger.owners()["reference"] - want["reference"]) < 1e-12
        moments = parking.ParkedMoments(optimizer)                # --offload_optimizer: the same
        assert "adamw" not in ledger.owners()
        with moments:
            assert abs(ledger.owners()["adamw"] - want["adamw"]) < 1e-12
