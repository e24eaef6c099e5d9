"""
The tokenizer every script shares: text to ids and back, the ids that end a completion, and how
a prompt is encoded (after a folder's BOS, or through its chat template).

- "bytes", the default: one token per byte plus <|endoftext|> and <|pad|>, built in code, so
  everything runs offline. "bytes-chat" adds ChatML's control tokens and the call tags, and a chat
  template in Qwen2.5's shape (CHAT_TEMPLATE): the toy model learns the tool protocol of real
  ones. A named tiktoken encoding ("gpt2") works where tiktoken can load it.
- A Hugging Face folder's byte-level BPE tokenizer.json (GPT-2, Llama 3, Qwen2/3) read into a
  tiktoken Encoding: its ranks, its pre-tokenizer's split pattern, its added tokens; EOS, the stop
  ids and pad from the folder's configs; the chat template, run by hf/chat.py (--chat).

A downloaded folder is untrusted input: every file is read with a size bound, checked for its
type, and refused in one line naming it (CheckpointError). A checkpoint keeps the sha256 of its
folder's tokenizer files (tokenizer_files): the folder must still hold the same when it is used.
"""
import hashlib
import json
import os
import re
import unicodedata

import regex                                    # tiktoken's own dependency
import tiktoken
import torch

from hf.chat import ChatTemplate, ChatTemplateError

EOS = "<|endoftext|>"
PAD = "<|pad|>"
MAX_JSON_BYTES = 256 * 2 ** 20     # the largest JSON file of a folder read (tokenizer.json: ~10 MB)
MAX_TEMPLATE_BYTES = 2 ** 20       # the longest chat template read (Llama 3.x's: 5 KB)
MAX_SPACE_RUN = 100_000            # tiktoken's split regexes overflow their stack near a million
LONG_SPACE_RUN = re.compile(rf"\s{{{MAX_SPACE_RUN + 1}}}")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "tokenizer.model", "generation_config.json")
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")   # "bytes-chat"
CHAT_TEMPLATE = (       # Qwen2.5's shape, compact: tools in the system turn, calls as JSON in tags
    "{%- if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }}("
    "{{ t.function.parameters.properties | join(',') }})\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': "
    "c.function.arguments} | tojson(separators=(',', ':')) }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DIGIT = regex.compile(r"(\p{N})")                 # tokenizers' Digits(individual_digits=True)
GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class CheckpointError(RuntimeError):
    """A checkpoint, or a file of a model folder, that cannot be used: one line says why."""


class Tokenizer:
    """A tiktoken encoding plus what the scripts need: eos_id (what ends a demonstration),
    stop_ids (every id that ends a completion, eos_id first), pad_id, and encode_prompt."""

    def __init__(self, name="bytes"):
        self.normalise, self.bos_prefix, self.template, self.chat = None, [], None, None
        self.digits, self.lacking, self.split = False, b"", None   # a folder's (_read_folder)
        self.files = None                       # a folder's tokenizer files: {name: sha256}
        if name.startswith("hf:"):              # a Hugging Face folder (from_pretrained)
            self._read_folder(name)
            return
        if name in ("bytes", "bytes-chat"):
            ranks = {bytes([i]): i for i in range(256)}   # no merges: one token per byte
            pat_str = r"[\s\S]{1,256}"          # with no merges any split works; this covers all
            special = {}
        else:
            try:
                base = tiktoken.get_encoding(name)
            except Exception as e:
                raise ValueError(f"tokenizer {name!r} could not be loaded by tiktoken "
                                 f"({type(e).__name__}: {e}); the default 'bytes' needs no "
                                 f"download") from None
            ranks, pat_str = base._mergeable_ranks, base._pat_str
            special = dict(base._special_tokens)
        next_id = max([*ranks.values(), *special.values()]) + 1
        for tok in (EOS, PAD):
            if tok not in special:
                special[tok] = next_id
                next_id += 1
        if name == "bytes-chat":
            special.update({t: next_id + i for i, t in enumerate(CHAT_TOKENS)})
            self.template = (CHAT_TEMPLATE, special, set(special), {"eos_token": EOS})
        self.name = name
        self.enc = tiktoken.Encoding(name=f"{name}+pad", pat_str=pat_str, mergeable_ranks=ranks,
                                     special_tokens=special)
        self.eos_id, self.pad_id = special[EOS], special[PAD]
        self.stop_ids = (self.eos_id,)
        self.vocab_size = self.enc.n_vocab

    def _read_folder(self, name):
        folder = name[3:]
        ranks, (pat_str, self.digits), special, self.normalise, self.bos_prefix, marked = \
            pretrained_tokenizer_parts(folder)
        self.lacking = bytes(b for b in range(256) if bytes([b]) not in ranks)
        self.name, (self.eos_id, self.pad_id) = name, pretrained_eos_pad(folder, special)
        try:
            self.enc = tiktoken.Encoding(name=os.path.basename(os.path.abspath(folder)),
                                         pat_str=pat_str, mergeable_ranks=ranks,
                                         special_tokens=special)
        except Exception as e:                  # e.g. a split pattern that does not compile
            why = " ".join(str(e).split())[:200]
            raise CheckpointError(f"{folder}: tokenizer.json cannot be read as a tokenizer "
                                  f"({type(e).__name__}: {why})") from None
        self.vocab_size = self.enc.n_vocab
        if self.digits or self.lacking:         # the pieces are cut here (_ordinary)
            self.split = regex.compile(pat_str)
            self.specials = regex.compile("|".join(
                regex.escape(t) for t in sorted(special, key=len, reverse=True)))
        self.stop_ids = pretrained_stop_ids(folder, self.eos_id)
        for i in self.stop_ids:
            if not 0 <= i < self.vocab_size:    # every completion would run to its limit
                raise CheckpointError(f"{folder}: eos_token_id {i} is not an id of its tokenizer "
                                      f"(0 to {self.vocab_size - 1})")
        self.template = pretrained_chat_template(folder, special, marked)
        self.files = tokenizer_files(folder)

    @classmethod
    def from_pretrained(cls, folder):
        """The tokenizer of a Hugging Face folder."""
        return cls("hf:" + os.path.abspath(folder))

    def encode(self, text):
        """Plain text to ids. Special-token strings in the text are encoded as ordinary text."""
        return self._encode(text, self._ordinary)

    def encode_special(self, text):
        """Text to ids with the added tokens (<|im_start|>, ...) recognised as their ids."""
        if self.split is None:
            return self._encode(text, lambda t: self.enc.encode(t, allowed_special="all"))
        return self._encode(text, self._with_special)

    def _with_special(self, text):
        ids, start = [], 0
        for m in self.specials.finditer(text) if self.enc._special_tokens else ():
            ids += self._ordinary(text[start:m.start()]) + [self.enc._special_tokens[m.group()]]
            start = m.end()
        return ids + self._ordinary(text[start:])

    def _ordinary(self, text):
        """encode_ordinary, as the Hugging Face tokenizer splits and merges: a Digits step first
        (SmolLM's: each digit a piece of its own, DIGIT), then the split regex; a byte the
        vocabulary lacks (SmolLM's 21: bytes UTF-8 never uses, and \\x04 \\x06 \\x13 \\x14 \\x16
        \\x1d) is dropped from its piece, as tokenizers' BPE drops a symbol it has no id for
        when the model has no unk_token."""
        if self.split is None:
            return self.enc.encode_ordinary(text)
        ids = []
        for part in DIGIT.split(text) if self.digits else [text]:
            data = part.encode("utf-8", "surrogatepass")
            if len(data.translate(None, self.lacking)) == len(data):
                ids += self.enc.encode_ordinary(part) if part else []
                continue
            for piece in self.split.findall(part):
                kept = piece.encode("utf-8", "surrogatepass").translate(None, self.lacking)
                ids += self.enc._encode_single_piece(kept) if kept else []
        return ids

    def _encode(self, text, encode):
        """encode(text), or a ValueError saying why the tokenizer cannot take the text (its callers
        name the flag or file): a whitespace run past MAX_SPACE_RUN is refused before tiktoken,
        whose regex would panic on it, and any failure of tiktoken's, a Rust panic included."""
        if self.normalise:
            text = unicodedata.normalize(self.normalise, text)
        if len(text) > MAX_SPACE_RUN and LONG_SPACE_RUN.search(text):
            raise ValueError(f"a text of {len(text):,} characters with a run of more than "
                             f"{MAX_SPACE_RUN:,} whitespace characters (the tokenizer takes at "
                             f"most {MAX_SPACE_RUN:,} in a row)")
        try:
            return encode(text)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:                # pyo3's PanicException is a BaseException
            raise ValueError(f"the tokenizer cannot encode a text of {len(text):,} characters "
                             f"({type(e).__name__}: {str(e)[:200]})") from None

    def encode_prompt(self, text):
        """A prompt's ids: the user's message through the chat template (use_chat), else the
        text after the BOS the folder puts first (Llama 3's <|begin_of_text|>; most have none)."""
        if self.chat is not None:
            return self.chat.encode([{"role": "user", "content": text}], self.encode_special,
                                    self.encode)
        return self.bos_prefix + self.encode(text)

    def use_chat(self, date=None):
        """--chat: prompts through the folder's chat template from now on; the end of an
        assistant turn it writes (<|im_end|>, <|eot_id|>) becomes eos_id and the first stop id.
        date: the day strftime_now writes (ISO; None: today), fixed for a run."""
        where = self.name.removeprefix("hf:")
        if self.template is None:
            raise CheckpointError(f"--chat: tokenizer {where!r} has no chat template (a Hugging "
                                  f"Face folder's chat_template.jinja or tokenizer_config.json "
                                  f"chat_template); run without --chat")
        try:
            self.chat = ChatTemplate(*self.template, date=date)
            self.chat.check()                   # a template that fails fails now, in one line
            end = self.chat.end_of_turn()
            self.encode_prompt("")
        except ChatTemplateError as e:
            self.chat = None
            raise CheckpointError(f"--chat: {where}: {e}") from None
        if end is not None:
            self.eos_id = self.template[1][end]
            self.stop_ids = (self.eos_id, *[i for i in self.stop_ids if i != self.eos_id])
        return self

    @property
    def added_ids(self):
        """The ids of the added tokens (<|endoftext|>, <|pad|>; a folder's <|im_start|>, ...)."""
        return frozenset(self.enc._special_tokens.values())

    def decode(self, ids):
        """Ids to text. An id the tokenizer lacks (an embedding row past it) reads as U+FFFD, as
        undecodable bytes do: decoding never raises on what a model can emit."""
        ids = list(ids)
        try:
            return self.enc.decode(ids, errors="replace")
        except (KeyError, ValueError, OverflowError, TypeError):   # an id tiktoken lacks
            known = {*self.enc._mergeable_ranks.values(), *self.enc._special_tokens.values()}
            pieces, run = [], []
            for i in ids:
                if i in known:
                    run.append(i)
                else:
                    pieces += [self.enc.decode_bytes(run), "\ufffd".encode()]
                    run = []
            text = b"".join([*pieces, self.enc.decode_bytes(run)])
            return text.decode("utf-8", errors="replace")

    def encode_batch(self, texts, device="cpu"):
        """Prompts (encode_prompt), left-padded: tokens (B, T) int64, mask (B, T) 1.0 on real."""
        ids = [self.encode_prompt(t) for t in texts]
        T = max((len(x) for x in ids), default=0)
        tokens = torch.full((len(ids), T), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(ids), T)
        for i, x in enumerate(ids):
            if x:
                tokens[i, T - len(x):] = torch.tensor(x)
                mask[i, T - len(x):] = 1.0
        return tokens.to(device), mask.to(device)

    def decode_completions(self, tokens, mask):
        """(B, T) completion tokens and their mask -> B strings, the stop token dropped."""
        texts = []
        for row, m in zip(tokens.tolist(), mask.tolist()):
            texts.append(self.decode([t for t, keep in zip(row, m)
                                      if keep and t not in self.stop_ids]))
        return texts


# -----------------------------------------------------------------------------
# A Hugging Face folder's tokenizer files

def read_json(path, kind=None):
    """The JSON in `path`, or one error line: unreadable, larger than MAX_JSON_BYTES, nested too
    deeply, or (kind) not of that type."""
    try:
        if os.path.getsize(path) > MAX_JSON_BYTES:
            raise CheckpointError(f"{path} is larger than {MAX_JSON_BYTES >> 20} MB; not read")
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else f"{type(e).__name__}: {e}"
        raise CheckpointError(f"{path} cannot be read ({why})") from None
    if kind is not None and not isinstance(data, kind):
        raise CheckpointError(f"{path} is not a JSON {'object' if kind is dict else kind.__name__}")
    return data


def bytes_to_unicode():
    """GPT-2's byte-level BPE alphabet (Radford et al. 2019): byte b -> the character standing
    for it in tokenizer.json; printable bytes stand for themselves, the rest for 256, 257, ..."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}


def tokenizer_ids(folder):
    """How many ids the folder's tokenizer.json has (its largest id + 1), 0 without one."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        return 0
    data = read_json(path, dict)
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    vocab = model.get("vocab") if isinstance(model.get("vocab"), dict) else {}
    added = [t.get("id") for t in data.get("added_tokens") or [] if isinstance(t, dict)]
    return max((i + 1 for i in [*vocab.values(), *added] if isinstance(i, int)), default=0)


def pretrained_tokenizer_parts(folder):
    """(mergeable ranks, split pattern, added tokens {text: id}, normalise, BOS prefix ids, the
    added tokens marked special) of a folder's byte-level BPE tokenizer.json. The BOS prefix: the
    special tokens its post-processor puts before a text (Llama 3: <|begin_of_text|>)."""
    path = os.path.join(folder, "tokenizer.json")
    data = read_json(path, dict)
    model = data.get("model") or {}
    if not isinstance(model, dict) or model.get("type") != "BPE" or \
            not isinstance(model.get("vocab"), dict):
        kind = model.get("type") if isinstance(model, dict) else model
        raise CheckpointError(f"{path}: model type {kind!r}, or no vocab; only a byte-level BPE "
                              f"tokenizer is read")
    added = data.get("added_tokens") or []
    ids = [*model["vocab"].values(), *(t.get("id") if isinstance(t, dict) else t for t in added)]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids) or \
            not all(isinstance(t, dict) and isinstance(t.get("content"), str) for t in added):
        raise CheckpointError(f"{path}: a token id that is not a non-negative integer, or an "
                              f"added token without its content")
    if len(set(model["vocab"].values())) < len(model["vocab"]) or \
            len({t["id"] for t in added}) < len(added):
        raise CheckpointError(f"{path}: two tokens share an id")
    to_byte = {ch: b for b, ch in bytes_to_unicode().items()}
    try:
        ranks = {bytes(to_byte[ch] for ch in token): i for token, i in model["vocab"].items()}
    except KeyError:
        raise CheckpointError(f"{folder}: tokenizer.json is not byte-level (a vocabulary entry "
                              f"outside GPT-2's byte alphabet)") from None
    pattern, digits = _split_pattern(data, path, folder)
    normaliser = data.get("normalizer") or {}
    normaliser = normaliser.get("type") if isinstance(normaliser, dict) else normaliser
    if normaliser not in (None, "NFC"):
        raise CheckpointError(f"{folder}: tokenizer.json normalizer {normaliser!r} is not "
                              f"supported (none or NFC)")
    special = {t["content"]: t["id"] for t in added}
    marked = {t["content"] for t in added if t.get("special")}
    return ranks, (pattern, digits), special, normaliser, _bos_prefix(data, path), marked


def _split_pattern(data, path, folder):
    """(the pre-tokenizer's split regex: a Split step's, or GPT-2's for a ByteLevel one; whether
    a Digits step first puts every digit apart, as SmolLM's and StarCoder's do)."""
    pre = data.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if isinstance(pre, dict) else None
    if not isinstance(steps, list) or not all(isinstance(x, dict) for x in steps):
        raise CheckpointError(f"{path}: pre_tokenizer is not an object (or a Sequence of objects)")
    digits = [s for s in steps if s.get("type") == "Digits"]
    if digits and (steps[0] is not digits[0] or digits[0].get("individual_digits") is not True):
        raise CheckpointError(f"{path}: a Digits pre-tokenizer is read only as the first step "
                              f"with individual_digits true")
    splits = [s["pattern"]["Regex"] for s in steps
              if s.get("type") == "Split" and "Regex" in s.get("pattern", {})]
    if splits:
        return splits[0], bool(digits)
    if any(s.get("type") == "ByteLevel" and s.get("use_regex", True) for s in steps):
        return GPT2_SPLIT, bool(digits)
    raise CheckpointError(f"{folder}: tokenizer.json pre-tokenizer {pre.get('type')!r} is not "
                          f"supported")


def _bos_prefix(data, path):
    """The ids a TemplateProcessing post-processor puts before a single text."""
    post = data.get("post_processor") or {}
    if not isinstance(post, dict):
        raise CheckpointError(f"{path}: post_processor is not an object")
    steps = [p for p in (post.get("processors") or [post]) if isinstance(p, dict)]
    template = next((p for p in steps if p.get("type") == "TemplateProcessing"), {})
    prefix = []
    for piece in template.get("single") or []:
        if "Sequence" in piece:
            break
        token = (piece.get("SpecialToken") or {}).get("id")
        ids = ((template.get("special_tokens") or {}).get(token) or {}).get("ids")
        if not (isinstance(ids, list) and all(isinstance(i, int) for i in ids)):
            raise CheckpointError(f"{path}: post_processor special token {token!r} has no ids")
        prefix += ids
    return prefix


def tokenizer_files(folder):
    """{name: sha256} of the folder's files that decide how text becomes ids and where a
    completion stops (TOKENIZER_FILES)."""
    out = {}
    for name in TOKENIZER_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            try:
                with open(path, "rb") as f:
                    out[name] = hashlib.sha256(f.read()).hexdigest()
            except OSError as e:
                raise CheckpointError(f"{path} cannot be read ({e.strerror})") from None
    return out


def pretrained_stop_ids(folder, eos):
    """Every id that ends a completion, `eos` first: generation_config.json's and config.json's
    eos_token_id, an id or a list (Qwen2.5-Instruct: <|im_end|>, <|endoftext|>)."""
    ids = [eos]
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(folder, name)
        data = read_json(path) if os.path.isfile(path) else {}
        value = data.get("eos_token_id") if isinstance(data, dict) else None
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and not isinstance(i, bool) and i not in ids:
                ids.append(i)
    return tuple(ids)


def pretrained_chat_template(folder, special, marked):
    """(source, added tokens, special ones, variables) for chat.ChatTemplate, or None: the
    folder's chat_template.jinja, else tokenizer_config.json's chat_template (a string, or named
    templates: "default"); variables: bos_token, eos_token, ... as the template reads them."""
    path = os.path.join(folder, "tokenizer_config.json")
    config = read_json(path, dict) if os.path.isfile(path) else {}
    source = config.get("chat_template")
    if isinstance(source, list):
        source = next((t.get("template") for t in source
                       if isinstance(t, dict) and t.get("name") == "default"), None)
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        try:
            if os.path.getsize(jinja) > MAX_TEMPLATE_BYTES:
                raise CheckpointError(f"{jinja} is larger than {MAX_TEMPLATE_BYTES >> 20} MB; it "
                                      f"is not read")
            with open(jinja, encoding="utf-8") as f:
                source = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{jinja} cannot be read ({type(e).__name__}: {e})") from None
    if isinstance(source, str) and len(source) > MAX_TEMPLATE_BYTES:
        raise CheckpointError(f"{path}: chat_template is longer than {MAX_TEMPLATE_BYTES >> 20} MB")
    if not isinstance(source, str):
        return None
    content = lambda t: t.get("content") if isinstance(t, dict) else t
    variables = {k: content(config.get(k)) for k in ("bos_token", "eos_token", "unk_token",
                                                      "pad_token")
                 if isinstance(content(config.get(k)), str)}
    return source, special, marked, variables


def pretrained_eos_pad(folder, special):
    """(eos_id, pad_id): EOS from generation_config.json or config.json, else the eos_token of
    tokenizer_config.json (a folder holding a tokenizer only); pad: tokenizer_config.json's
    pad_token, else EOS (padding is masked out everywhere here: any id serves)."""
    eos = None
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(folder, name)
        if eos is None and os.path.isfile(path):
            data = read_json(path)
            eos = data.get("eos_token_id") if isinstance(data, dict) else None
    eos = eos[0] if isinstance(eos, list) and eos else eos
    path = os.path.join(folder, "tokenizer_config.json")
    tokens = read_json(path, dict) if os.path.isfile(path) else {}
    content = lambda t: t.get("content") if isinstance(t, dict) else t
    if eos is None:
        eos = special.get(content(tokens.get("eos_token")))
    if not isinstance(eos, int) or isinstance(eos, bool):
        raise CheckpointError(f"{folder}: no integer eos_token_id in generation_config.json or "
                              f"config.json, and no eos_token of tokenizer.json's in "
                              f"tokenizer_config.json")
    return eos, special.get(content(tokens.get("pad_token")), eos)
