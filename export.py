"""
Export: a checkpoint of this project as a Hugging Face folder, for transformers, vLLM and the rest.

    python export.py out/grpo.pt out/grpo-hf           # config, weights, tokenizer, generation
    python export.py out/grpo.pt out/grpo-lora --peft  # a LoRA run's adapters, as PEFT writes

    AutoModelForCausalLM.from_pretrained("out/grpo-hf")  # or: vllm serve out/grpo-hf
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), "out/grpo-lora")

The weights go back to their family's layout on the Hub (model_type gpt2, llama, qwen2, qwen3)
through hf/checkpoint.py's table of names, the one loading reads: c_attn split into q_proj, k_proj,
v_proj (c_fc into gate_proj, up_proj), GPT-2's Conv1D weights transposed, a tied head left out. A
checkpoint trained from a Hugging Face folder (--init) keeps that folder's config.json (its dtype
the export's), tokenizer files, chat template and generation_config.json, checked to be the ones
it was trained with. One trained from the byte tokenizer gets a config.json of the family its parts
fit (sft.py's: gpt2) and a tokenizer.json that encodes as the byte tokenizer does.

A LoRA checkpoint is exported merged (W + (alpha / r) B A, lora.merge) unless --peft asks for the
adapter folder (PEFT's names and config, the --init folder as base, float32 as PEFT saves them).
Weights past --max_shard_size go to numbered shards with an index, as save_pretrained writes. The
folder is written whole under a temporary name and renamed: a failed or interrupted export leaves
nothing behind, and the next export to that place removes a killed one's leftovers.
"""
import argparse
import json
import math
import os
import shutil
import signal
import sys

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from hf.checkpoint import (CheckpointError, from_pretrained, hf_tensors, load_checkpoint,
                           pretrained_config)
from hf.tokenizer import EOS, PAD, TOKENIZER_FILES, bytes_to_unicode, read_json, tokenizer_files
from lora import add_adapters, base_model
from model import GPT, GPTConfig

MODEL_TYPES = ("gpt2", "llama", "qwen2", "qwen3")
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
PEFT_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj",
              "up": "up_proj", "down": "down_proj"}                   # Llama, Qwen2, Qwen3
GPT2_PEFT_NAMES = {"qkv": "attn.c_attn", "o": "attn.c_proj", "up": "mlp.c_fc", "down": "mlp.c_proj"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# -----------------------------------------------------------------------------
# Which model_type a config can be, and its config.json

def fits(config, model_type):
    """None if a model of `config` is a `model_type` model, else what differs."""
    c = config
    if model_type == "gpt2":
        wrong = [c.pos != "learned" and "rotary positions", c.norm != "layernorm" and "RMSNorm",
                 c.mlp != "gelu" and "a SwiGLU MLP",
                 not (c.bias and c.qkv_bias and c.o_bias in (None, True))
                 and "projections without biases",
                 c.kv_heads != c.n_head and "grouped-query attention",
                 c.head_dim not in (0, c.n_embd // c.n_head) and "a separate head_dim",
                 c.qk_norm and "q/k norms"]
    else:
        o_bias = c.bias if c.o_bias is None else c.o_bias
        wrong = [c.pos != "rope" and "learned positions", c.norm != "rmsnorm" and "LayerNorm",
                 c.mlp != "swiglu" and "a GELU MLP", c.bias and "MLP biases",
                 model_type == "qwen2" and not (c.qkv_bias and not o_bias)
                 and "not Qwen2's q/k/v biases",
                 model_type == "qwen2" and c.head_dim not in (0, c.n_embd // c.n_head)
                 and "a separate head_dim",
                 model_type != "qwen2" and c.qkv_bias != o_bias
                 and "q/k/v biases without an o_proj bias",
                 (model_type == "qwen3") != c.qk_norm
                 and ("no q/k norms" if c.qk_norm is False else "q/k norms"),
                 model_type != "llama" and c.rope_scaling != "none" and "Llama 3's rope scaling"]
    wrong = [w for w in wrong if w]
    return None if not wrong else ", ".join(wrong)


def infer_model_type(config):
    for model_type in ("gpt2", "qwen3", "qwen2", "llama"):
        if fits(config, model_type) is None:
            return model_type
    return None


def hf_config(config, model_type, dtype, eos_id, pad_id):
    """config.json for a model with no source folder: the keys transformers reads for it."""
    c = config
    if model_type == "gpt2":
        out = dict(n_positions=c.block_size, n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd,
                   n_inner=c.mlp_hidden or None, layer_norm_epsilon=c.norm_eps,
                   activation_function="gelu_new" if c.gelu == "tanh" else "gelu",
                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, n_ctx=c.block_size)
    else:
        out = dict(hidden_size=c.n_embd, intermediate_size=c.mlp_hidden or 4 * c.n_embd,
                   num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
                   num_key_value_heads=c.kv_heads, max_position_embeddings=c.block_size,
                   rms_norm_eps=c.norm_eps, hidden_act="silu", rope_theta=c.rope_theta,
                   attention_dropout=0.0)
        if model_type != "qwen2":                     # Qwen2: q/k/v biases always, no head_dim
            out.update(head_dim=c.head_size, attention_bias=c.qkv_bias)
        if model_type != "llama":
            out.update(use_sliding_window=False)
        if model_type == "llama":
            out.update(mlp_bias=c.bias)
        if c.rope_scaling == "llama3":
            out["rope_scaling"] = {"rope_type": "llama3", "factor": c.rope_factor,
                                   "low_freq_factor": c.rope_low_freq_factor,
                                   "high_freq_factor": c.rope_high_freq_factor,
                                   "original_max_position_embeddings": c.rope_original_max}
    return {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
            "vocab_size": c.vocab_size, **out, "tie_word_embeddings": c.tie_embeddings,
            "bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": pad_id,
            "torch_dtype": dtype, "use_cache": True}


# -----------------------------------------------------------------------------
# PEFT's adapter folder

def peft_tensors(state, model_type):
    """{PEFT name: tensor} of a LoRA checkpoint's adapters: base_model.model.<module>.lora_A.weight
    (r, in) and lora_B.weight (out, r), per q/k/v/gate/up part on Llama-family models (each part
    its own module there)."""
    out = {}
    for name, tensor in state.items():
        if ".lora_A." not in name and ".lora_B." not in name:
            continue
        layer, kind, part = name.rsplit(".", 2)                 # blocks.0.attn.c_attn, lora_A, q
        i = int(layer.split(".")[1])
        if model_type == "gpt2":
            module = f"transformer.h.{i}.{GPT2_PEFT_NAMES[part]}"
        else:
            where = "mlp" if part in ("gate", "up", "down") else "self_attn"
            module = f"model.layers.{i}.{where}.{PEFT_NAMES[part]}"
        out[f"base_model.model.{module}.{kind}.weight"] = tensor
    return out


def peft_config(lora, model_type, base):
    names = GPT2_PEFT_NAMES if model_type == "gpt2" else PEFT_NAMES
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "r": lora["rank"], "lora_alpha": lora["alpha"], "lora_dropout": 0.0, "bias": "none",
            "use_rslora": False, "fan_in_fan_out": model_type == "gpt2",   # Conv1D: (in, out)
            "target_modules": sorted(names[t] for t in lora["targets"]),
            "init_lora_weights": True, "modules_to_save": None, "inference_mode": True}


# -----------------------------------------------------------------------------
# Files

def write_weights(folder, tensors, max_shard_bytes, metadata=None):
    """model.safetensors, or shards of at most max_shard_bytes (a larger tensor alone) with
    their index."""
    shards, size = [{}], 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name], size = t.contiguous(), size + n
    if len(shards) == 1:
        return save_file(shards[0], os.path.join(folder, "model.safetensors"), metadata=metadata)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(folder, name), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_json(folder, "model.safetensors.index.json",
               {"metadata": {"total_size": total}, "weight_map": weight_map})


def write_json(folder, name, data):
    with open(os.path.join(folder, name), "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def byte_tokenizer(block_size):
    """tokenizer.json and tokenizer_config.json that encode as Tokenizer("bytes"): byte-level BPE
    without merges (one token per byte, id = the byte), <|endoftext|> and <|pad|> added."""
    alphabet = bytes_to_unicode()
    added = [{"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, text in ((256, EOS), (257, PAD))]
    split = {"type": "Split", "pattern": {"Regex": r"[\s\S]{1,256}"}, "behavior": "Isolated",
             "invert": False}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": False}
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
             "ignore_merges": False, "vocab": {alphabet[b]: b for b in range(256)}, "merges": []}
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
                 "normalizer": None,
                 "pre_tokenizer": {"type": "Sequence", "pretokenizers": [split, byte_level]},
                 "post_processor": None, "decoder": {**byte_level, "type": "ByteLevel"},
                 "model": model}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": PAD,
              "bos_token": EOS, "model_max_length": block_size,
              "clean_up_tokenization_spaces": False}
    return tokenizer, config


# -----------------------------------------------------------------------------
# The export

def parse_size(text):
    units = {"KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "B": 1}
    for unit, scale in units.items():
        if text.upper().endswith(unit):
            try:
                value = float(text[:-len(unit)])
            except ValueError:
                break
            if math.isfinite(value * scale) and value > 0:
                return max(1, int(value * scale))
            break
    raise argparse.ArgumentTypeError(f"{text!r} is not a size (allowed: a positive number and a "
                                     f"unit: 500MB, 5GB)")


def plan(args):
    """Everything checked before a file is written: (ckpt, model, model_type, source folder or
    None, its config.json as a dict, dtype name)."""
    if os.path.islink(args.out):
        raise SystemExit(f"error: {args.out} is a symbolic link; allowed: a new or empty "
                         f"folder")
    if os.path.exists(args.out) and (not os.path.isdir(args.out) or os.listdir(args.out)):
        raise SystemExit(f"error: {args.out} exists and is not an empty folder; allowed: a new or "
                         f"empty folder")
    try:
        model, ckpt = load_checkpoint(args.checkpoint)
    except CheckpointError as e:
        raise SystemExit(f"error: {e}") from None
    if ckpt["kind"] != "gpt":
        raise SystemExit(f"error: {args.checkpoint} holds a {ckpt['kind']!r} model (a reward model "
                         f"or verifier); allowed: a policy (kind 'gpt'), which has a causal-LM "
                         f"layout to export to")
    if args.peft and not ckpt.get("lora"):
        raise SystemExit(f"error: --peft, but {args.checkpoint} has no LoRA adapters (trained "
                         f"without --lora_rank); export it without --peft")
    name = ckpt["tokenizer"]
    source = name[3:] if name.startswith("hf:") else None
    if source is not None and not os.path.isfile(os.path.join(source, "config.json")):
        raise SystemExit(f"error: {args.checkpoint} was trained from {source}, which is gone; its "
                         f"tokenizer files are copied from there (restore the folder, or "
                         f"re-download it to that path)")
    if source is None and name != "bytes":
        raise SystemExit(f"error: {args.checkpoint} uses tiktoken's {name!r} encoding, which has "
                         f"no tokenizer.json here; allowed: checkpoints trained from a Hugging "
                         f"Face folder or the byte tokenizer")
    if source:
        check_tokenizer(ckpt, source, args.checkpoint)
    source_config = read_json(os.path.join(source, "config.json"), dict) if source else {}
    theirs = source_config.get("model_type")
    if source and args.model_type and args.model_type != theirs:
        raise SystemExit(f"error: --model_type {args.model_type}: {args.checkpoint} was trained "
                         f"from {source}, a {theirs} model; allowed: its own")
    model_type = args.model_type or (theirs if source else infer_model_type(model.config))
    if model_type is None or fits(model.config, model_type) is not None:
        why = fits(model.config, model_type) if model_type else "no family has all its parts"
        flag = f"--model_type {args.model_type}: " if args.model_type else ""
        raise SystemExit(f"error: {flag}{args.checkpoint} cannot be a "
                         f"{model_type or 'Hugging Face'} model ({why}); allowed: --model_type "
                         f"{infer_model_type(model.config) or 'none fits'}")
    if source and GPTConfig(**{**vars(pretrained_config(source)),
                               "tokenizer_vocab": model.config.tokenizer_vocab}) != model.config:
        raise SystemExit(f"error: {args.checkpoint}'s architecture differs from its source folder "
                         f"{source}")
    if args.peft and not base_is_source(ckpt, source):
        raise SystemExit(f"error: --peft: the adapters of {args.checkpoint} sit on weights that "
                         f"are not {source or 'a Hugging Face folder'}'s (trained before the "
                         f"adapters, e.g. an sft.pt); a PEFT folder names its base model: export "
                         f"merged (without --peft)")
    dtype = args.dtype
    if dtype == "auto" and args.peft:
        dtype = "float32"                                     # as PEFT saves adapters
    elif dtype == "auto":
        dtype = source_config.get("torch_dtype") or source_config.get("dtype") or "float32"
        dtype = dtype if dtype in DTYPES else "float32"
    return ckpt, model, model_type, source, source_config, dtype


def check_tokenizer(ckpt, source, checkpoint):
    """The source folder's tokenizer files are those the checkpoint was trained with (the sha256
    it keeps), or one line; an older checkpoint, keeping none, needs the folder's tokenizer.json."""
    saved, now = ckpt.get("tokenizer_files"), tokenizer_files(source)
    if saved is None and "tokenizer.json" not in now:
        raise SystemExit(f"error: {checkpoint} was trained with the tokenizer of {source}, which "
                         f"has no tokenizer.json now; restore the folder as it was")
    if saved is not None and saved != now:
        differ = sorted(k for k in {*saved, *now} if saved.get(k) != now.get(k))
        raise SystemExit(f"error: {checkpoint} was trained with the tokenizer of {source}, whose "
                         f"{', '.join(differ)} changed since (edited, added or removed); the "
                         f"export would not encode text as the model was trained to: restore the "
                         f"folder as it was")


def cast(tensors, dtype):
    """{name: tensor in dtype}, or one line naming a tensor that does not fit (float16: 65504)."""
    out = {}
    for name, t in tensors.items():
        out[name] = t.to(DTYPES[dtype])
        if not torch.isfinite(out[name]).all() and torch.isfinite(t).all():
            raise SystemExit(f"error: tensor {name} does not fit {dtype} (its largest value is "
                             f"{t.abs().max().item():.3g}); allowed: --dtype float32 or bfloat16")
    return out


def leftovers(out):
    """Remove the temporary folders of exports to `out` that were killed (their process gone)."""
    parent, stem = os.path.dirname(out) or ".", os.path.basename(out) + ".tmp"
    for name in os.listdir(parent):
        pid = name[len(stem):]
        if name.startswith(stem) and pid.isdigit() and int(pid) != os.getpid():
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
            except PermissionError:
                pass


def base_is_source(ckpt, source):
    """Whether a LoRA checkpoint's frozen weights are exactly its source folder's (float32)."""
    if source is None:
        return False
    model = add_adapters(GPT(GPTConfig(**ckpt["config"])), **ckpt["lora"])
    model.load_state_dict(ckpt["model"])
    theirs = from_pretrained(source).state_dict()
    return all(torch.equal(t, theirs[n]) for n, t in base_model(model).state_dict().items())


def write(tmp, args, ckpt, model, model_type, source, source_config, dtype, weights):
    """Every file of the export into the folder `tmp`."""
    if args.peft:
        save_file({k: v.contiguous() for k, v in weights.items()},
                  os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
        write_json(tmp, "adapter_config.json", peft_config(ckpt["lora"], model_type, source or ""))
    else:
        write_weights(tmp, weights, args.max_shard_size, metadata={"format": "pt"})
        if source:
            config = dict(source_config)
            config.pop("torch_dtype", None)
            config.update({"dtype" if "dtype" in source_config else "torch_dtype": dtype})
            write_json(tmp, "config.json", config)
        else:
            write_json(tmp, "config.json", hf_config(model.config, model_type, dtype, 256, 257))
    if source:
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(source, name)):
                shutil.copy(os.path.join(source, name), os.path.join(tmp, name))
    else:
        tokenizer, config = byte_tokenizer(model.config.block_size)
        write_json(tmp, "tokenizer.json", tokenizer)
        write_json(tmp, "tokenizer_config.json", config)
        write_json(tmp, "generation_config.json",
                   {"bos_token_id": 256, "eos_token_id": 256, "pad_token_id": 257})
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(tmp):                              # readable as a user's files are
        os.chmod(os.path.join(tmp, name), 0o666 & ~umask)


def export(args):
    try:
        ckpt, model, model_type, source, source_config, dtype = plan(args)
    except CheckpointError as e:                              # a source that no longer reads
        raise SystemExit(f"error: {e}") from None
    tensors = (peft_tensors(ckpt["model"], model_type) if args.peft
               else hf_tensors(model.state_dict(), model.config))
    weights = cast(tensors, dtype)
    out = os.path.abspath(args.out)
    tmp = f"{out}.tmp{os.getpid()}"
    try:
        leftovers(out)
        os.makedirs(tmp)
        write(tmp, args, ckpt, model, model_type, source, source_config, dtype, weights)
        if os.path.isdir(out):
            os.rmdir(out)                                     # empty: checked
        os.replace(tmp, out)
    except (OSError, SafetensorError) as e:                  # safetensors': a full disk too
        shutil.rmtree(tmp, ignore_errors=True)
        why = e.strerror if isinstance(e, OSError) and e.strerror else " ".join(str(e).split())
        raise SystemExit(f"error: cannot write {args.out} ({why[:200]})") from None
    except BaseException:                                     # Ctrl-C, SIGTERM: nothing left
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    what = "LoRA adapters (PEFT)" if args.peft else f"{model_type} weights in {dtype}"
    print(f"wrote {args.out}: {what}, {len(tensors)} tensors, "
          f"{sum(t.numel() for t in tensors.values()) / 1e6:.2f}M parameters"
          + (f"; base model {source}" if args.peft else "")
          + (f"; tokenizer from {source}" if source and not args.peft else "")
          + ("; the byte tokenizer as tokenizer.json" if not source else ""))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint a training script wrote (out/grpo.pt, ...)")
    p.add_argument("out", help="the folder to write (new or empty)")
    p.add_argument("--peft", action="store_true",
                   help="write the LoRA adapters as a PEFT adapter folder, not merged weights")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                   help="the weights' dtype; auto: the --init folder's (config.json's "
                        "torch_dtype), else float32; --peft: float32")
    p.add_argument("--model_type", choices=MODEL_TYPES, default=None,
                   help="the Hugging Face family; default: the --init folder's, or the one the "
                        "architecture fits")
    p.add_argument("--max_shard_size", type=parse_size, default="5GB",
                   help="largest weight file; more weights go to numbered shards with an index "
                        "(default 5GB)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as Ctrl-C: nothing left behind
    try:
        export(args)
    except KeyboardInterrupt:
        raise SystemExit("export.py: interrupted; nothing was written") from None


if __name__ == "__main__":
    sys.exit(main())
