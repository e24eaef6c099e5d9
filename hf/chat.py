"""
Chat templates: a prompt rendered through a checkpoint's own chat template and encoded, as
transformers' `apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
sanitize_control_tokens=True)` does.

An instruct model was tuned on its template's text (Qwen2.5: "<|im_start|>user\n{prompt}
<|im_end|>\n<|im_start|>assistant\n"). The template, a Jinja program from the checkpoint's folder,
runs in Jinja's sandbox with what transformers gives it: trim/lstrip blocks, loop controls,
raise_exception, strftime_now, a tojson keeping non-ASCII text, and `tools` and `documents`. The
special tokens it writes become special ids; none in a message or a tool's schema can (each is
wrapped in transformers' markers, U+F0000 and U+F0001, before rendering and encoded as text after).
`end_of_turn` finds what follows an assistant message (<|im_end|>, <|eot_id|>): the tokenizer
stops on it, demonstrations end with it.

Where this differs from transformers:
- strftime_now reads a date fixed per run (`date`, kept in the checkpoint), not the clock: Llama
  3.2's template writes "Today Date", and a run resumed on another day must see the prompts it
  trained on.
- A downloaded template is untrusted code, compiled and rendered in a worker process
  (hf/sandbox.py: MEMORY of address space, killed at COMPILE_SECONDS or RENDER_SECONDS), never in
  the run's. A source past MAX_SOURCE_CHARS is refused unread; a template that takes more than
  PROBE_SECONDS to render one message at load, or whose renders take more than a minute plus a
  tenth of the run's time (BUDGET), is refused. Renders are cached per distinct input. Inside
  the worker, a string, list or integer built past MAX_CHARS or MAX_INT is refused where it can
  be seen before it is built, and an attribute the sandbox refuses raises instead of rendering
  as "". Every failure, a Python error inside the template included, is one ChatTemplateError.
"""
import functools
import hashlib
import json
import re
import time
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hf import sandbox

START, END = "\U000f0000", "\U000f0001"   # transformers' markers around a message's control token
PROBE = "\U000f0002"                     # a message's content while end_of_turn looks past it
MAX_SOURCE_CHARS = 256 * 1024            # the longest template compiled (real ones: 1 to 20 KB)
COMPILE_SECONDS = 5.0                    # compiling it (a real one: a few milliseconds)
RENDER_SECONDS = 5.0                     # one render's time (a real one: a millisecond)
PROBE_SECONDS = 0.5                      # one message's render at load
BUDGET = (60.0, 0.1)                     # all renders: at most 60 s plus this share of the run
MEMORY = 2 ** 30                         # the worker's address space
MAX_CHARS = 1_000_000                    # the longest text, list or rendering a template may build
MAX_INT = 100_000                        # the largest integer argument (Jinja's range cap)
CACHE = 4096                             # renders kept, per template


class ChatTemplateError(ValueError):
    pass


# -----------------------------------------------------------------------------
# The worker's side (hf/sandbox.py runs these): transformers' Jinja sandbox, sizes bounded

class _Generation(jinja2.ext.Extension):
    """{% generation %} (transformers' tag around the assistant's tokens): renders its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _check_size(value):
    """value, or SecurityError where it is a text or list longer than MAX_CHARS or an integer of
    more bits."""
    if isinstance(value, (str, list, tuple)) and len(value) > MAX_CHARS:
        raise SecurityError(f"the template builds a {type(value).__name__} of {len(value):,} "
                            f"items (at most {MAX_CHARS:,})")
    if isinstance(value, int) and value.bit_length() > MAX_CHARS:
        raise SecurityError("the template builds an integer of more than a million bits")
    return value


def _check_arguments(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_INT:
            raise SecurityError(f"the template calls with the argument {a} (at most {MAX_INT:,})")


def _check_format(fmt, args=()):
    """A format string (str.format, the format filter, %) whose field widths stay below a million
    characters."""
    if isinstance(fmt, str) and (re.search(r"\d{7,}", fmt) or "*" in fmt and any(
            isinstance(a, int) and abs(a) > MAX_INT for a in args)):
        raise SecurityError("the template formats a field a million characters wide or more")


def _bounded(f, is_format=False):
    """A filter or global with its integer arguments and its result bounded."""
    @functools.wraps(f)                       # keeps jinja_pass_arg (pass_context, ...)
    def call(*args, **kwargs):
        _check_arguments(args, kwargs)
        if is_format and args:
            _check_format(args[0], args[1:])
        return _check_size(f(*args, **kwargs))
    return call


class _Environment(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with sizes bounded (module docstring)."""
    intercepted_binops = frozenset(["*", "+", "%", "**"])

    def call_binop(self, context, operator, left, right):
        sized = lambda x: isinstance(x, (str, list, tuple))
        if operator == "*" and sized(left) != sized(right):             # 'a' * n, [x] * n
            seq, n = (left, right) if sized(left) else (right, left)
            if isinstance(n, int) and len(seq) * n > MAX_CHARS:
                raise SecurityError(f"the template repeats a {type(seq).__name__} {n:,} times")
        if operator == "+" and sized(left) and sized(right) and \
                len(left) + len(right) > MAX_CHARS:
            raise SecurityError(f"the template builds a {type(left).__name__} past {MAX_CHARS:,} "
                                f"items")
        if operator == "%":
            _check_format(left, right if isinstance(right, tuple) else (right,))
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and \
                right * max(abs(left), 1).bit_length() > MAX_CHARS:
            raise SecurityError(f"the template raises to the power {right:,}")
        return _check_size(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):             # Jinja's own signature
        _check_arguments(args, kwargs)
        if getattr(__obj, "__name__", None) in ("format", "format_map"):   # str.format (wrapped)
            _check_format(getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None))
        return _check_size(super().call(__context, __obj, *args, **kwargs))

    def unsafe_undefined(self, obj, attribute):
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} "
                            f"object is unsafe")


_TEMPLATES = {}                          # in the worker: key -> (template, variables)


def _compile(key, source, variables, date):
    """Compile `source` under `key`; the literal texts it writes (where its control tokens are)."""
    env = _Environment(trim_blocks=True, lstrip_blocks=True,
                       extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters = {name: _bounded(f, name == "format") for name, f in env.filters.items()}
    env.filters["tojson"] = _bounded(_tojson)
    when = datetime.fromisoformat(date)

    def strftime_now(fmt):
        if not isinstance(fmt, str):
            raise TypeError(f"strftime_now takes a format string, not {type(fmt).__name__}")
        return when.strftime(fmt)
    env.globals.update(raise_exception=_raise, strftime_now=strftime_now,
                       lipsum=_bounded(env.globals["lipsum"]))
    ast = env.parse(source)
    _TEMPLATES[key] = (env.from_string(source), variables)
    return sorted({n.data for n in ast.find_all(jinja2.nodes.TemplateData)}
                  | {n.value for n in ast.find_all(jinja2.nodes.Const) if isinstance(n.value, str)})


def _render(key, messages, add_generation_prompt, kwargs):
    template, variables = _TEMPLATES[key]
    pieces, n = [], 0
    for piece in template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                   **{**variables, **kwargs}):
        pieces.append(piece)
        n += len(piece)
        if n > MAX_CHARS:
            raise SecurityError(f"the template writes more than {MAX_CHARS:,} characters")
    return "".join(pieces)


WORKER_OPS = {"compile": _compile, "render": _render}


# -----------------------------------------------------------------------------
# The run's side

class ChatTemplate:
    """source: the Jinja text; added: {text: id} of the added tokens, special: the special ones;
    variables: bos_token, eos_token, ...; date: what strftime_now formats (a datetime, or an ISO
    date; None: today)."""

    def __init__(self, source, added, special, variables, date=None):
        if len(source) > MAX_SOURCE_CHARS:
            raise ChatTemplateError(f"the chat template is {len(source):,} characters long (at "
                                    f"most {MAX_SOURCE_CHARS:,}; a real one: 1 to 20 thousand)")
        if isinstance(date, str):
            date = datetime.fromisoformat(date)
        self.date = date or datetime.now()
        setup = {"source": source, "variables": variables, "date": self.date.isoformat()}
        self.key = hashlib.sha256(json.dumps(setup, sort_keys=True).encode()).hexdigest()
        try:
            literals = _worker().setup("compile", {"key": self.key, **setup}, COMPILE_SECONDS)
        except sandbox.Timeout as e:
            raise ChatTemplateError(f"the chat template did not compile within "
                                    f"{COMPILE_SECONDS:g} s" + (f" ({e})" if str(e) else "")
                                    ) from None
        except (sandbox.Failed, sandbox.Died) as e:    # a syntax error, the parser's recursion
            raise ChatTemplateError(f"the chat template does not compile ({e})") from None
        literals = "\0".join(literals)
        control = [t for t in added if t in special or (t in literals and not t.isspace())]
        longest_first = "|".join(map(re.escape, sorted(control, key=len, reverse=True))) or "(?!)"
        self.control_re = re.compile(longest_first)
        self.marked_re = re.compile(f"{START}({longest_first}){END}|[{START}{END}]")
        self.cache, self.spent, self.born = {}, 0.0, time.monotonic()

    def render(self, messages, add_generation_prompt=True, **kwargs):
        """The template's text for `messages` ([{"role", "content"}]); kwargs reach the template
        (tools=..., date_string=...)."""
        kwargs = {"tools": None, "documents": None, **kwargs}
        key = json.dumps([messages, add_generation_prompt, kwargs])
        if key in self.cache:
            return self.cache[key]
        elapsed = time.monotonic() - self.born
        if self.spent > BUDGET[0] + BUDGET[1] * elapsed:
            raise ChatTemplateError(f"the chat template has spent {self.spent:.0f} s rendering in "
                                    f"{elapsed:.0f} s (at most {BUDGET[0]:g} s plus "
                                    f"{BUDGET[1]:.0%} of the run; a real one takes milliseconds)")
        t = time.monotonic()
        try:
            text = _worker().request("render", {"key": self.key, "messages": messages,
                                                "add_generation_prompt": add_generation_prompt,
                                                "kwargs": kwargs}, RENDER_SECONDS)
        except sandbox.Timeout as e:
            raise ChatTemplateError(f"the chat template did not finish rendering within "
                                    f"{RENDER_SECONDS:g} s" + (f" ({e})" if str(e) else "")
                                    ) from None
        except (sandbox.Failed, sandbox.Died) as e:    # TemplateError, SecurityError, Python's
            raise ChatTemplateError(f"the chat template fails to render ({e})") from None
        finally:
            self.spent += time.monotonic() - t
        if len(self.cache) >= CACHE:
            del self.cache[next(iter(self.cache))]      # the oldest
        self.cache[key] = text
        return text

    def encode(self, messages, encode, encode_text, add_generation_prompt=True, **kwargs):
        """Token ids of the rendered messages; encode: text -> ids with special tokens, encode_text:
        plain text."""
        text = self.render(self._mark(messages), add_generation_prompt, **self._mark(kwargs))
        return self._ids(text, encode, encode_text)

    def encode_after_turn(self, messages, encode, encode_text, **kwargs):
        """The ids the template writes after the end of the assistant turn whose content is PROBE,
        through the next generation prompt: what an environment writes after the model's turn
        (its tool messages, a user's next message), the model's own end of turn excluded."""
        text = self.render(self._mark(messages), True, **self._mark(kwargs))
        at, end = text.find(PROBE), self.end_of_turn()
        m = self.control_re.search(text, at + 1) if at >= 0 else None
        if m is None or m.group(0) != end:
            raise ChatTemplateError(f"the chat template writes no {end or 'end of turn'} right "
                                    f"after an assistant message followed by another message")
        return self._ids(text[m.end():], encode, encode_text)

    def _mark(self, x):
        """Every string in x (messages, tools' schemas) with its control tokens wrapped in the
        markers."""
        if isinstance(x, dict):
            return {k: self._mark(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [self._mark(v) for v in x]
        if not isinstance(x, str):
            return x
        x = x.replace(START, "").replace(END, "")                        # no forged markers
        return self.control_re.sub(lambda m: START + m.group(0) + END, x)

    def _ids(self, text, encode, encode_text):
        pieces = self.marked_re.split(text)                # text, token, text, ...
        ids = []
        try:
            for i, piece in enumerate(pieces):
                if piece:
                    ids += encode_text(piece) if i % 2 else encode(piece)
        except ValueError as e:                            # the tokenizer's: a text it cannot take
            raise ChatTemplateError(f"the chat template's text cannot be tokenised ({e})") from None
        return ids

    @functools.cache
    def end_of_turn(self):
        """The control token the template writes right after an assistant message, or None."""
        text = self.render([{"role": "user", "content": "1"},
                            {"role": "assistant", "content": PROBE}], False)
        after = text[text.find(PROBE) + len(PROBE):] if PROBE in text else ""
        m = self.control_re.match(after)
        return m.group(0) if m else None

    def check(self):
        """ChatTemplateError unless a user message renders, within PROBE_SECONDS, with its text in
        what the template writes."""
        t = time.monotonic()
        text = self.render([{"role": "user", "content": PROBE}])
        took = time.monotonic() - t
        if took > PROBE_SECONDS:
            raise ChatTemplateError(f"the chat template takes {took:.1f} s to render one message "
                                    f"(at most {PROBE_SECONDS:g} s; a real one takes milliseconds)")
        if PROBE not in text:
            raise ChatTemplateError(f"the chat template does not write the user's message (a "
                                    f"probe message rendered as {text[:80]!r})")


def _worker():
    return sandbox.worker(__name__, MEMORY)


def demonstration(tok, prompt, messages, **kwargs):
    """(prompt ids, [(ids, written by the environment)]) of a demonstration in `tok`'s chat
    template: the user's `prompt`, then `messages`, the whole conversation as the template renders
    it (transformers' apply_chat_template; kwargs reach it: tools=...), cut where each assistant
    turn begins (after the generation prompt the template writes there) and ends (its end of turn,
    the last id of its piece). ValueError for a template whose conversation does not begin with
    that generation prompt."""
    encode = lambda m, **kw: tok.chat.encode(m, tok.encode_special, tok.encode, **kwargs, **kw)
    user, pieces = {"role": "user", "content": prompt}, []
    full = encode([user, *messages], add_generation_prompt=False)
    opening = at = len(encode([user]))
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = encode([user, *messages[:i]])
        if full[:len(head)] != head or tok.eos_id not in full[len(head):]:
            raise ValueError(f"{tok.name}: its template writes an assistant message "
                             f"differently after a generation prompt")
        if len(head) > at:
            pieces.append((full[at:len(head)], True))
        at = full.index(tok.eos_id, len(head)) + 1
        pieces.append((full[len(head):at], False))
    if at < len(full) and messages and messages[-1]["role"] != "assistant":
        pieces.append((full[at:], True))
    return full[:opening], pieces
