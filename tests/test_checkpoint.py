"""Real checkpoints: tiny random GPT-2, Llama, Qwen2, Llama 3 (Llama 3.1's rope scaling, a BOS
before every text, several EOS ids) and Qwen3 (query/key norms, a head width apart from the model's)
folders in the Hugging Face layout, written with their logits, greedy continuations and tokenizer
encodings by transformers itself (tests/golden/make_golden.py), load into model.py and agree: logits
within 1e-4 in float32 (over the tokenizer's ids: Qwen3's embedding is padded past them, and its q/k
norm weights are not 1), greedy generation token for token, encodings exactly. Their chat templates:
tests/test_chat.py."""
import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import sampler
from hf.checkpoint import CheckpointError, from_pretrained
from hf.tokenizer import Tokenizer
from model import GPT, GPTConfig

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
FAMILIES = ["gpt2", "llama", "qwen2", "llama3", "qwen3"]


def golden(name):
    folder = os.path.join(GOLDEN, name)
    with open(os.path.join(folder, "golden.json")) as f:
        return folder, load_file(os.path.join(folder, "golden.safetensors")), json.load(f)


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_transformers(name):
    folder, g, _ = golden(name)
    model = from_pretrained(folder)
    with torch.no_grad():
        logits = model(g["ids"])
    V = model.config.support              # Qwen3's embedding is padded past its tokenizer's 324 ids
    assert (logits.shape == (*g["logits"].shape[:2], V)
            and (V < g["logits"].size(-1)) == (name == "qwen3"))
    torch.testing.assert_close(logits, g["logits"][..., :V], rtol=0, atol=1e-4)
    assert logits.std() > 0.5             # weights large enough that a wrong layer could not hide


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_generation_matches_transformers_on_a_left_padded_batch(name):
    folder, g, meta = golden(name)
    model = from_pretrained(folder)
    eos = meta["eos_id"]
    for mode in ("eager", "graph"):
        tokens, mask, _ = sampler.generate(model, g["prompt"], g["prompt_mask"],
                                           g["greedy"].size(1), eos, eos, temperature=0.0,
                                           mode=mode)
        for row, want in zip(tokens.tolist(), g["greedy"].tolist()):
            cut = lambda xs: xs[:xs.index(eos) + 1] if eos in xs else xs
            assert cut(row) == cut(want)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_tokenizer_encodes_and_decodes_as_transformers(name):
    folder, _, meta = golden(name)
    tok = Tokenizer.from_pretrained(folder)
    assert tok.eos_id in tok.stop_ids and meta["eos_id"] in tok.stop_ids
    for text, ids in meta["encodings"].items():
        assert tok.encode(text) == ids, text
        if text.isascii():
            assert tok.decode(ids) == text
    # a prompt as the tokenizer encodes a text
    for text, ids in meta.get("with_special_tokens", {}).items():
        assert tok.encode_prompt(text) == ids, text


@pytest.mark.parametrize("name", ["gpt2", "qwen3"])
def test_a_text_the_tokenizer_cannot_take_is_a_value_error_at_its_bound_and_one_past(name,
                                                                                     monkeypatch):
    """tiktoken's split regex overflows its stack (a Rust panic) near a million whitespace
    characters in a row: a run of tokenizer.MAX_SPACE_RUN encodes, one more is refused before
    tiktoken sees it; any failure of tiktoken's, a panic included, is a ValueError."""
    from hf import tokenizer
    tok = Tokenizer.from_pretrained(golden(name)[0])
    run = tokenizer.MAX_SPACE_RUN
    assert len(tok.encode("a" + " " * run + "b")) >= 2
    for encode in (tok.encode, tok.encode_special):
        with pytest.raises(ValueError, match=f"a run of more than {run:,} whitespace"):
            encode("a" + " \n" * (run // 2) + " b")
        with pytest.raises(ValueError, match=f"a run of more than {run:,} whitespace"):
            encode("a" + " " * 1_200_000 + "b")

    class Panic(BaseException):                 # what pyo3 raises for a Rust panic
        pass

    def panics(*args, **kwargs):
        raise Panic("called `Result::unwrap()` on an `Err` value: RuntimeError(StackOverflow)")
    monkeypatch.setattr(tok.enc, "encode_ordinary", panics)
    with pytest.raises(ValueError, match="cannot encode a text of 1 characters .Panic: called"):
        tok.encode("a")


def test_every_eos_id_of_the_folder_stops_a_completion_and_the_bos_comes_first():
    """Llama 3 lists two EOS ids (generation_config.json and config.json): each ends a row, the
    verifier's text has neither; the tokenizer's post-processor puts <|begin_of_text|> before a
    prompt (transformers' tokenizer(text))."""
    folder, _, meta = golden("llama3")
    tok, model = Tokenizer.from_pretrained(folder), from_pretrained(folder)
    assert tok.stop_ids == (1, 4) and tok.eos_id == 1 and tok.bos_prefix == [0]
    assert tok.encode_prompt("3+4*2=") == meta["with_special_tokens"]["3+4*2="]
    three = tok.encode("3")[0]

    class Says(GPT):                                          # "3", then `stop`, whatever it is fed
        def logits(self, x, head=None, fast=False):
            out = torch.full((*x.shape[:-1], self.config.support), -1e4)
            out[..., self.next] = 0.0
            self.next = stop
            return out
    for stop in tok.stop_ids:
        says = Says(model.config)
        says.load_state_dict(model.state_dict())
        says.next = three
        prompt, mask = tok.encode_batch(["3+4*2="])
        tokens, keep, truncated = sampler.generate(says.eval(), prompt, mask, 6, tok.stop_ids,
                                                   tok.pad_id, temperature=0, mode="eager")
        assert tokens[0, :2].tolist() == [three, stop] and keep.sum() == 2 and not truncated.any()
        assert tok.decode_completions(tokens, keep) == ["3"]


def test_llama3_rope_scaling_is_what_moves_the_logits_and_reads_either_config_key(tmp_path):
    """The "llama3" scaling changes 4 frequencies of 4 here (one interpolated, three stretched):
    without it the logits are far off; transformers 4's rope_scaling key loads the same model as
    transformers 5's rope_parameters; another scaling is refused in one line."""
    folder, g, _ = golden("llama3")
    model = from_pretrained(folder)
    assert model.config.rope_scaling == "llama3" and model.config.rope_original_max == 16
    with torch.no_grad():
        plain = from_pretrained(folder)
        plain.config.rope_scaling = "none"
        assert (plain(g["ids"]) - g["logits"]).abs().max() > 1e-2
    def legacy(c):
        rope = c.pop("rope_parameters")
        c["rope_theta"] = rope.pop("rope_theta")
        c["rope_scaling"] = rope
    old = copy_folder(tmp_path, "llama3", edit_config=legacy)
    with torch.no_grad():
        torch.testing.assert_close(from_pretrained(old)(g["ids"]), g["logits"], rtol=0, atol=1e-4)
    yarn = copy_folder(tmp_path / "y", "llama3",
                       edit_config=lambda c: c["rope_parameters"].update(rope_type="yarn"))
    with pytest.raises(CheckpointError, match="rope scaling 'yarn' is not supported"):
        from_pretrained(yarn)


def test_qwen3_norms_queries_and_keys_per_head_at_its_own_head_width():
    """Qwen3: head_dim 16 at width 32 with 4 heads (the projections are 64 wide, not 32), an RMSNorm
    over each head's queries and keys: both are in the model and both move its logits."""
    folder, g, _ = golden("qwen3")
    model = from_pretrained(folder)
    attn = model.blocks[0].attn
    assert model.config.head_size == 16 and attn.c_attn.weight.shape == ((4 + 2 * 2) * 16, 32)
    assert attn.c_proj.weight.shape == (32, 64) and attn.q_norm.weight.shape == (16,)
    V = model.config.support
    with torch.no_grad():
        for norm in (attn.q_norm, attn.k_norm):
            saved = norm.weight.clone()
            norm.weight.mul_(2.0)
            assert (model(g["ids"]) - g["logits"][..., :V]).abs().max() > 1e-2
            norm.weight.copy_(saved)


def test_qwen3_norms_queries_and_keys_before_the_rotation(monkeypatch):
    """The golden's q/k norm weights are not 1 (a uniform weight commutes with the rotation and
    would hide the order): the same norms applied after the rotation give other logits."""
    import model as model_module
    folder, g, _ = golden("qwen3")
    model = from_pretrained(folder)
    norms = [n for b in model.blocks
             for n in (b.attn.q_norm, b.attn.k_norm)]            # the order forward rotates q, k in
    assert all(n.weight.std() > 0.1 for n in norms)
    calls, rotate = iter(norms), model_module.rotate
    monkeypatch.setattr(model_module, "rotate", lambda x, cos,
                        sin: next(calls)(rotate(x, cos, sin)))
    for b in model.blocks:
        b.attn.q_norm = b.attn.k_norm = torch.nn.Identity()
    with torch.no_grad():
        swapped = model(g["ids"])                                      # rotate, then norm
    assert next(calls, None) is None                                   # each norm applied once
    assert (swapped - g["logits"][..., :model.config.support]).abs().max() > 1e-2


def test_a_left_padded_prompt_sees_the_rotary_positions_it_sees_alone():
    folder, g, _ = golden("qwen2")
    model = from_pretrained(folder)
    ids = g["ids"][:1, :5]
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    mask = torch.tensor([[0.0] * 3 + [1.0] * 5])
    with torch.no_grad():
        torch.testing.assert_close(model(padded, mask)[:, 3:], model(ids), rtol=0, atol=1e-5)


def test_the_default_config_builds_the_same_model_as_before():
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    names = [n for n, _ in model.named_parameters()]
    assert names[:2] == ["wte.weight", "wpe.weight"] and "blocks.0.mlp.0.weight" in names
    assert (model.lm_head.weight is model.wte.weight
            and isinstance(model.blocks[0].ln_1, torch.nn.LayerNorm))
    V, T, C, L = 258, 64, 128, 4  # GPT-2's parameter count, by hand: embeddings, blocks, final norm
    block = 2 * 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + (C * 4 * C + 4 * C) + (4 * C * C + C)
    assert model.num_params() == V * C + T * C + L * block + 2 * C


def copy_folder(tmp_path, name, edit_config=None, edit_tensors=None):
    folder = str(tmp_path / name)
    shutil.copytree(os.path.join(GOLDEN, name), folder)
    if edit_config:
        path = os.path.join(folder, "config.json")
        config = json.load(open(path))
        edit_config(config)
        json.dump(config, open(path, "w"))
    if edit_tensors:
        path = os.path.join(folder, "model.safetensors")
        tensors = load_file(path)
        edit_tensors(tensors)
        save_file(tensors, path)
    return folder


@pytest.mark.parametrize("edit, words", [
    (dict(edit_config=lambda c: c.update(model_type="mistral")), "model_type 'mistral'"),
    (dict(edit_config=lambda c: c.update(hidden_act="gelu")), "hidden_act"),
    (dict(edit_tensors=lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
     "model.layers.1.mlp.up_proj.weight"),
    (dict(edit_tensors=lambda t: t.update({"model.extra.weight": torch.zeros(2)})),
     "model.extra.weight"),
    (dict(edit_tensors=lambda t: t.update({"model.norm.weight": torch.ones(31)})), "ln_f.weight"),
])
def test_a_checkpoint_that_does_not_fit_is_one_error_naming_what(tmp_path, edit, words):
    folder = copy_folder(tmp_path, "llama", **edit)
    with pytest.raises(CheckpointError, match=words.replace("(", r"\(")):
        from_pretrained(folder)


def test_scripts_take_a_hugging_face_folder_as_init_and_resume_from_what_they_wrote(tmp_path):
    from conftest import run_script
    from plumbing.loading import load_model
    out, qwen = str(tmp_path), os.path.join(GOLDEN, "qwen2")
    small = ["--prompts_per_step", "4", "--group_size", "4", "--eval_n", "16", "--init", qwen,
             "--out", out]
    p = run_script("grpo.py", ["--steps", "1"] + small)
    assert p.returncode == 0, p.stderr
    p = run_script("grpo.py", ["--steps", "2", "--resume"] + small)
    assert p.returncode == 0 and "done: 2 steps" in p.stdout, p.stderr
    model, tok, ckpt = load_model(os.path.join(out, "grpo.pt"), "cpu")
    assert tok.name == "hf:" + qwen and model.config.pos == "rope" and model.config.kv_heads == 2
    p = run_script("sft.py", ["--steps", "2", "--batch_size", "4", "--eval_n", "8",
                              "--init", os.path.join(GOLDEN, "gpt2"), "--out", out])
    assert p.returncode == 0, p.stderr


def test_a_bad_folder_is_refused_before_any_work(tmp_path):
    from conftest import refused, run_script
    folder = copy_folder(tmp_path, "qwen2", edit_config=lambda c: c.update(model_type="phi3"))
    refused(run_script("grpo.py", ["--init", folder, "--out", str(tmp_path / "o")]), "phi3")
    assert not os.path.exists(tmp_path / "o" / "grpo")


def test_an_eos_outside_the_tokenizer_is_refused_and_a_tokenizer_only_folder_names_its_own(
    tmp_path):
    """An eos_token_id the tokenizer does not have would leave every completion running to its
    limit: one error line. A folder holding a tokenizer only (no config.json) takes its EOS from
    tokenizer_config.json's eos_token."""
    folder = copy_folder(tmp_path, "qwen2", edit_config=lambda c: c.update(eos_token_id=10**6))
    for name in ("generation_config.json",):
        if os.path.exists(os.path.join(folder, name)):
            os.remove(os.path.join(folder, name))
    with pytest.raises(CheckpointError, match="eos_token_id 1000000 is not an id of its tokenizer"):
        Tokenizer.from_pretrained(folder)
    only = tmp_path / "tokenizer_only"
    os.makedirs(only)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(GOLDEN, "qwen2", name), only / name)
    tok = Tokenizer.from_pretrained(str(only))
    assert tok.eos_id == 319 and tok.decode([tok.eos_id]) == "<|endoftext|>"
    json.dump({"eos_token": "<|nothing|>"}, open(only / "tokenizer_config.json", "w"))
    with pytest.raises(CheckpointError, match="no integer eos_token_id"):
        Tokenizer.from_pretrained(str(only))


def test_a_refusal_after_the_output_folder_is_made_leaves_nothing_on_disk(tmp_path):
    """A folder whose config is fine but whose weights are not is refused when the weights load,
    after the run has made its output folder and lock: the folder goes again (nothing on disk from a
    refused run)."""
    from conftest import refused, run_script
    folder = copy_folder(tmp_path, "qwen2",
                         edit_tensors=lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    refused(run_script("grpo.py", ["--init", folder, "--out", str(tmp_path / "o" / "deeper")]),
            "up_proj")
    assert not os.path.exists(tmp_path / "o")


def edit_json(folder, name, edit):
    """edit(data) changes the file's JSON in place, or returns a list or dict that replaces it."""
    path = os.path.join(folder, name)
    data = json.load(open(path))
    new = edit(data)
    json.dump(new if isinstance(new, (dict, list)) else data, open(path, "w"))


@pytest.mark.parametrize("name, edit, words", [
    ("config.json", lambda c: c.pop("vocab_size"), "config.json has no vocab_size"),
    ("config.json", lambda c: c.update(vocab_size="320"),
     "vocab_size = '320'; it must be a positive integer"),
    ("config.json", lambda c: [c], "config.json is not a JSON object"),
    ("config.json", lambda c: c.update(num_attention_heads=0), "num_attention_heads = 0"),
    ("config.json", lambda c: c.update(num_attention_heads=3), "must be divisible by n_head = 3"),
    ("config.json", lambda c: c.update(rms_norm_eps=float("nan")), "rms_norm_eps = nan"),
    ("model.safetensors.index.json", lambda c: {"metadata": {}}, "no weight_map"),
    ("model.safetensors.index.json", lambda c: ["model.safetensors"],
     "index.json is not a JSON object"),
    ("model.safetensors.index.json", lambda c: {"weight_map": {"lm_head.weight": "/etc/passwd"}},
     "no weight_map of tensor names to .safetensors files in the folder"),
    ("tokenizer.json", lambda c: c["model"]["vocab"].update({"Ġx": "7"}),
     "not a non-negative integer"),
    ("tokenizer.json", lambda c: c.update(added_tokens=[{"id": 319}]), "without its content"),
])
def test_malformed_folder_contents_are_one_error_naming_the_file_and_key(tmp_path, name, edit,
                                                                         words):
    """Each of these used to be a traceback (a KeyError, a TypeError, a ZeroDivisionError): now one
    line naming the file and what in it, from the loader, and from a script before any work."""
    from conftest import refused, run_script
    folder = copy_folder(tmp_path, "qwen2")
    if name == "model.safetensors.index.json":
        json.dump({}, open(os.path.join(folder, name), "w"))
    edit_json(folder, name, edit)
    with pytest.raises(CheckpointError, match=words.replace("(", r"\(")):
        from_pretrained(folder) if name != "tokenizer.json" else Tokenizer.from_pretrained(folder)
    p = run_script("grpo.py", ["--init", folder, "--out", str(tmp_path / "o")])
    refused(p, words)
    assert not os.path.exists(tmp_path / "o")


def test_a_llama_folder_with_attention_biases_and_no_mlp_biases_loads(tmp_path):
    """Llama's attention_bias covers q, k, v and o_proj, mlp_bias the MLP (transformers'
    LlamaAttention, LlamaMLP): a folder with biases on the attention only loads, its o_proj.bias in
    our c_proj, none in the MLP, and the bias moves the logits (it is used)."""
    def add_biases(tensors):
        g = torch.Generator().manual_seed(0)
        for i in range(2):
            for x, n in (("q", 32), ("k", 32), ("v", 32), ("o", 32)):
                rows = tensors[f"model.layers.{i}.self_attn.{x}_proj.weight"].shape[0]
                tensors[f"model.layers.{i}.self_attn.{x}_proj.bias"] = torch.randn(rows,
                                                                                   generator=g)
    folder = copy_folder(tmp_path, "llama",
                         edit_config=lambda c: c.update(attention_bias=True, mlp_bias=False),
                         edit_tensors=add_biases)
    model = from_pretrained(folder)
    block = model.blocks[0]
    assert (block.attn.c_proj.bias is not None and block.mlp.c_fc.bias is None
            and block.attn.c_attn.bias is not None)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    assert torch.equal(block.attn.c_proj.bias, tensors["model.layers.0.self_attn.o_proj.bias"])
    x = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        before = model(x)
        block.attn.c_proj.bias.add_(1.0)
        assert not torch.allclose(model(x), before)


def deep(folder, name):
    with open(os.path.join(folder, name), "w") as f:
        f.write("[" * 100_000 + "]" * 100_000)


def pre_split(c):
    return c["pre_tokenizer"]["pretokenizers"][0]["pattern"]


HOSTILE_FOLDERS = {   # (what the case does to a copy of the qwen2 folder, what the one line says)
    "an absurd hidden_size": (
        lambda f: edit_json(f, "config.json", lambda c: c.update(hidden_size=10**9)),
        "the config needs"),
    "an absurd vocab_size": (
        lambda f: edit_json(f, "config.json", lambda c: c.update(vocab_size=10**9)),
        "the config needs"),
    "an absurd intermediate_size": (
        lambda f: edit_json(f, "config.json", lambda c: c.update(intermediate_size=10**10)),
        "the config needs"),
    "an infinite rope_theta": (
        lambda f: edit_json(f, "config.json", lambda c: c.update(rope_theta=float("inf"))),
        "rope_theta = inf; it must be a positive finite number"),
    "an infinite rms_norm_eps": (
        lambda f: edit_json(f, "config.json", lambda c: c.update(rms_norm_eps=float("inf"))),
        "rms_norm_eps = inf"),
    "a tied head shipped apart": (
        lambda f: save_file({**load_file(os.path.join(f, "model.safetensors")),
                             "lm_head.weight": torch.ones(320, 32)},
                            os.path.join(f, "model.safetensors")),
        "tensor lm_head.weight differs from the token embedding, but config.json ties them"),
    "tie_word_embeddings as text": (
        lambda f: edit_json(f, "config.json", lambda c: c.update(tie_word_embeddings="false")),
        "tie_word_embeddings = 'false'; it must be true or false"),
    "a deep config.json": (
        lambda f: deep(f, "config.json"), "config.json cannot be read (nested too deeply)"),
    "a deep tokenizer.json": (
        lambda f: deep(f, "tokenizer.json"), "tokenizer.json cannot be read (nested"),
    "a deep tokenizer_config.json": (
        lambda f: deep(f, "tokenizer_config.json"), "tokenizer_config.json cannot"),
    "tokenizer.json a list": (
        lambda f: edit_json(f, "tokenizer.json", lambda c: [c]),
        "tokenizer.json is not a JSON object"),
    "pre_tokenizer a list": (
        lambda f: edit_json(f, "tokenizer.json", lambda c: c.update(pre_tokenizer=[1])),
        "pre_tokenizer is not an object"),
    "two tokens with one id": (
        lambda f: edit_json(f, "tokenizer.json", lambda c: c["model"]["vocab"].update({"zzz": 7})),
        "two tokens share an id"),
    "a Digits step that keeps digit runs": (       # a byte without its token loads: test_gguf.py
        lambda f: edit_json(f, "tokenizer.json", lambda c: c["pre_tokenizer"]["pretokenizers"]
                            .insert(0, {"type": "Digits", "individual_digits": False})),
        "a Digits pre-tokenizer is read only as the first step with individual_digits true"),
    "a split pattern that does not compile": (
        lambda f: edit_json(f, "tokenizer.json", lambda c: pre_split(c).update(Regex="[z-a]")),
        "tokenizer.json cannot be read as a tokenizer"),
    "a NaN weight": (
        lambda f: save_file({**load_file(os.path.join(f, "model.safetensors")),
                             "model.norm.weight": torch.full((32,), float("nan"))},
                            os.path.join(f, "model.safetensors")),
        "holds NaN or infinite values"),
    "a missing tensor": (
        lambda f: save_file({k: v for k, v in load_file(os.path.join(f, "model.safetensors"))
                             .items() if k != "model.norm.weight"},
                            os.path.join(f, "model.safetensors")),
        "qwen2: tensor model.norm.weight is missing"),
}


def test_hostile_folder_contents_are_one_line_before_anything_is_built(tmp_path):
    """The reliability review's cases (N5, N6, N12, N13): absurd sizes are refused from the shapes
    before the model is allocated (it used to be built first: an allocator traceback, or on a large
    machine a huge allocation), deep or mistyped JSON, a pre-tokenizer step it cannot read,
    non-finite weights and config numbers: one line each, naming the file; through the loader, and
    through grpo.py with nothing left on disk."""
    from conftest import refuses_all
    cases = []
    for i, (case, (make, words)) in enumerate(HOSTILE_FOLDERS.items()):
        folder = copy_folder(tmp_path / str(i), "qwen2")
        make(folder)
        with pytest.raises(CheckpointError, match=re.escape(words)):
            Tokenizer.from_pretrained(folder)
            from_pretrained(folder)
        if i % 3 == 0:                                 # a third of them through a script too
            cases.append((["--init", folder, "--steps", "1"], [words]))
    os.makedirs(tmp_path / "runs")
    refuses_all("grpo.py", cases, tmp_path / "runs")
    assert os.listdir(tmp_path / "runs") == []
