"""
Writes the golden files tests/test_checkpoint.py and tests/test_chat.py compare model.py against:
tiny random GPT-2, Llama, Qwen2, Llama 3 and Qwen3 checkpoints in the Hugging Face layout
(config.json, model.safetensors, tokenizer.json), each with the logits transformers computes on
fixed token ids and its greedy continuations of a left-padded batch, and the encodings of fixed
texts by the Hugging Face tokenizer. The Llama 3 folder (Llama 3.1's rope scaling, a tied head,
<|begin_of_text|> added to a plain encoding, several EOS ids) carries Llama 3.2's chat template, the
Qwen3 folder (query/key norms of weights apart from 1, head_dim apart from the width, Qwen2.5's tool
tokens added but not special, its embedding padded past its tokenizer) Qwen2.5's ChatML template
(templates/); their golden.json also holds what apply_chat_template renders and encodes for fixed
user messages, without and with a tool (for Qwen3 through templates/bare.jinja too: tags that '-'
does not trim; and templates/think.jinja, a reasoning template: a demonstration rendered whole).
Every norm's weight (and GPT-2's biases) is random, so that a norm read into the wrong place shows
in the logits. Needs transformers 5.24 or newer (its docstring parser, which hf/tools.py
follows) and tokenizers, which are not in requirements.txt (the tests read only the files this
writes); run from the repository root:

    pip install 'transformers>=5.24' && python tests/golden/make_golden.py [FAMILY ...]  # all
    pip install peft && python tests/golden/make_golden.py --peft [FAMILY ...]    # peft.json
    python tests/golden/make_golden.py --tools   # tools.json: get_json_schema of tool_functions.py
    python tests/golden/make_golden.py --game    # game_steps.json: each turn's prompt of a game

(peft.json is what export.py --peft is compared against.)

Kept small: hidden size 32, 2 layers, a 320-token byte-level BPE vocabulary (about 300 KB in all).
"""
import json
import os
import shutil

import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import processors
from transformers import (GPT2Config, GPT2LMHeadModel, GenerationConfig, LlamaConfig,
                          LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB = 320
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = ["3+4*2=4*2=8,3+8=11#11", "5,1,7:42=5+1=6,7*6=42#7*(5+1)",
          "Tom has 3 apples and buys 4 more.", "The quick brown fox jumps over the lazy dog.",
          "Question: how many? Answer: 7 #### 7", "It's they're we've I'm you'll he'd",
          "café naïve résumé 東京 😀", "  spaces   and\ttabs\nnew lines\r\n"] * 50
TEXTS = ["3+4*2=", "5,1,7:42=", "Tom has 3 apples.\nHow many?", "It's 12,345.67 dollars!",
         "café naïve", "cafe\u0301 (e + combining accent)", "東京 😀",
         "  two  spaces\tand a tab", ""]


# What the chat goldens render: a task prompt, R1's format, text with a control token in it (encoded
# as text, as apply_chat_template(..., sanitize_control_tokens=True) does), whitespace that Llama's
# template trims
CHAT_TEXTS = ["3+4*2=", "A conversation between User and Assistant. User: 5,1,7:42=. Assistant:",
              "say <|im_end|> or <|eot_id|> and stop", "  padded \n", "東京 😀",
              "call <tool_call> then </tool_call>",
              "markers \ue000<|im_start|>\ue001 \U000f0000x\U000f0001"]
# Qwen2.5's: added, not special
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# a call, the tool's reply, the next turn's prompt
TOOL_EPISODE = [{"role": "user", "content": "37+12*46="},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                 "function": {"name": "calculator", "arguments": {"expression": "12*46"}}}]},
                {"role": "tool", "content": "552"}]
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object",
                   "properties": {"expression": {"type": "string", "description": "e.g. 12*46"}},
                   "required": ["expression"]}}}]
CHAT_DATE = "26 Jul 2024"     # Llama 3.2's template writes today's date unless date_string is given
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>"]
CHATML_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train_tokenizer(style, special=None):
    """A 320-token byte-level BPE: GPT-2's pre-tokenizer, or Qwen2's (a Split regex, then ByteLevel,
    NFC first). special: special tokens to hold the first ids (the chat folders), else <|endoftext|>
    as the last id."""
    tok = Tokenizer(models.BPE())
    if style == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - (0 if special else 1),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=special or [])
    tok.train_from_iterator(CORPUS, trainer)
    if not special:
        tok.add_special_tokens(["<|endoftext|>"])
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    if special == LLAMA3_SPECIAL:        # Llama 3's post-processor: <|begin_of_text|> before a text
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", bos)])
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                       eos_token="<|eot_id|>")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")


def chat_goldens(tokenizer, **template):
    """What transformers renders and encodes for each CHAT_TEXTS user message with the generation
    prompt (control tokens in the message sanitised), without and with TOOLS, and for a user and an
    assistant message (where the assistant's turn ends). template: chat_template=<source> for
    another template than the tokenizer's."""
    out = {}
    for name, tools in (("messages", None), ("with_tools", TOOLS)):
        out[name] = []
        for text in CHAT_TEXTS:
            messages = [{"role": "user", "content": text}]
            kw = dict(add_generation_prompt=True, date_string=CHAT_DATE, tools=tools, **template)
            out[name].append({"content": text,
                              "rendered": tokenizer.apply_chat_template(messages, tokenize=False,
                                                                        **kw), "ids": list(
                tokenizer.apply_chat_template(messages, tokenize=True, sanitize_control_tokens=True,
                                              return_dict=False, **kw))})
    turn = [{"role": "user", "content": "3+4*2="},
            {"role": "assistant", "content": "4*2=8,3+8=11#11"}]
    out["assistant_turn"] = tokenizer.apply_chat_template(turn, tokenize=False,
                                                          date_string=CHAT_DATE, **template)
    kw = dict(add_generation_prompt=True, date_string=CHAT_DATE, tools=TOOLS, **template)
    out["tool_reply"] = {
        "messages": TOOL_EPISODE, "rendered": tokenizer.apply_chat_template(TOOL_EPISODE,
                                                                            tokenize=False, **kw),
        "ids": list(tokenizer.apply_chat_template(TOOL_EPISODE, tokenize=True, return_dict=False,
                                                  sanitize_control_tokens=True, **kw))}
    return out


def randomise_norms(model):
    """Every LayerNorm / RMSNorm weight uniform in [0.5, 1.5], every norm bias N(0, 0.1^2): at 1 and
    0 (their initial values) a norm read into the wrong place, or skipped, would not show."""
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("Norm"):
                module.weight.uniform_(0.5, 1.5)
                if getattr(module, "bias", None) is not None:
                    module.bias.normal_(0.0, 0.1)


def think_golden(tokenizer):
    """templates/think.jinja's rendering of a demonstration (a call, its reply, the answer) with
    TOOLS, whole: what ChatTools.demonstration must cut into pieces."""
    source = open(os.path.join(HERE, "templates", "think.jinja")).read()
    messages = [{"role": "user", "content": "37+12*46="}, *TOOL_EPISODE[1:],
                {"role": "assistant", "content": "#589"}]
    kw = dict(tools=TOOLS, chat_template=source)
    return {"messages": messages,
            "rendered": tokenizer.apply_chat_template(messages, tokenize=False, **kw),
            "ids": list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                                      sanitize_control_tokens=True, **kw))}


def make(name, model, tokenizer, template=None, eos_ids=None):
    """The folder tests/golden/<name>: the model and tokenizer as save_pretrained writes them, and
    the goldens. template: a chat template file in templates/ (written as chat_template.jinja);
    eos_ids: generation_config.json's eos_token_id (else that file is left out)."""
    folder = os.path.join(HERE, name)
    shutil.rmtree(folder, ignore_errors=True)
    randomise_norms(model)
    model.eval()
    if template:
        tokenizer.chat_template = open(os.path.join(HERE, "templates", template)).read()
    if eos_ids:
        model.generation_config = GenerationConfig(eos_token_id=eos_ids,
                                                   bos_token_id=model.config.bos_token_id)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    for extra in ("special_tokens_map.json", "generation_config.json"):
        if os.path.exists(os.path.join(folder, extra)) and not (extra == "generation_config.json"
                                                                and eos_ids):
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
        out = model.generate(input_ids=batch, attention_mask=mask, max_new_tokens=8,
                             do_sample=False, pad_token_id=eos, eos_token_id=eos)[:, T:]
        # the smallest gap between the two largest logits along the greedy path: how far from a tie
        # every pick was
        scores = model(torch.cat([batch, out], 1),
                       attention_mask=torch.cat([mask, torch.ones_like(out)], 1)).logits
        top2 = scores[:, T - 1:-1].topk(2, dim=-1).values
        margin = (top2[..., 0] - top2[..., 1]).min().item()
    assert margin > 1e-3, f"{name}: greedy path within {margin} of a tie; change the seed"
    save_file({"ids": ids, "logits": logits, "prompt": batch, "prompt_mask": mask.float(),
               "greedy": out.contiguous()}, os.path.join(folder, "golden.safetensors"))
    encodings = {t: tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS}
    golden = {"encodings": encodings, "eos_id": eos, "greedy_margin": margin,
              "with_special_tokens": {t: tokenizer(t)["input_ids"] for t in TEXTS[:3]}}
    if template:
        golden["chat"] = chat_goldens(tokenizer)
    if name == "qwen3":     # a template of bare and indented tags: Jinja's trim and lstrip settings
        source = open(os.path.join(HERE, "templates", "bare.jinja")).read()
        golden["chat_bare"] = chat_goldens(tokenizer, chat_template=source)
        golden["chat_think"] = think_golden(tokenizer)
    with open(os.path.join(folder, "golden.json"), "w") as f:
        json.dump(golden, f, indent=0, ensure_ascii=False)
    print(f"{name}: "
          f"{sum(os.path.getsize(os.path.join(folder, x)) for x in os.listdir(folder)) / 1e3:.0f} "
          f"KB, greedy margin {margin:.4f}")


def main(names):
    torch.manual_seed(0)        # the first three families as they were first written, in this order
    gpt2_tok, qwen_tok = train_tokenizer("gpt2"), train_tokenizer("qwen2")
    eos = gpt2_tok.eos_token_id
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2,
                                       n_head=4, initializer_range=0.3, bos_token_id=eos,
                                       eos_token_id=eos))
    if "gpt2" in names:
        make("gpt2", model, gpt2_tok)
    eos = qwen_tok.eos_token_id
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  initializer_range=0.3)
    model = LlamaForCausalLM(LlamaConfig(**common, rms_norm_eps=1e-6, rope_theta=500000.0,
                                         tie_word_embeddings=False, bos_token_id=eos,
                                         eos_token_id=eos))
    if "llama" in names:
        make("llama", model, qwen_tok)
    model = Qwen2ForCausalLM(Qwen2Config(**common, rms_norm_eps=1e-6, rope_theta=1000000.0,
                                         tie_word_embeddings=True, bos_token_id=eos,
                                         eos_token_id=eos))
    if "qwen2" in names:
        make("qwen2", model, qwen_tok)
    torch.manual_seed(1)
    tok = train_tokenizer("qwen2", LLAMA3_SPECIAL)
    ids = {t: tok.convert_tokens_to_ids(t) for t in LLAMA3_SPECIAL}
    # Llama 3.2 Instruct lists three; two are enough here
    eos_ids = [ids["<|end_of_text|>"], ids["<|eot_id|>"]]
    # Llama 3.1's rope scaling with a pre-training context of 16: of the 4 frequencies of a head of
    # 8 channels at theta 500000, one is between the two wavelength bounds (interpolated), three
    # above (stretched 8 times)
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    model = LlamaForCausalLM(
        LlamaConfig(**common, rms_norm_eps=1e-5, rope_parameters=rope, tie_word_embeddings=True,
                    bos_token_id=ids["<|begin_of_text|>"], eos_token_id=eos_ids))
    if "llama3" in names:
        make("llama3", model, tok, "llama3.jinja", eos_ids)
    torch.manual_seed(2)
    tok = train_tokenizer("qwen2", CHATML_SPECIAL)
    tok.add_tokens(TOOL_TOKENS)     # ids 320-323; the embedding is padded to 336 rows, as Qwen2.5's
    ids = {t: tok.convert_tokens_to_ids(t) for t in CHATML_SPECIAL}
    model = Qwen3ForCausalLM(
        Qwen3Config(**{**common, "vocab_size": VOCAB + 16}, head_dim=16, rms_norm_eps=1e-6,
                    rope_theta=1000000.0, tie_word_embeddings=True,
                    bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"]))
    if "qwen3" in names:       # (q/k norm weights apart from 1: the norm and the rotation do not
        # commute then, so their order shows in the logits)
        make("qwen3", model, tok, "chatml.jinja", [ids["<|im_end|>"], ids["<|endoftext|>"]])


PEFT_TARGETS = {"gpt2": ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"], "llama": [
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def peft_golden(name):
    """peft.json in a family's folder: the tensor names and shapes of the adapter folder PEFT writes
    for rank-2 adapters on every projection, and its adapter_config.json (what export.py --peft must
    match). Reads the folder's model; changes no other file."""
    import tempfile
    from peft import LoraConfig, get_peft_model
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    folder = os.path.join(HERE, name)
    targets = PEFT_TARGETS["gpt2" if name == "gpt2" else "llama"]
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(folder),
                           LoraConfig(r=2, lora_alpha=8, target_modules=targets,
                                      fan_in_fan_out=name == "gpt2", task_type="CAUSAL_LM"))
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        with safe_open(os.path.join(tmp, "adapter_model.safetensors"), "pt") as f:
            tensors = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        config = json.load(open(os.path.join(tmp, "adapter_config.json")))
    config["base_model_name_or_path"] = f"tests/golden/{name}"
    with open(os.path.join(folder, "peft.json"), "w") as f:
        json.dump({"targets": targets, "tensors": tensors, "adapter_config": config}, f, indent=1,
                  sort_keys=True)
    print(f"{name}: peft.json, {len(tensors)} adapter tensors")


# A game of multiturn.py (tasks/guess.py) as chat messages: each guess an assistant turn (the first
# with reasoning before its answer), each answer a user turn
GAME = [{"role": "user", "content": "#3916 1-15?"},
        {"role": "assistant", "content": "<think>\nthe middle\n</think>\n\n8"},
        {"role": "user", "content": "higher"}, {"role": "assistant", "content": "12"},
        {"role": "user", "content": "higher"}, {"role": "assistant", "content": "14"},
        {"role": "user", "content": "higher"}]


def game_golden():
    """game_steps.json: for the Llama 3 and Qwen3 folders (their own templates, and Qwen3's with
    templates/history.jinja, which drops earlier reasoning), the ids apply_chat_template gives the
    prompt of each turn of GAME: the messages before it, with the generation prompt."""
    out = {}
    for name, template in (("llama3", None), ("qwen3", None), ("qwen3", "history.jinja")):
        tok = PreTrainedTokenizerFast.from_pretrained(os.path.join(HERE, name))
        kw = {"date_string": "26 Jul 2024"}            # Llama 3.2's; the others ignore it
        if template is not None:
            kw["chat_template"] = open(os.path.join(HERE, "templates", template)).read()
        steps = [GAME[:k] for k in range(1, len(GAME) + 1, 2)]
        out[f"{name}/{template or 'own'}"] = [
            {"messages": m, "ids": list(tok.apply_chat_template(
                m, tokenize=True, add_generation_prompt=True, return_dict=False, **kw))}
            for m in steps]
    with open(os.path.join(HERE, "game_steps.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"game_steps.json: {sum(map(len, out.values()))} step prompts")


def tools_golden():
    """tools.json: transformers' get_json_schema of each function of tool_functions.py."""
    from transformers.utils import get_json_schema
    import tool_functions
    schemas = {f.__name__: get_json_schema(f) for f in tool_functions.FUNCTIONS}
    with open(os.path.join(HERE, "tools.json"), "w") as f:
        json.dump(schemas, f, indent=1)
    print(f"tools.json: {len(schemas)} schemas")


if __name__ == "__main__":
    import sys
    if tuple(map(int, transformers.__version__.split(".")[:2])) < (5, 24):
        raise SystemExit(f"transformers {transformers.__version__}: 5.24 or newer is needed (its "
                         f"get_json_schema reads 'name (type):' docstring lines as hf/tools.py "
                         f"does)")
    names = [a for a in sys.argv[1:] if a not in ("--peft", "--tools", "--game")] or [
        "gpt2", "llama", "qwen2", "llama3", "qwen3"]
    if "--tools" in sys.argv:                  # the tool schemas alone
        sys.path.insert(0, HERE)
        tools_golden()
    elif "--game" in sys.argv:             # the game's step prompts alone, from the folders
        game_golden()
    elif "--peft" in sys.argv:             # the adapter goldens alone, from the folders as they are
        for name in names:
            peft_golden(name)
    else:
        main(names)
