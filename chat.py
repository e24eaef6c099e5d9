"""
Chat templates: a prompt rendered through a checkpoint's own chat template and encoded, as
transformers' `apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
sanitize_control_tokens=True)` does.

An instruct model was tuned on its template's text (Qwen2.5: "<|im_start|>user\n{prompt}
<|im_end|>\n<|im_start|>assistant\n"). The template, a Jinja program from the checkpoint's folder,
runs in Jinja's sandbox with what transformers gives it: trim/lstrip blocks, loop controls,
raise_exception, strftime_now, a tojson keeping non-ASCII text, and `tools` and `documents` (None
here). The special tokens it writes become special ids; none in a message can (each is wrapped in
transformers' markers, U+F0000 and U+F0001, before rendering and encoded as text after).
`end_of_turn` finds what follows an assistant message (<|im_end|>, <|eot_id|>): the tokenizer
stops on it, demonstrations end with it.

Where this differs from transformers:
- strftime_now reads a date fixed per run (`date`, kept in the checkpoint), not the clock: Llama
  3.2's template writes "Today Date", and a run resumed on another day must see the prompts it
  trained on.
- A downloaded template is untrusted input. A render gets RENDER_SECONDS (in the main thread) and
  writes at most MAX_CHARS; a string, list or integer it builds past that size is refused before it
  is built (`*`, `+`, `%`, `**`, a call or filter with an integer argument above MAX_INT); an
  attribute the sandbox refuses raises instead of rendering as "". Every failure, a Python error
  inside the template included, is one ChatTemplateError.
"""
import functools
import json
import re
import signal
import threading
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

START, END = "\U000f0000", "\U000f0001"   # transformers' markers around a message's control token
PROBE = "\U000f0002"                     # a message's content while end_of_turn looks past it
RENDER_SECONDS = 5.0                     # one render's time (a real template takes a millisecond)
MAX_CHARS = 1_000_000                    # the longest text, list or rendering a template may build
MAX_INT = 100_000                        # the largest integer argument (Jinja's range cap)


class ChatTemplateError(ValueError):
    pass


class Timeout(BaseException):              # not an Exception: nothing inside Jinja catches it
    pass


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


class ChatTemplate:
    """source: the Jinja text; added: {text: id} of the added tokens, special: the special ones;
    variables: bos_token, eos_token, ...; date: what strftime_now formats (a datetime, or an ISO
    date; None: today)."""

    def __init__(self, source, added, special, variables, date=None):
        env = _Environment(trim_blocks=True, lstrip_blocks=True,
                           extensions=[_Generation, jinja2.ext.loopcontrols])
        env.filters = {name: _bounded(f, name == "format") for name, f in env.filters.items()}
        env.filters["tojson"] = _bounded(_tojson)
        if isinstance(date, str):
            date = datetime.fromisoformat(date)
        self.date = date or datetime.now()
        env.globals.update(raise_exception=_raise, strftime_now=self.strftime_now,
                           lipsum=_bounded(env.globals["lipsum"]))
        try:
            ast = env.parse(source)
            self.template = env.from_string(source)
        except Exception as e:                         # a syntax error, or the parser's recursion
            raise ChatTemplateError(f"the chat template does not compile ({type(e).__name__}: "
                                    f"{e})") from None
        literals = "\0".join({n.data for n in ast.find_all(jinja2.nodes.TemplateData)}
                             | {n.value for n in ast.find_all(jinja2.nodes.Const)
                                if isinstance(n.value, str)})
        control = [t for t in added if t in special or (t in literals and not t.isspace())]
        longest_first = "|".join(map(re.escape, sorted(control, key=len, reverse=True))) or "(?!)"
        self.control_re = re.compile(longest_first)
        self.marked_re = re.compile(f"{START}({longest_first}){END}|[{START}{END}]")
        self.variables = variables

    def strftime_now(self, fmt):
        if not isinstance(fmt, str):
            raise TypeError(f"strftime_now takes a format string, not {type(fmt).__name__}")
        return self.date.strftime(fmt)

    def render(self, messages, add_generation_prompt=True, **kwargs):
        """The template's text for `messages` ([{"role", "content"}]); kwargs reach the template
        (date_string=...)."""
        variables = {"tools": None, "documents": None, **self.variables, **kwargs}
        try:
            return in_time(lambda: self._render(messages, add_generation_prompt, variables),
                           RENDER_SECONDS)
        except Timeout:
            raise ChatTemplateError(f"the chat template did not finish rendering within "
                                    f"{RENDER_SECONDS:g} s") from None
        except Exception as e:                         # TemplateError, SecurityError, Python's
            why = str(e).splitlines()[0][:200] if str(e) else ""
            raise ChatTemplateError(f"the chat template fails to render ({type(e).__name__}: "
                                    f"{why})") from None

    def _render(self, messages, add_generation_prompt, variables):
        pieces, n = [], 0
        for piece in self.template.generate(messages=messages,
                                            add_generation_prompt=add_generation_prompt,
                                            **variables):
            pieces.append(piece)
            n += len(piece)
            if n > MAX_CHARS:
                raise SecurityError(f"the template writes more than {MAX_CHARS:,} characters")
        return "".join(pieces)

    def encode(self, messages, encode, encode_text, add_generation_prompt=True, **kwargs):
        """Token ids of the rendered messages; encode: text -> ids with special tokens, encode_text:
        plain text."""
        text = self.render(self._mark(messages), add_generation_prompt, **kwargs)
        return self._ids(text, encode, encode_text)

    def encode_after_turn(self, messages, encode, encode_text, **kwargs):
        """The ids the template writes after the end of the assistant turn whose content is PROBE,
        through the next generation prompt: what an environment writes after the model's turn
        (its tool messages, a user's next message), the model's own end of turn excluded."""
        text = self.render(self._mark(messages), True, **kwargs)
        at, end = text.find(PROBE), self.end_of_turn()
        m = self.control_re.search(text, at + 1) if at >= 0 else None
        if m is None or m.group(0) != end:
            raise ChatTemplateError(f"the chat template writes no {end or 'end of turn'} right "
                                    f"after an assistant message followed by another message")
        return self._ids(text[m.end():], encode, encode_text)

    def _mark(self, x):
        """Every string in the messages with its control tokens wrapped in the markers."""
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
        for i, piece in enumerate(pieces):
            if piece:
                ids += encode_text(piece) if i % 2 else encode(piece)
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
        """ChatTemplateError unless a user message renders, with its text in what the template
        writes."""
        text = self.render([{"role": "user", "content": PROBE}])
        if PROBE not in text:
            raise ChatTemplateError(f"the chat template does not write the user's message (a "
                                    f"probe message rendered as {text[:80]!r})")


def in_time(fn, seconds):
    """fn() stopped by Timeout after `seconds`, where a timer can interrupt it (the main thread;
    elsewhere fn() runs unbounded). Also bounds a tool's run (tools.py)."""
    if threading.current_thread() is not threading.main_thread():
        return fn()

    def expire(signum, frame):
        raise Timeout
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
