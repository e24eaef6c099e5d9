"""
Tools a policy can call. Any Python function with type hints and a Google-style docstring is a
tool: its JSON schema is built as transformers' `get_json_schema` builds it (the form a chat
template's `tools` renders); a model's calls are parsed in the form its template teaches; a call
runs with bounds, and whatever goes wrong is an error text the model reads as the tool's reply,
never a crash and never a silent reward.

    schemas = [json_schema(calculator)]             # apply_chat_template(..., tools=schemas)
    calls = parse_calls(text, "hermes")             # [Call(name, arguments)] or an error text each
    reply = run_call({"calculator": calculator}, calls[0])

Call forms (STYLES):
    hermes   Qwen2.5, Qwen3, Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>,
             one or more in a turn
    llama3   Llama 3.x: the whole turn is one JSON object {"name": ..., "parameters": {...}}
             (after <|python_tag|> where the model writes one)

Bounds: a call's text MAX_CALL_CHARS, calls in a turn MAX_CALLS, a run RUN_SECONDS (a timer, in
the main thread), a reply MAX_REPLY_CHARS (cut, and said so).
"""
import enum
import importlib
import inspect
import json
import re
import types
import typing
from typing import Any, Literal, NamedTuple, Union

from chat import PROBE, Timeout, in_time
from tasks import toolcalc

STYLES = ("hermes", "llama3")
MAX_CALL_CHARS = 4096        # a call's JSON
MAX_CALLS = 4                # calls parsed in one turn; the rest: one error
RUN_SECONDS = 2.0            # one run of a tool
MAX_REPLY_CHARS = 1024       # what the model reads back


class Call(NamedTuple):
    name: str
    arguments: dict


# -----------------------------------------------------------------------------
# A function's JSON schema (transformers' get_json_schema, rule for rule)

_DESCRIPTION = re.compile(r"^(.*?)[\n\s]*(Args:|Returns:|Raises:|\Z)", re.DOTALL)
_ARGS = re.compile(r"\n\s*Args:\n(.*?)[\n\s]*(Returns:|Raises:|\Z)", re.DOTALL)
_ARG = re.compile(r"(?:^|\n)([ \t]*)(\w+)(?:[ \t]*\([^()\n]*\))?:\s*(.*?)\s*"
                  r"(?=\n(?!\1[ \t])[ \t]*\w+(?:[ \t]*\([^()\n]*\))?:|\Z)", re.DOTALL)
_RETURNS = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(Raises:|\Z)", re.DOTALL)
_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_BASIC = {**{t: {"type": name} for t, name in _SCALARS.items()}, list: {"type": "array"},
          tuple: {"type": "array"}, dict: {"type": "object"}, Any: {}}


class SchemaError(ValueError):
    pass


def _enum(values):
    kinds = list(dict.fromkeys(_SCALARS[type(v)] for v in values))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


def _schema_of(hint):
    """A type hint's JSON schema: basic types, Enum, Literal, Union/Optional, list, tuple, dict."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None and isinstance(hint, type) and issubclass(hint, enum.Enum):
        values = [m.value for m in hint]
        if not values or any(type(v) not in _SCALARS for v in values):
            raise SchemaError(f"the Enum {hint.__name__} needs members of JSON scalar values")
        return _enum(values)
    if origin is None:
        if hint not in _BASIC:
            raise SchemaError(f"the type hint {hint!r} has no JSON schema (basic types, Enum, "
                              f"Literal, and list, tuple, dict, Union of them)")
        return dict(_BASIC[hint])
    if origin is Union or origin is types.UnionType:
        parts = [_schema_of(t) for t in args if t is not type(None)]
        if len(parts) == 1:
            out = parts[0]
        elif all(p.keys() == {"type"} and isinstance(p["type"], str) for p in parts):
            names = sorted({p["type"] for p in parts})
            out = {"type": names[0] if len(names) == 1 else names}
        else:
            out = {"anyOf": parts}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is Literal and args:
        if any(type(a) not in _SCALARS for a in args):
            raise SchemaError("only JSON scalars can be listed in a Literal")
        return _enum(list(args))
    if origin is list:
        return {"type": "array", "items": _schema_of(args[0])} if args else {"type": "array"}
    if origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 1 or ... in args:
            raise SchemaError(f"the type hint {hint} has no fixed length: use list[...]")
        return {"type": "array", "prefixItems": [_schema_of(t) for t in args]}
    if origin is dict:
        out = {"type": "object"}
        if len(args) == 2:
            out["additionalProperties"] = _schema_of(args[1])
        return out
    raise SchemaError(f"the type hint {hint!r} has no JSON schema")


def json_schema(fn):
    """{"type": "function", "function": {name, description, parameters[, return]}} of `fn`, from
    its type hints and its Google-style docstring (every argument described; "(choices: [...])"
    at the end of a description becomes an enum). SchemaError otherwise."""
    name = getattr(fn, "__name__", "operation")
    doc = inspect.getdoc(fn)
    if not doc:
        raise SchemaError(f"{name} has no docstring")
    doc = doc.strip()
    description = _DESCRIPTION.search(doc)
    description = description.group(1).strip() if description else None
    block = _ARGS.search(doc)
    args = {}
    if block:
        lines = "\n".join(line for line in block.group(1).split("\n") if line.strip())
        args = {m[1]: re.sub(r"\s*\n+\s*", " ", m[2].strip()) for m in _ARG.findall(lines)}
    returns = _RETURNS.search(doc)
    hints, signature = typing.get_type_hints(fn), inspect.signature(fn)
    first = next(iter(signature.parameters), None)
    implicit = first if first in ("self", "cls") and \
        signature.parameters[first].annotation is inspect.Parameter.empty else None
    required = []
    for p in signature.parameters.values():
        if p.name == implicit:
            continue
        if p.annotation is inspect.Parameter.empty:
            raise SchemaError(f"argument {p.name} of {name} has no type hint")
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    properties, ret = {}, None
    for arg, hint in hints.items():
        if arg == implicit:
            continue
        if arg == "return":
            try:
                ret = _schema_of(hint)
            except SchemaError:
                pass                                # the model never writes the return value
            continue
        properties[arg] = _schema_of(hint)
    for arg, schema in properties.items():
        if arg not in args:
            raise SchemaError(f"the docstring of {name} does not describe its argument {arg!r}")
        text = args[arg]
        choices = re.search(r"\(choices:\s*(.*?)\)\s*$", text, flags=re.IGNORECASE)
        if choices:
            schema["enum"] = [c.strip() if isinstance(c, str) else c
                              for c in json.loads(choices.group(1))]
            text = choices.string[:choices.start()].strip()
        schema["description"] = text
    parameters = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    out = {"name": name, "description": description, "parameters": parameters}
    if ret is not None:
        if returns:
            ret["description"] = returns.group(1).strip()
        out["return"] = ret
    return {"type": "function", "function": out}


# -----------------------------------------------------------------------------
# Calls, as a chat template teaches the model to write them

def parse_calls(text, style):
    """The calls in one assistant turn's text: a Call each, or an error text (the tool's reply
    the model then reads) for a call that is malformed; [] when the turn calls nothing."""
    if style not in STYLES:
        raise ValueError(f"call style {style!r}; allowed: {', '.join(STYLES)}")
    if style == "llama3":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        return [_call(body, "parameters")] if body.startswith("{") else []
    out, pos = [], 0
    while (start := text.find("<tool_call>", pos)) >= 0:
        end = text.find("</tool_call>", start)
        inner = text.find("<tool_call>", start + len("<tool_call>"))
        if end < 0:
            out.append("error: a <tool_call> that is never closed")
            break
        if 0 <= inner < end:
            out.append("error: a <tool_call> inside another")
            pos = end + len("</tool_call>")
            continue
        out.append(_call(text[start + len("<tool_call>"):end].strip(), "arguments"))
        pos = end + len("</tool_call>")
    if len(out) > MAX_CALLS:
        out = out[:MAX_CALLS] + [f"error: at most {MAX_CALLS} calls a turn"]
    return out


def _call(body, key):
    """A Call from one call's JSON text ({"name": ..., key: {...}}), or an error text."""
    if len(body) > MAX_CALL_CHARS:
        return f"error: a call of {len(body):,} characters (at most {MAX_CALL_CHARS:,})"
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e).split(":")[0]
        return f"error: the call is not JSON ({why})"
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return 'error: a call is a JSON object with a "name"'
    arguments = data.get(key, data.get("arguments" if key != "arguments" else "parameters", {}))
    if not isinstance(arguments, dict):
        return f'error: the call\'s "{key}" is not a JSON object'
    return Call(data["name"], arguments)


# -----------------------------------------------------------------------------
# Running a call, bounded

_JSON_TYPES = {"integer": int, "number": (int, float), "string": str, "boolean": bool,
               "array": list, "object": dict, "null": type(None)}


def _is(value, kind):
    """Whether a JSON value is of a schema type (a bool is no integer or number)."""
    if isinstance(value, bool) and kind in ("integer", "number"):
        return False
    return kind not in _JSON_TYPES or isinstance(value, _JSON_TYPES[kind])


def check_arguments(schema, arguments):
    """An error text for arguments the schema refuses (missing, unknown, a wrong JSON type, not
    one of its choices), or None."""
    parameters = schema["function"]["parameters"]
    properties = parameters.get("properties", {})
    missing = [a for a in parameters.get("required", []) if a not in arguments]
    if missing:
        return f"error: missing argument {missing[0]!r}"
    for name, value in arguments.items():
        if name not in properties:
            return f"error: no argument {name!r}; allowed: {', '.join(properties) or 'none'}"
        kinds = properties[name].get("type", [])
        kinds = [kinds] if isinstance(kinds, str) else kinds
        choices = properties[name].get("enum")
        if kinds and not any(_is(value, k) for k in kinds) or choices and value not in choices:
            shown = json.dumps(value, ensure_ascii=False)[:80]
            allowed = f"one of {choices}" if choices else "/".join(kinds)
            return f"error: argument {name!r} = {shown}; allowed: {allowed}"
    return None


def run_call(tools, call):
    """The text the model reads back for `call` (a Call, or parse_calls' error text): the tool's
    result as text, cut at MAX_REPLY_CHARS, or an error text (an unknown tool, arguments the
    schema refuses, a tool that raises or runs past RUN_SECONDS)."""
    if isinstance(call, str):
        return call
    if call.name not in tools:
        return f"error: no tool named {call.name[:80]!r}; tools: {', '.join(tools)}"
    fn = tools[call.name]
    problem = check_arguments(json_schema(fn), call.arguments)
    if problem:
        return problem
    try:
        result = in_time(lambda: fn(**call.arguments), RUN_SECONDS)
    except Timeout:
        return f"error: {call.name} ran past {RUN_SECONDS:g} s"
    except Exception as e:                              # the tool's own failure: the model reads it
        return f"error: {type(e).__name__}: {str(e)[:200]}"
    text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False,
                                                               default=str)
    if len(text) > MAX_REPLY_CHARS:
        text = text[:MAX_REPLY_CHARS] + f" ... ({len(text):,} characters, cut)"
    return text


# -----------------------------------------------------------------------------
# Built in

def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly: integers, + - * and parentheses.

    Args:
        expression: The expression, e.g. 12*(3+4)
    """
    return toolcalc.calculator(expression)


BUILT_IN = {"calculator": calculator}


def resolve(spec):
    """--tools: comma-separated names, built in (BUILT_IN) or module:function (a function of an
    importable module) -> {name: function}, each checked for a JSON schema. ValueError naming the
    one that is wrong and what is allowed."""
    out = {}
    for name in [s.strip() for s in spec.split(",")]:
        if ":" in name:
            module, _, attr = name.partition(":")
            try:
                fn = getattr(importlib.import_module(module), attr)
            except Exception as e:                  # the user's module: any failure, one line
                raise ValueError(f"--tools {name}: cannot import it ({type(e).__name__}: "
                                 f"{e})") from None
        elif name in BUILT_IN:
            fn = BUILT_IN[name]
        else:
            raise ValueError(f"--tools {name or repr(spec)}: allowed: {', '.join(BUILT_IN)} (built "
                             f"in) or module:function")
        try:
            json_schema(fn)
        except SchemaError as e:
            raise ValueError(f"--tools {name}: {e}") from None
        except Exception as e:                      # e.g. a type hint that names nothing defined
            raise ValueError(f"--tools {name}: no JSON schema ({type(e).__name__}: {e})") from None
        out[fn.__name__] = fn
    return out


# -----------------------------------------------------------------------------
# The chat template's own protocol: what the environment writes after a model's turn

def call_style(source):
    """The call form a chat template teaches: "hermes" where it writes <tool_call>, "llama3"
    where it asks for a JSON object with "parameters"; None for neither."""
    if "<tool_call>" in source:
        return "hermes"
    if '"parameters"' in source or "ipython" in source:
        return "llama3"
    return None


class ChatTools:
    """Episodes in a chat template's protocol (sampler.episodes, env.chat): the prompt rendered
    with the tools' schemas; a finished assistant turn's calls parsed and run; the replies
    rendered as the template's tool messages, then its next generation prompt: the environment's
    ids, from just after the model's end of turn (the model's own ids stay as it sampled them)."""

    def __init__(self, tokenizer, tools):
        self.tok, self.chat, self.tools = tokenizer, tokenizer.chat, tools
        self.schemas = [json_schema(fn) for fn in tools.values()]
        self.style = call_style(tokenizer.template[0])
        if self.style is None:
            where = tokenizer.name.removeprefix("hf:")
            raise ValueError(f"{where}: its chat template teaches no call form read here "
                             f"(<tool_call> JSON as Qwen2.5, or Llama 3.x's JSON with "
                             f"\"parameters\")")
        self.opener = "<tool_call>" if self.style == "hermes" else "<|python_tag|>"

    def _encode(self, messages, **kwargs):
        return self.chat.encode(messages, self.tok.encode_special, self.tok.encode,
                                tools=self.schemas, **kwargs)

    def prompt(self, text):
        """The ids of the user's message `text` with the tools in the template's place."""
        return self._encode([{"role": "user", "content": text}])

    def after_turn(self, messages):
        """What the template writes after an assistant turn's end, then `messages`, then the
        next assistant turn's opening (ids)."""
        return self.chat.encode_after_turn([{"role": "user", "content": "1"},
                                            {"role": "assistant", "content": PROBE}, *messages],
                                           self.tok.encode_special, self.tok.encode,
                                           tools=self.schemas)

    def reply(self, text, calls_before, max_calls, enabled=True):
        """A finished assistant turn's text -> None where it calls nothing (it is the answer),
        else (calls, errors, the environment's ids): each call run (past max_calls an episode,
        or with the tools disabled, an error text instead), each reply a tool message."""
        calls = parse_calls(text, self.style)
        if not calls:
            return None
        replies = []
        for i, call in enumerate(calls):
            if not enabled:
                replies.append("error: no tools in this episode")
            elif calls_before + i >= max_calls:
                replies.append(f"error: at most {max_calls} calls an episode")
            else:
                replies.append(run_call(self.tools, call))
        errors = sum(r.startswith("error") for r in replies)
        return len(calls), errors, self.after_turn([{"role": "tool", "content": r}
                                                    for r in replies])

    def unfinished(self, text):
        """(calls, errors) of a turn cut by the budget: every call in it an error, never run."""
        calls = parse_calls(text, self.style)
        if not calls and self.opener in text:
            return 1, 1
        return len(calls), len(calls)

    def demonstration(self, prompt, messages):
        """(prompt ids, [(ids, written by the environment)]) of a demonstration: each assistant
        message as the template writes it, its end of turn last; each run of tool messages as
        after_turn writes it. For templates that write an assistant message alike wherever it
        stands (ChatML, "bytes-chat")."""
        user, pieces, i = {"role": "user", "content": prompt}, [], 0
        opening = self._encode([user])
        while i < len(messages):
            if messages[i]["role"] == "assistant":
                full = self._encode([user, messages[i]], add_generation_prompt=False)
                turn = full[len(opening):]
                if full[:len(opening)] != opening or self.tok.eos_id not in turn:
                    raise ValueError(f"{self.tok.name}: its template writes an assistant "
                                     f"message differently after a generation prompt")
                pieces.append((turn[:turn.index(self.tok.eos_id) + 1], False))
                i += 1
            else:
                j = i
                while j < len(messages) and messages[j]["role"] != "assistant":
                    j += 1
                pieces.append((self.after_turn(messages[i:j]), True))
                i = j
        return opening, pieces
