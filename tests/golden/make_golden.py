"""
Writes the golden files tests/test_pretrained.py compares model.py against: tiny random GPT-2, Llama and Qwen2
checkpoints in the Hugging Face layout (config.json, model.safetensors, tokenizer.json), each with the logits
transformers computes on fixed token ids and its greedy continuations of a left-padded batch, and the encodings of
fixed texts by the Hugging Face tokenizer. Needs transformers and tokenizers, which are not in requirements.txt (the
tests read only the files this writes); run from the repository root:

    pip install transformers && python tests/golden/make_golden.py

Kept small: hidden size 32, 2 layers, a 320-token byte-level BPE vocabulary (about 200 KB in all).
"""
import json
import os
import shutil

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,
                          Qwen2Config, Qwen2ForCausalLM)

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB = 320
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
              r"\s+(?!\S)|\s+")
CORPUS = ["3+4*2=4*2=8,3+8=11#11", "5,1,7:42=5+1=6,7*6=42#7*(5+1)", "Tom has 3 apples and buys 4 more.",
          "The quick brown fox jumps over the lazy dog.", "Question: how many? Answer: 7 #### 7",
          "It's they're we've I'm you'll he'd", "café naïve résumé 東京 😀", "  spaces   and\ttabs\nnew lines\r\n"] * 50
TEXTS = ["3+4*2=", "5,1,7:42=", "Tom has 3 apples.\nHow many?", "It's 12,345.67 dollars!", "café naïve",
         "cafe\u0301 (e + combining accent)", "東京 😀", "  two  spaces\tand a tab", ""]


def train_tokenizer(style):
    """A 320-token byte-level BPE: GPT-2's pre-tokenizer, or Qwen2's (a Split regex, then ByteLevel, NFC first)."""
    tok = Tokenizer(models.BPE())
    if style == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(["<|endoftext|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def make(name, model, tokenizer):
    folder = os.path.join(HERE, name)
    shutil.rmtree(folder, ignore_errors=True)
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    for extra in ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if extra != "tokenizer_config.json" and os.path.exists(os.path.join(folder, extra)):
            os.remove(os.path.join(folder, extra))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB - 1, (2, 12), generator=g)
    with torch.no_grad():
        logits = model(ids).logits.float()                                    # (2, 12, V)
        prompts = [tokenizer(t)["input_ids"] for t in ("3+4*2=", "Tom has 3 apples", "x")]
        T = max(map(len, prompts))
        eos = tokenizer.eos_token_id
        batch = torch.tensor([[eos] * (T - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(input_ids=batch, attention_mask=mask, max_new_tokens=8, do_sample=False,
                             pad_token_id=eos, eos_token_id=eos)[:, T:]
        # the smallest gap between the two largest logits along the greedy path: how far from a tie every pick was
        scores = model(torch.cat([batch, out], 1), attention_mask=torch.cat([mask, torch.ones_like(out)], 1)).logits
        top2 = scores[:, T - 1:-1].topk(2, dim=-1).values
        margin = (top2[..., 0] - top2[..., 1]).min().item()
    assert margin > 1e-3, f"{name}: greedy path within {margin} of a tie; change the seed"
    save_file({"ids": ids, "logits": logits, "prompt": batch, "prompt_mask": mask.float(), "greedy": out.contiguous()},
              os.path.join(folder, "golden.safetensors"))
    encodings = {t: tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS}
    with open(os.path.join(folder, "golden.json"), "w") as f:
        json.dump({"encodings": encodings, "eos_id": eos, "greedy_margin": margin}, f, indent=0, ensure_ascii=False)
    print(f"{name}: {sum(os.path.getsize(os.path.join(folder, x)) for x in os.listdir(folder)) / 1e3:.0f} KB, "
          f"greedy margin {margin:.4f}")


def main():
    torch.manual_seed(0)
    gpt2_tok, qwen_tok = train_tokenizer("gpt2"), train_tokenizer("qwen2")
    eos = gpt2_tok.eos_token_id
    make("gpt2", GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                            initializer_range=0.3, bos_token_id=eos, eos_token_id=eos)), gpt2_tok)
    eos = qwen_tok.eos_token_id
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.3, bos_token_id=eos,
                  eos_token_id=eos)
    make("llama", LlamaForCausalLM(LlamaConfig(**common, rms_norm_eps=1e-6, rope_theta=500000.0,
                                               tie_word_embeddings=False)), qwen_tok)
    make("qwen2", Qwen2ForCausalLM(Qwen2Config(**common, rms_norm_eps=1e-6, rope_theta=1000000.0,
                                               tie_word_embeddings=True)), qwen_tok)


if __name__ == "__main__":
    main()
