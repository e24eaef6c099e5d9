"""
Every way weights enter or leave a model.GPT: this project's checkpoints (one dict, written
atomically) and a Hugging Face folder (config.json and safetensors), read here and written back
by export.py through the same table of weight names, read in one direction or the other.

    save_checkpoint(path, model, tokenizer_name, optimizer, step, args, **extra)
    model, ckpt = load_checkpoint(path)            # a LoRA checkpoint comes back merged
    model = from_pretrained("path/to/Qwen2.5-0.5B-Instruct")
    tensors = hf_tensors(model.state_dict(), model.config)   # export.py: our names -> theirs

A folder is untrusted input: its config is checked key by key, its tensors' shapes are compared
with those of a model built on the meta device (nothing allocated) before any weight is used,
and a missing, unused, mis-shaped or non-finite tensor is one error line naming it.
"""
import contextlib
import math
import os
import zipfile
from dataclasses import asdict, fields

import torch
from safetensors.torch import load_file

from hf.tokenizer import CheckpointError, read_json, tokenizer_ids
from lora import add_adapters, merge
from model import GPT, GPTConfig, ScalarGPT

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "fingerprint",
           "is_pretrained_folder", "pretrained_config", "from_pretrained", "hf_tensors", "hf_names"]


# -----------------------------------------------------------------------------
# This project's checkpoints: one dict

def save_checkpoint(path, model, tokenizer_name, optimizer=None, step=0, args=None, state=None,
                    **extra):
    """Write {model, kind, config, tokenizer, optimizer, step, args, ...} to `path` through a
    temporary file, synced, and a rename: a crash never leaves half a checkpoint under the real
    name. A model with LoRA adapters is saved with them and their settings ("lora"). optimizer:
    one, or its state_dict; state: the model's state_dict, if not model's own (an FSDP run's,
    gathered). A write that fails (a full disk) is one CheckpointError, the earlier file at `path`
    untouched."""
    if optimizer is not None and not isinstance(optimizer, dict):
        optimizer = optimizer.state_dict()
    ckpt = {
        "model": model.state_dict() if state is None else state,
        "kind": "scalar" if isinstance(model, ScalarGPT) else "gpt",
        "config": asdict(model.config),
        "tokenizer": tokenizer_name,
        "optimizer": optimizer,
        "step": step,
        "args": vars(args) if hasattr(args, "__dict__") else args,
        **({"lora": model.lora} if getattr(model, "lora", None) else {}),
        **extra,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:                   # a file object: a full disk is an OSError
            torch.save(ckpt, f)
            f.flush()
            os.fsync(f.fileno())                     # on disk before it takes the real name
        os.replace(tmp, path)  # atomic on POSIX and Windows
    except (OSError, RuntimeError) as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        why = e.strerror if isinstance(e, OSError) and e.strerror else " ".join(str(e).split())
        raise CheckpointError(f"cannot write {path} ({why[:200]})") from None


def load_checkpoint(path, device="cpu", kind=None, tokenizer=None):
    """(model, ckpt) from a checkpoint. kind: "gpt" or "scalar" to insist on one; tokenizer: a
    Tokenizer it must match. A LoRA checkpoint comes back merged (lora.merge), a plain model."""
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path}")
    if os.path.isdir(path) and is_pretrained_folder(path):
        raise CheckpointError(f"{path} is a Hugging Face model folder; a checkpoint a training "
                              f"script of this project wrote (a .pt file) is needed here")
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a folder without config.json: neither one of this "
                              f"project's checkpoints (a .pt file) nor a Hugging Face model folder")
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({e.strerror})") from None
    if head != b"PK\x03\x04":                                 # torch.save writes a zip archive
        raise CheckpointError(f"{path} is not a checkpoint: torch.save's files are zip archives "
                              f"(a Hugging Face model is given as its folder, not as a file in it)")
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()                 # each part's CRC-32: torch.load checks none
    except (zipfile.BadZipFile, OSError):
        bad = None                                  # a truncated archive: torch.load says so below
    if bad is not None:
        raise CheckpointError(f"checkpoint {path} is corrupt: its part {bad} fails its CRC check; "
                              f"delete it and re-run the script that wrote it")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} cannot be read, it is truncated or corrupt "
                              f"({type(e).__name__}: {str(e)[:200]}); delete it and re-run the "
                              f"script that wrote it") from None
    missing = [key for key in ("model", "kind", "config", "tokenizer", "step")
               if not isinstance(ckpt, dict) or key not in ckpt]
    if missing:
        raise CheckpointError(f"checkpoint {path} is not one of this project's checkpoints: it "
                              f"lacks {missing}")
    if kind is not None and ckpt["kind"] != kind:
        raise CheckpointError(f"checkpoint {path} holds a {ckpt['kind']!r} model; a {kind!r} "
                              f"model is needed here")
    unknown = set(ckpt["config"]) - {f.name for f in fields(GPTConfig)}
    if unknown:
        raise CheckpointError(f"checkpoint {path} has unknown config fields {sorted(unknown)}")
    config = GPTConfig(**ckpt["config"])
    if tokenizer is not None and (tokenizer.name != ckpt["tokenizer"]
                                  or tokenizer.vocab_size != config.support):
        raise CheckpointError(f"vocabulary mismatch: checkpoint {path} was trained with tokenizer "
                              f"{ckpt['tokenizer']!r} (vocab_size {config.vocab_size}), but "
                              f"tokenizer {tokenizer.name!r} (vocab_size {tokenizer.vocab_size}) "
                              f"is in use")
    model = ScalarGPT(config) if ckpt["kind"] == "scalar" else GPT(config)
    if ckpt.get("lora"):
        add_adapters(model, **ckpt["lora"])
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint {path}: weights do not match its config "
                              f"({str(e)[:300]})") from None
    bad = [k for k, t in ckpt["model"].items()
           if torch.is_tensor(t) and t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise CheckpointError(f"checkpoint {path}: tensor {bad[0]} holds NaN or infinite values "
                              f"({len(bad)} such tensors); delete it and re-run the script that "
                              f"wrote it")
    if ckpt.get("lora"):
        model = merge(model)
    return model.to(device), ckpt


def fingerprint(model):
    """A number that changes when any weight changes (the float64 sum of every parameter)."""
    return sum(p.detach().cpu().double().sum().item() for p in model.parameters())


# -----------------------------------------------------------------------------
# A Hugging Face folder's config: GPT-2, Llama (3.x), Qwen2, Qwen3

def is_pretrained_folder(path):
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def _finite_positive(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def pretrained_config(folder):
    """GPTConfig for a folder's config.json (model_type gpt2, llama, qwen2 or qwen3), or one
    error line. Where its tokenizer has fewer ids than the embedding has rows (Qwen2.5: 151665 of
    151936), tokenizer_vocab says so: the model's distribution is over the tokenizer's ids only."""
    config = _pretrained_config(folder)
    n = tokenizer_ids(folder)
    if 0 < n < config.vocab_size:
        config.tokenizer_vocab = n
    return config


def _pretrained_config(folder):
    path = os.path.join(folder, "config.json")
    c = read_json(path, dict)

    def num(key, default=None, kind=int):
        """config.json's `key`: a positive integer (kind float: a positive finite number)."""
        v = c.get(key, default)
        if v is None:
            raise CheckpointError(f"{path} has no {key}")
        if not _finite_positive(v) or (kind is int and not isinstance(v, int)):
            raise CheckpointError(f"{path}: {key} = {v!r}; it must be a positive "
                                  f"{'integer' if kind is int else 'finite number'}")
        return v

    def flag(key, default):
        """config.json's `key`: true or false (a string "false" is not false)."""
        v = c.get(key, default)
        if not isinstance(v, bool):
            raise CheckpointError(f"{path}: {key} = {v!r}; it must be true or false")
        return v

    kind = c.get("model_type")
    if kind == "gpt2":
        act = c.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
            raise CheckpointError(f"{folder}: activation_function {act!r} is not supported")
        config = dict(vocab_size=num("vocab_size"), block_size=num("n_positions"),
                      n_layer=num("n_layer"), n_head=num("n_head"), n_embd=num("n_embd"),
                      norm_eps=num("layer_norm_epsilon", 1e-5, float),
                      gelu="none" if act == "gelu" else "tanh",
                      mlp_hidden=num("n_inner") if c.get("n_inner") else 0,
                      tie_embeddings=flag("tie_word_embeddings", True))
    elif kind in ("llama", "qwen2", "qwen3"):
        heads, width = num("num_attention_heads"), num("hidden_size")
        for key, allowed in (("hidden_act", "silu"), ("use_sliding_window", False)):
            value = c.get(key, allowed)
            if value != allowed:
                raise CheckpointError(f"{folder}: config.json {key} = {value!r} is not supported "
                                      f"(only {allowed!r})")
        head_dim = num("head_dim", width // heads) if c.get("head_dim") is not None else 0
        attn_bias = True if kind == "qwen2" else flag("attention_bias", False)  # Qwen2: q, k, v
        config = dict(vocab_size=num("vocab_size"), block_size=num("max_position_embeddings"),
                      n_layer=num("num_hidden_layers"), n_head=heads, n_embd=width,
                      n_kv_head=num("num_key_value_heads", heads), norm="rmsnorm",
                      norm_eps=num("rms_norm_eps", kind=float), pos="rope", mlp="swiglu",
                      mlp_hidden=num("intermediate_size"), bias=flag("mlp_bias", False),
                      qkv_bias=attn_bias, o_bias=attn_bias and kind != "qwen2",   # and o_proj's
                      head_dim=0 if head_dim == width // heads else head_dim,
                      qk_norm=kind == "qwen3", tie_embeddings=flag("tie_word_embeddings", False),
                      **_rope_config(c, path))
    else:
        raise CheckpointError(f"{folder}: model_type {kind!r} is not supported; allowed: gpt2, "
                              f"llama, qwen2, qwen3")
    try:
        return GPTConfig(**config)
    except ValueError as e:                                   # e.g. heads that do not divide it
        raise CheckpointError(f"{path}: {e}") from None


def _rope_config(c, path):
    """GPTConfig's rotary fields: rope_theta, and Llama 3.1's "llama3" scaling, from rope_scaling
    (transformers 4) or rope_parameters (5); any other scaling (yarn, dynamic, ...) refused."""
    rope = c.get("rope_parameters") or {}
    rope = rope if isinstance(rope, dict) else {}
    scaling = c.get("rope_scaling") or rope
    scaling = scaling if isinstance(scaling, dict) else {"rope_type": scaling}
    kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    theta = c.get("rope_theta") or rope.get("rope_theta") or 10000.0
    if not _finite_positive(theta):
        raise CheckpointError(f"{path}: rope_theta = {theta!r}; it must be a positive finite "
                              f"number")
    if kind == "default":
        return {"rope_theta": float(theta)}
    if kind != "llama3":
        raise CheckpointError(f"{path}: rope scaling {kind!r} is not supported (only Llama 3.1's "
                              f"'llama3', or none)")
    keys = {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
            "high_freq_factor": "rope_high_freq_factor",
            "original_max_position_embeddings": "rope_original_max"}
    out = {"rope_theta": float(theta), "rope_scaling": "llama3"}
    for theirs, ours in keys.items():
        v = scaling.get(theirs)
        if not _finite_positive(v):
            raise CheckpointError(f"{path}: llama3 rope scaling {theirs} = {v!r}; it must be a "
                                  f"positive finite number")
        out[ours] = int(v) if ours == "rope_original_max" else float(v)
    return out


# -----------------------------------------------------------------------------
# Weight names: ours -> theirs, one table for both directions

# Our parameter -> the Hugging Face tensors it is, in order: several are stacked along the output
# rows (our fused c_attn holds q, k and v; c_fc holds gate and up). {i} is the layer.
NAMES = {
    "gpt2": {                                   # learned positions: GPT-2's layout
        "wte.weight": ["transformer.wte.weight"], "wpe.weight": ["transformer.wpe.weight"],
        "ln_f.weight": ["transformer.ln_f.weight"], "ln_f.bias": ["transformer.ln_f.bias"],
        "lm_head.weight": ["lm_head.weight"],
        **{f"blocks.{{i}}.{ours}.{x}": [f"transformer.h.{{i}}.{theirs}.{x}"]
           for ours, theirs in (("ln_1", "ln_1"), ("ln_2", "ln_2"), ("attn.c_attn", "attn.c_attn"),
                                ("attn.c_proj", "attn.c_proj"), ("mlp.0", "mlp.c_fc"),
                                ("mlp.2", "mlp.c_proj"))
           for x in ("weight", "bias")},
    },
    "llama": {                                  # rotary positions: Llama's, Qwen2's, Qwen3's
        "wte.weight": ["model.embed_tokens.weight"], "ln_f.weight": ["model.norm.weight"],
        "lm_head.weight": ["lm_head.weight"],
        "blocks.{i}.ln_1.weight": ["model.layers.{i}.input_layernorm.weight"],
        "blocks.{i}.ln_2.weight": ["model.layers.{i}.post_attention_layernorm.weight"],
        **{f"blocks.{{i}}.attn.c_attn.{x}": [f"model.layers.{{i}}.self_attn.{p}_proj.{x}"
                                              for p in "qkv"] for x in ("weight", "bias")},
        **{f"blocks.{{i}}.attn.c_proj.{x}": [f"model.layers.{{i}}.self_attn.o_proj.{x}"]
           for x in ("weight", "bias")},
        "blocks.{i}.attn.q_norm.weight": ["model.layers.{i}.self_attn.q_norm.weight"],
        "blocks.{i}.attn.k_norm.weight": ["model.layers.{i}.self_attn.k_norm.weight"],
        **{f"blocks.{{i}}.mlp.c_fc.{x}": [f"model.layers.{{i}}.mlp.{p}_proj.{x}"
                                           for p in ("gate", "up")] for x in ("weight", "bias")},
        **{f"blocks.{{i}}.mlp.c_proj.{x}": [f"model.layers.{{i}}.mlp.down_proj.{x}"]
           for x in ("weight", "bias")},
    },
}
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.0.weight", "mlp.2.weight")  # GPT-2's
GPT2_BUFFERS = ("attn.bias", "attn.masked_bias")              # in some GPT-2 files; not weights


def hf_names(config):
    """{our parameter name: [Hugging Face names]} for a GPT of `config`: its parameters (a tied
    LM head left out: it is the embedding), NAMES with each layer's number filled in."""
    with torch.device("meta"):
        ours = list(GPT(config).state_dict())
    table = NAMES["gpt2" if config.pos == "learned" else "llama"]
    out = {}
    for name in ours:
        if name == "lm_head.weight" and config.tie_embeddings:
            continue
        parts = name.split(".")
        i = parts[1] if parts[0] == "blocks" else None
        key = ".".join(["blocks", "{i}", *parts[2:]]) if i is not None else name
        if key not in table:
            raise CheckpointError(f"no Hugging Face name for our parameter {name}")
        out[name] = [t.replace("{i}", str(i)) for t in table[key]]
    return out


def _part_sizes(name, config):
    """The rows of each stacked part of our parameter `name`: q, k, v of c_attn; gate, up."""
    if ".c_attn." in name:
        return [config.n_head * config.head_size, *[config.kv_heads * config.head_size] * 2]
    hidden = config.mlp_hidden or 4 * config.n_embd
    return [hidden, hidden]


def hf_tensors(state, config):
    """{Hugging Face name: tensor} of a plain GPT's state_dict (export.py): the table read
    backwards, c_attn and c_fc split into their parts, GPT-2's Conv1D weights transposed."""
    out = {}
    for name, theirs in hf_names(config).items():
        t = state[name]
        if config.pos == "learned" and name.endswith(CONV1D):
            t = t.t()                                         # Conv1D stores (in, out)
        parts = t.split(_part_sizes(name, config)) if len(theirs) > 1 else [t]
        out.update(zip(theirs, parts))
    return out


# -----------------------------------------------------------------------------
# A Hugging Face folder's weights

def read_safetensors(folder):
    """Every tensor of the folder's model.safetensors, or of the shards its index lists (in the
    folder); GPT-2's names as "transformer.*", the form some files leave out."""
    index = os.path.join(folder, "model.safetensors.index.json")
    files = ["model.safetensors"]
    if os.path.isfile(index):
        shards = read_json(index, dict).get("weight_map")
        if not isinstance(shards, dict) or not all(
                isinstance(f, str) and f == os.path.basename(f) and f.endswith(".safetensors")
                for f in shards.values()):
            raise CheckpointError(f"{index}: no weight_map of tensor names to .safetensors files "
                                  f"in the folder")
        files = sorted(set(shards.values()))
    tensors = {}
    for name in files:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"{folder}: {name} is missing (only safetensors weights are "
                                  f"read)")
        try:
            tensors.update(load_file(path))
        except Exception as e:
            raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: "
                                  f"{str(e)[:200]})") from None
    return tensors


def from_pretrained(folder, dtype=torch.float32):
    """Our GPT with the weights of a Hugging Face folder, in eval mode, in `dtype` (float32, as
    this project trains; None: the checkpoint's own). Everything is checked before the model is
    built: a missing, unused, mis-shaped or non-finite tensor is one error line naming it."""
    config = pretrained_config(folder)
    hf = read_safetensors(folder)
    if config.pos == "learned":                               # GPT-2: with or without its prefix
        hf = {k if k.startswith("transformer.") or k == "lm_head.weight" else "transformer." + k: v
              for k, v in hf.items()}
    ours, used = {}, {k for k in hf if k.endswith(GPT2_BUFFERS)}
    for name, theirs in hf_names(config).items():             # the table, read forwards
        for t in theirs:
            if t not in hf:
                raise CheckpointError(f"{folder}: tensor {t} is missing from its safetensors "
                                      f"weights")
        used.update(theirs)
        ours[name] = torch.cat([hf[t] for t in theirs]) if len(theirs) > 1 else hf[theirs[0]]
        if config.pos == "learned" and name.endswith(CONV1D):
            ours[name] = ours[name].t()                       # Conv1D stores (in, out)
    if config.tie_embeddings:
        if "lm_head.weight" in hf and not torch.equal(hf["lm_head.weight"], ours["wte.weight"]):
            raise CheckpointError(f"{folder}: tensor lm_head.weight differs from the token "
                                  f"embedding, but config.json ties them (tie_word_embeddings)")
        used.add("lm_head.weight")
    unused = sorted(set(hf) - used)
    if unused:
        raise CheckpointError(f"{folder}: tensor {unused[0].removeprefix('transformer.')} is not "
                              f"used by a {config.pos}-position model ({len(unused)} unused)")
    with torch.device("meta"):                                # the shapes, before any memory
        expected = GPT(config).state_dict()
    for name, tensor in ours.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{folder}: tensor for {name} has shape {tuple(tensor.shape)}; "
                                  f"the config needs {tuple(expected[name].shape)}")
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise CheckpointError(f"{folder}: tensor for {name} holds NaN or infinite values")
    dtype = dtype or next(iter(hf.values())).dtype
    model = GPT(config)
    tied = {"lm_head.weight": ours["wte.weight"]} if config.tie_embeddings else {}
    model.load_state_dict({**ours, **tied})
    return model.to(dtype).eval()
