"""
Chat templates: a prompt rendered through a checkpoint's own chat template and encoded, as transformers'
`apply_chat_template(messages, add_generation_prompt=True, tokenize=True, sanitize_control_tokens=True)` does.

An instruct model was tuned on its template's text (Qwen2.5: <|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>
assistant\n). The template, a Jinja program from the checkpoint's folder, runs in Jinja's sandbox with what
transformers gives it: trim/lstrip blocks, loop controls, raise_exception, strftime_now (today's date: Llama 3.2's
template writes it), a tojson keeping non-ASCII text. The special tokens it writes become special ids; none in a
message can (each is wrapped in private-use markers before rendering, encoded as text after). `end_of_turn` finds
what follows an assistant message (<|im_end|>, <|eot_id|>): the tokenizer stops on it, demonstrations end with it.
"""
import json
import re
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

START, END = "\ue000", "\ue001"     # the markers around a control token inside a message
PROBE = "\ue002"                   # a message's content while end_of_turn looks for what follows it


class ChatTemplateError(ValueError):
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
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """source: the Jinja text; added: {text: id} of the added tokens, special: the special ones; variables:
    bos_token, eos_token, ..."""

    def __init__(self, source, added, special, variables):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
        try:
            ast = env.parse(source)
            self.template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template does not compile ({type(e).__name__}: {e})") from None
        literals = "\0".join({n.data for n in ast.find_all(jinja2.nodes.TemplateData)}
                             | {n.value for n in ast.find_all(jinja2.nodes.Const) if isinstance(n.value, str)})
        control = [t for t in added if t in special or (t in literals and not t.isspace())]
        longest_first = "|".join(map(re.escape, sorted(control, key=len, reverse=True))) or "(?!)"
        self.control_re = re.compile(longest_first)
        self.marked_re = re.compile(f"{START}({longest_first}){END}|[{START}{END}]")
        self.variables = variables

    def render(self, messages, add_generation_prompt=True, **kwargs):
        """The template's text for `messages` ([{"role", "content"}]); kwargs reach the template (date_string=...)."""
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **{**self.variables, **kwargs})
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template fails to render ({type(e).__name__}: {e})") from None

    def encode(self, messages, encode, encode_text, add_generation_prompt=True, **kwargs):
        """Token ids of the rendered messages; encode: text -> ids with special tokens, encode_text: plain text."""
        def mark(text):
            text = text.replace(START, "").replace(END, "")              # no forged markers
            return self.control_re.sub(lambda m: START + m.group(0) + END, text)
        marked = [{**m, "content": mark(m["content"])} for m in messages]
        pieces = self.marked_re.split(self.render(marked, add_generation_prompt, **kwargs))   # text, token, text, ...
        ids = []
        for i, piece in enumerate(pieces):
            if piece:
                ids += encode_text(piece) if i % 2 else encode(piece)
        return ids

    def end_of_turn(self):
        """The control token the template writes right after an assistant message, or None."""
        text = self.render([{"role": "user", "content": "1"}, {"role": "assistant", "content": PROBE}], False)
        after = text[text.find(PROBE) + len(PROBE):] if PROBE in text else ""
        m = self.control_re.match(after)
        return m.group(0) if m else None
