"""export.py: checkpoints out to the Hugging Face layout. Each family's export has exactly the
tensor names and shapes transformers wrote for that model_type (the golden folders'
model.safetensors), loads back bit for bit (model.py's loader: same weights, same logits), shards
with an index; the byte tokenizer's tokenizer.json encodes as the byte tokenizer; a LoRA checkpoint
exports merged, or as the adapter folder PEFT writes (tests/golden/*/peft.json: names, shapes,
config) whose W + (alpha / r) B A is the merged export. Bad input refused with nothing on disk.
Loading in transformers and PEFT themselves is checked where they are installed (not in
requirements.txt)."""
import json
import os
import shutil
import signal
import time
from dataclasses import asdict

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import export as export_py
from conftest import ROOT, as_a_process, refused, run_script
from hf.checkpoint import from_pretrained, load_checkpoint, save_checkpoint
from hf.tokenizer import Tokenizer, tokenizer_files
from lora import LoRALinear, add_adapters
from model import GPT, GPTConfig

GOLDEN = os.path.join(ROOT, "tests", "golden")
FAMILIES = ["gpt2", "llama", "qwen2", "llama3", "qwen3"]


def export(*args, fresh=False):
    return run_script("export.py", list(map(str, args)), fresh=fresh)


def shapes(path):
    with safe_open(path, "pt") as f:
        return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}


def trained(family, tmp_path, lora=False, seed=0):
    """A checkpoint trained from a golden folder: its weights moved (or, with lora, adapters on
    every projection with non-zero B over the folder's own weights), saved as the scripts save."""
    folder = os.path.join(GOLDEN, family)
    model = from_pretrained(folder)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if lora:
            add_adapters(model, 2, 8.0)
            for m in model.modules():
                if isinstance(m, LoRALinear):
                    for b in m.lora_B.values():
                        b.copy_(0.2 * torch.randn(b.shape, generator=g))
        else:
            for p in model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g))
    path = tmp_path / f"{family}{'-lora' if lora else ''}.pt"
    save_checkpoint(str(path), model, "hf:" + folder, step=3,
                    tokenizer_files=tokenizer_files(folder))
    return path


def same_model(folder, ckpt_path):
    """model.py's loader reads the export back as the checkpoint's model: every tensor and the
    logits equal."""
    ours, _ = load_checkpoint(str(ckpt_path))
    back = from_pretrained(str(folder))
    # None: as `bias`
    resolved = lambda c: {**asdict(c), "o_bias": c.bias if c.o_bias is None else c.o_bias}
    assert resolved(back.config) == resolved(ours.config)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(),
                                                 ours.state_dict().values()))
    idx = torch.randint(0, ours.config.vocab_size, (2, 11),
                        generator=torch.Generator().manual_seed(0))
    assert torch.equal(back(idx), ours.eval()(idx))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_an_export_has_the_familys_tensors_and_loads_back_bit_for_bit(family, tmp_path):
    ckpt = trained(family, tmp_path)
    out = tmp_path / "hf"
    p = export(ckpt, out, fresh=family == "gpt2")          # one from the command line
    assert p.returncode == 0, p.stderr
    golden = os.path.join(GOLDEN, family)
    # transformers'
    assert shapes(out / "model.safetensors") == shapes(os.path.join(golden, "model.safetensors"))
    # float32
    assert (json.load(open(out / "config.json"))
            == json.load(open(os.path.join(golden, "config.json"))))
    for name in os.listdir(golden):                     # the tokenizer, template, generation config
        if name.startswith(("tokenizer", "chat_template", "generation_config")):
            assert open(out / name, "rb").read() == open(os.path.join(golden, name),
                                                         "rb").read(), name
    assert sorted(os.listdir(out)) == sorted(
        n for n in os.listdir(golden) if not n.startswith(("golden", "peft")))
    same_model(out, ckpt)
    assert all(t.dtype == torch.float32 for t in load_file(out / "model.safetensors").values())


def test_bfloat16_and_shards(tmp_path):
    ckpt = trained("qwen3", tmp_path)
    p = export(ckpt, tmp_path / "bf16", "--dtype", "bfloat16", "--max_shard_size", "20KB")
    assert p.returncode == 0, p.stderr
    index = json.load(open(tmp_path / "bf16" / "model.safetensors.index.json"))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    tensors = {}
    for f in files:
        assert (os.path.getsize(tmp_path / "bf16" / f) < 20_000 + 4_000
                or len(shapes(tmp_path / "bf16" / f)) == 1)
        tensors.update(load_file(tmp_path / "bf16" / f))
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in tensors.values())
    assert json.load(open(tmp_path / "bf16" / "config.json"))["dtype"] == "bfloat16"
    ours = load_checkpoint(str(ckpt))[0].state_dict()
    back = from_pretrained(str(tmp_path / "bf16"), dtype=None)
    assert next(back.parameters()).dtype == torch.bfloat16
    assert all(torch.equal(b, ours[n].to(torch.bfloat16)) for n, b in back.state_dict().items())


def test_a_byte_tokenizer_model_becomes_gpt2_with_a_tokenizer_json_that_encodes_the_same(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4))
    ckpt = tmp_path / "sft.pt"
    save_checkpoint(str(ckpt), model, "bytes")
    p = export(ckpt, tmp_path / "hf")
    assert p.returncode == 0, p.stderr
    config = json.load(open(tmp_path / "hf" / "config.json"))
    # what transformers' GPT2Config writes
    golden = json.load(open(os.path.join(GOLDEN, "gpt2", "config.json")))
    assert config["model_type"] == "gpt2" and set(config) - {"torch_dtype", "n_ctx"} <= set(golden)
    # exact GELU, as ours
    assert config["activation_function"] == "gelu" and config["vocab_size"] == 258
    same_model(tmp_path / "hf", ckpt)
    ours, theirs = Tokenizer("bytes"), Tokenizer.from_pretrained(str(tmp_path / "hf"))
    for text in ["12+34*5=", "tabs\tand\nnewlines  ", "caf\u00e9 \u2192 \U0001f600",
                 "<|endoftext|> as text"]:
        assert theirs.encode(text) == ours.encode(text), text
    assert ((theirs.eos_id, theirs.pad_id, theirs.vocab_size)
            == (ours.eos_id, ours.pad_id, ours.vocab_size))


ROPE = dict(n_layer=2, n_embd=32, n_head=4, n_kv_head=2, pos="rope", norm="rmsnorm", mlp="swiglu",
            mlp_hidden=48, bias=False, tie_embeddings=False)


@pytest.mark.parametrize("family, config", [
    ("llama", dict(ROPE, qkv_bias=False, rope_scaling="llama3", rope_original_max=16)),
    ("qwen2", dict(ROPE, qkv_bias=True, o_bias=False, tie_embeddings=True)),
    ("qwen3", dict(ROPE, qkv_bias=False, qk_norm=True, head_dim=16)),
])
def test_a_rotary_byte_tokenizer_model_becomes_the_family_its_parts_fit(family, config, tmp_path):
    """No source folder: config.json is written from the model's config, the family inferred from
    its parts."""
    torch.manual_seed(0)
    ckpt = tmp_path / "m.pt"
    save_checkpoint(str(ckpt), GPT(GPTConfig(**config)), "bytes")
    p = export(ckpt, tmp_path / "hf")
    assert p.returncode == 0, p.stderr
    written = json.load(open(tmp_path / "hf" / "config.json"))
    golden = json.load(open(os.path.join(GOLDEN, "llama3" if family == "llama" else family,
                                         "config.json")))
    # transformers 5 nests these in rope_parameters
    assert written["model_type"] == family and set(written) - {"torch_dtype", "rope_theta",
                                                               "rope_scaling"} <= set(golden)
    same_model(tmp_path / "hf", ckpt)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_lora_checkpoint_exports_merged_or_as_pefts_adapter_folder(family, tmp_path):
    ckpt = trained(family, tmp_path, lora=True)
    assert export(ckpt, tmp_path / "merged").returncode == 0
    same_model(tmp_path / "merged", ckpt)                            # merged: W + (alpha / r) B A
    p = export(ckpt, tmp_path / "peft", "--peft")
    assert p.returncode == 0, p.stderr
    files = set(os.listdir(tmp_path / "peft"))
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= files   # + the
    assert not files & {"config.json", "model.safetensors"}                            # tokenizer's
    golden = json.load(open(os.path.join(GOLDEN, family, "peft.json")))          # what PEFT wrote
    assert shapes(tmp_path / "peft" / "adapter_model.safetensors") == golden["tensors"]
    # float32, as PEFT saves them
    with safe_open(tmp_path / "peft" / "adapter_model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    config, want = json.load(open(tmp_path / "peft" / "adapter_config.json")), golden[
        "adapter_config"]
    assert set(config) <= set(want)
    for key in ("peft_type", "task_type", "r", "lora_dropout", "bias", "fan_in_fan_out",
                "use_rslora"):
        assert config[key] == want[key], key
    assert (sorted(config["target_modules"]) == sorted(want["target_modules"])
            and config["lora_alpha"] == 8)
    assert config["base_model_name_or_path"] == os.path.join(GOLDEN, family)
    # PEFT's merge of these tensors into the folder's weights is the merged export
    adapters = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    base, merged = load_file(os.path.join(GOLDEN, family, "model.safetensors")), load_file(
        tmp_path / "merged" / "model.safetensors")
    base = {k.removeprefix("transformer."): v for k, v in base.items()}
    merged = {k.removeprefix("transformer."): v for k, v in merged.items()}
    changed = set()
    for name in adapters:
        if ".lora_A." in name:
            module = (name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                      .removeprefix("transformer."))
            A, B = adapters[name].double(), adapters[name.replace("lora_A", "lora_B")].double()
            delta = 8.0 / 2 * B @ A                                      # (out, in)
            if config["fan_in_fan_out"]:
                delta = delta.T                                    # GPT-2's Conv1D stores (in, out)
            W = base[module + ".weight"].double() + delta
            assert torch.allclose(merged[module + ".weight"].double(), W, atol=1e-6), module
            changed.add(module + ".weight")
    assert all(torch.equal(merged[n], base[n]) for n in base if n not in changed and n in merged)


@pytest.mark.skipif(not all(__import__("importlib").util.find_spec(m)
                            for m in ("transformers", "peft")),
                    reason="transformers and peft are not in requirements.txt")
@pytest.mark.parametrize("family", ["gpt2", "qwen3"])
def test_transformers_and_peft_load_the_exports(family, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    ckpt = trained(family, tmp_path, lora=True)
    assert export(ckpt, tmp_path / "merged").returncode == 0
    assert export(ckpt, tmp_path / "peft", "--peft").returncode == 0
    ours = load_checkpoint(str(ckpt))[0].eval()
    idx = torch.randint(0, ours.config.vocab_size, (2, 11),
                        generator=torch.Generator().manual_seed(0))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(os.path.join(GOLDEN, family), dtype=torch.float32),
        tmp_path / "peft")
    V = ours.config.support                                    # Qwen3's embedding is padded past it
    with torch.no_grad():
        want = ours(idx)
        assert torch.allclose(hf(idx).logits[..., :V], want, atol=1e-4)
        assert torch.allclose(peft.eval()(idx).logits[..., :V], want, atol=1e-4)
    text = "hello 12+3"
    assert (AutoTokenizer.from_pretrained(tmp_path / "merged")(text, add_special_tokens=False)
            ["input_ids"] == Tokenizer.from_pretrained(str(tmp_path / "merged")).encode(text))


def test_bad_input_is_refused_and_leaves_nothing(tmp_path):
    full, lora = trained("qwen3", tmp_path), trained("qwen3", tmp_path, lora=True)
    torch.manual_seed(0)
    byte = tmp_path / "byte.pt"
    save_checkpoint(str(byte), GPT(GPTConfig(n_layer=1, n_embd=32, n_head=4)), "bytes")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    moved = tmp_path / "moved"                            # trained from a folder that is gone since
    shutil.copytree(os.path.join(GOLDEN, "qwen3"), moved)
    gone = tmp_path / "gone.pt"
    save_checkpoint(str(gone), from_pretrained(str(moved)), "hf:" + str(moved))
    shutil.rmtree(moved)
    before = sorted(os.listdir(tmp_path))
    cases = [((full, busy), [str(busy), "not an empty folder"]),
             ((full, tmp_path / "a", "--peft"), ["--peft", "no LoRA adapters"]),
             ((byte, tmp_path / "b", "--model_type", "llama"), ["llama", "learned positions"]),
             ((lora, tmp_path / "c", "--model_type", "qwen2"), ["--model_type qwen2"]),
             ((gone, tmp_path / "d"), [str(moved), "gone"]),
             ((tmp_path / "nothing.pt", tmp_path / "e"), ["nothing.pt"]),
             ((full, tmp_path / "f", "--max_shard_size", "5 parsecs"),
              ["--max_shard_size", "5 parsecs"]),
             ((full, tmp_path / "g", "--dtype", "int8"), ["--dtype", "int8"])]
    for args, words in cases:
        refused(export(*args), *words)
    # adapters over weights that are not the source folder's (an SFT run before them): no PEFT
    # folder
    model, _ = load_checkpoint(str(full))
    add_adapters(model, 2, 8.0)
    shifted = tmp_path / "shifted.pt"
    save_checkpoint(str(shifted), model, "hf:" + os.path.join(GOLDEN, "qwen3"))
    refused(export(shifted, tmp_path / "h", "--peft"), "--peft", "not", "export merged")
    # no folder, no temporary left
    assert sorted(os.listdir(tmp_path)) == sorted(before + ["shifted.pt"])
    assert os.listdir(busy) == ["keep.txt"]


def test_the_source_folder_must_hold_the_tokenizer_the_checkpoint_was_trained_with(tmp_path):
    """A checkpoint keeps the sha256 of its source folder's tokenizer files: an export whose source
    tokenizer.json was swapped for another vocabulary or deleted is refused (it used to copy the one
    or leave the other out, and report success); an older checkpoint without them needs the folder's
    tokenizer.json at least."""
    source = tmp_path / "src"
    shutil.copytree(os.path.join(GOLDEN, "qwen2"), source)
    model = from_pretrained(str(source))
    ckpt, old = tmp_path / "kept.pt", tmp_path / "old.pt"
    save_checkpoint(str(ckpt), model, "hf:" + str(source),
                    tokenizer_files=tokenizer_files(str(source)))
    save_checkpoint(str(old), model, "hf:" + str(source))
    assert export(ckpt, tmp_path / "a").returncode == 0
    for name, change in (("tokenizer_config.json", lambda p: p.write_text(
            p.read_text().replace('"model_max_length"', '"model_max_length" '))),
                         ("chat_template.jinja", lambda p: p.write_text("{{ messages }}"))):
        kept = (source / name).read_bytes() if (source / name).exists() else None
        change(source / name)                                  # every tokenizer file counts
        refused(export(ckpt, tmp_path / "b"), str(source), f"{name} changed since")
        (source / name).write_bytes(kept) if kept is not None else os.remove(source / name)
    assert export(ckpt, tmp_path / "a2").returncode == 0
    shutil.rmtree(tmp_path / "a2")
    # same size, other ids
    shutil.copy(os.path.join(GOLDEN, "gpt2", "tokenizer.json"), source / "tokenizer.json")
    refused(export(ckpt, tmp_path / "b"), str(source), "tokenizer.json changed since")
    os.remove(source / "tokenizer.json")
    refused(export(ckpt, tmp_path / "c"), "tokenizer.json changed since")
    refused(export(old, tmp_path / "d"), "has no tokenizer.json")
    assert sorted(os.listdir(tmp_path)) == ["a", "kept.pt", "old.pt", "src"]


def test_unusual_destinations_sizes_and_values_are_one_line_each(tmp_path):
    """A symlinked or dangling destination, one under a file, an infinite shard size, a weight
    float16 cannot hold: one line each (they were tracebacks, or an inf written without a word),
    nothing left behind."""
    ckpt = trained("qwen2", tmp_path)
    model, _ = load_checkpoint(str(ckpt))
    with torch.no_grad():
        model.ln_f.weight[0] = 1e6
    big = tmp_path / "big.pt"
    save_checkpoint(str(big), model, "hf:" + os.path.join(GOLDEN, "qwen2"),
                    tokenizer_files=tokenizer_files(os.path.join(GOLDEN, "qwen2")))
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "link")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    (tmp_path / "file").write_text("x")
    before = sorted(os.listdir(tmp_path))
    for args, words in [((ckpt, tmp_path / "link"), ["link", "symbolic link"]),
                        ((ckpt, tmp_path / "dangling"), ["dangling", "symbolic link"]),
                        ((ckpt, tmp_path / "file" / "out"), ["cannot write", "file/out"]),
                        ((ckpt, tmp_path / "x", "--max_shard_size", "infGB"),
                         ["--max_shard_size", "infGB"]),
                        ((ckpt, tmp_path / "y", "--max_shard_size", "1e400GB"),
                         ["--max_shard_size"]), (
        (big, tmp_path / "z", "--dtype", "float16"), ["model.norm.weight", "float16", "1e+06"])]:
        refused(export(*args), *words)
    assert sorted(os.listdir(tmp_path)) == before and os.listdir(tmp_path / "elsewhere") == []
    assert export(big, tmp_path / "bf16", "--dtype", "bfloat16").returncode == 0


def test_an_interrupted_export_leaves_nothing_and_a_killed_ones_leftovers_are_cleared(tmp_path,
                                                                                      monkeypatch):
    """Ctrl-C or SIGTERM while the weights are written: one line, the temporary folder removed. A
    temporary folder left by a killed export (its process gone) is removed by the next export to the
    same place. The files written are readable by others (the umask's mode, as any file a user
    writes; safetensors wrote 0600)."""
    ckpt, out = trained("qwen2", tmp_path), tmp_path / "out"
    orphan = tmp_path / "out.tmp999999999"                   # no process has this pid
    orphan.mkdir()
    (orphan / "model.safetensors").write_text("half")
    write = export_py.write_weights
    for stop in (lambda: (_ for _ in ()).throw(KeyboardInterrupt),
                 lambda: os.kill(os.getpid(), signal.SIGTERM)):
        def interrupted(*a, stop=stop, **k):
            write(*a, **k)
            stop()
            time.sleep(5)                               # the signal's handler acts before this ends
        monkeypatch.setattr(export_py, "write_weights", interrupted)
        previous = signal.getsignal(signal.SIGTERM)
        try:
            with pytest.raises(SystemExit) as e, as_a_process():
                export_py.main([str(ckpt), str(out)])
        finally:
            signal.signal(signal.SIGTERM, previous)
        assert e.value.code in (143, "export.py: interrupted; nothing was written"), e.value.code
        # the orphan too: removed before the export began
        assert sorted(os.listdir(tmp_path)) == ["qwen2.pt"]
    monkeypatch.setattr(export_py, "write_weights", write)
    assert export(ckpt, out).returncode == 0
    umask = os.umask(0)
    os.umask(umask)
    assert {os.stat(out / n).st_mode & 0o777 for n in os.listdir(out)} == {0o666 & ~umask}


def test_a_full_disk_while_the_weights_are_written_is_one_line_and_leaves_nothing(tmp_path,
                                                                                   monkeypatch):
    """safetensors reports a full disk as its own SafetensorError, not an OSError: still one line
    naming the destination and the reason, the temporary folder removed."""
    from safetensors import SafetensorError
    ckpt, out = trained("qwen2", tmp_path), tmp_path / "out"

    def full(tensors, path, metadata=None):
        open(path, "wb").close()
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os "
                              "error 28)")
    monkeypatch.setattr(export_py, "save_file", full)
    with pytest.raises(SystemExit) as e, as_a_process():
        export_py.main([str(ckpt), str(out)])
    assert e.value.code == (f"error: cannot write {out} (Error while serializing: I/O error: No "
                            f"space left on device (os error 28))")
    assert sorted(os.listdir(tmp_path)) == ["qwen2.pt"]
