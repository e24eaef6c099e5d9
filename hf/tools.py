"""
Tools a policy can call. Any Python function with type hints and a Google-style docstring is a
tool: its JSON schema is built as transformers' `get_json_schema` builds it (the form a chat
template's `tools` renders); a model's calls are parsed as the served model's parser (vLLM's
hermes or llama3_json) reads them; a call runs in a worker process (hf/sandbox.py), and whatever
goes wrong is an error text the model reads as the tool's reply, never a crash and never a
silent reward.

    table = resolve("calculator,mymodule:lookup")    # {name: Tool}; imported in the worker
    calls = parse_calls(text, "hermes")              # [Call(name, arguments)] or an error text each
    reply = run_call(table, calls[0])                # Reply(text, failed)

Call forms (STYLES), each as vLLM's parser of that name, but that a broken call is answered with
its error (vLLM drops every call of the turn and reads it as the answer):
    hermes   Qwen2.5, Qwen3, Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>,
             one or more in a turn; a last one left unclosed runs to the turn's end
    llama3   Llama 3.x: JSON objects {"name": ..., "parameters": {...}} anywhere in the turn
             (after <|python_tag|> where the model writes one), several separated by anything;
             a turn whose JSON does not parse, or whose object has no name, is the answer
"arguments" given as a JSON string of an object is that object. With a reasoning template
(Qwen3's <think>), calls written inside the reasoning are not run, as vLLM's reasoning parser.

Bounds: a call's text MAX_CALL_CHARS, calls in a turn MAX_CALLS, a run RUN_SECONDS (the worker is
killed past it), a reply MAX_REPLY_CHARS (cut, and said so), the worker's memory MEMORY.
"""
import enum
import importlib
import inspect
import json
import os
import re
import sys
import types
import typing
from typing import Any, Literal, NamedTuple, Union

from hf import sandbox
from hf.chat import PROBE, ChatTemplateError, demonstration
from tasks import toolcalc

STYLES = ("hermes", "llama3")
MAX_CALL_CHARS = 4096        # a call's JSON
MAX_CALLS = 4                # calls parsed in one turn; the rest: one error
RUN_SECONDS = 2.0            # one run of a tool
LOAD_SECONDS = 20.0          # importing a tool's module
MAX_REPLY_CHARS = 1024       # what the model reads back
MEMORY = 4 * 2 ** 30         # the worker's address space
TOOL_PROBE = "\U000f0003"    # a tool message's content while ChatTools checks the template


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
    at the end of a description becomes an enum). SchemaError otherwise, and for a torch.Tensor or
    an image hint, which transformers writes as "audio" and "image": JSON cannot give either."""
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
# Calls, as the served model's parser reads them

def parse_calls(text, style, reasoning=False):
    """The calls in one assistant turn's text: a Call each, or an error text (the tool's reply
    the model then reads) for a call that is malformed; [] when the turn calls nothing (it is the
    answer). reasoning: a <think>...</think> block is the model's reasoning, its calls never run."""
    if style not in STYLES:
        raise ValueError(f"call style {style!r}; allowed: {', '.join(STYLES)}")
    thought = text.partition("<think>")[2]
    if reasoning and "</think>" in thought:
        text = thought.partition("</think>")[2]
    out = _llama3_calls(text) if style == "llama3" else _hermes_calls(text)
    if len(out) > MAX_CALLS:
        out = out[:MAX_CALLS] + [f"error: at most {MAX_CALLS} calls a turn"]
    return out


def _hermes_calls(text):
    out, pos, tag, end_tag = [], 0, "<tool_call>", "</tool_call>"
    while (start := text.find(tag, pos)) >= 0:
        end = text.find(end_tag, start)
        inner = text.find(tag, start + len(tag))
        if 0 <= inner and (end < 0 or inner < end):
            out.append("error: a <tool_call> inside another")
            if end < 0:
                break
        elif end < 0:                      # the last one, unclosed: it runs to the turn's end
            call = _call(text[start + len(tag):].strip(), "arguments")
            out.append(call if isinstance(call, Call) else
                       "error: a <tool_call> that is never closed")
            break
        else:
            out.append(_call(text[start + len(tag):end].strip(), "arguments"))
        pos = end + len(end_tag)
    return out


def _llama3_calls(text):
    """Each JSON object from a '{' outside the ones read before; any that does not parse, or has
    no "name" (a string) and "parameters" or "arguments": no call at all, the turn is the answer
    (vLLM's llama3_json: a KeyError or a decoding error makes the turn content)."""
    out, end, decoder = [], 0, json.JSONDecoder()
    for m in re.finditer(r"\{", text):
        if m.start() < end:                # inside the object read before
            continue
        try:
            data, end = decoder.raw_decode(text, m.start())
        except (ValueError, RecursionError):
            return []
        if not isinstance(data.get("name"), str) or not {"parameters", "arguments"} & set(data):
            return []
        size = end - m.start()
        out.append(_fields(data, "parameters") if size <= MAX_CALL_CHARS else
                   f"error: a call of {size:,} characters (at most {MAX_CALL_CHARS:,})")
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
    return _fields(data, key)


def _fields(data, key):
    """A Call from a parsed call, its arguments under `key` (or the other name of the two), a
    JSON object or a string holding one (OpenAI's form); else an error text."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return 'error: a call is a JSON object with a "name"'
    other = "parameters" if key == "arguments" else "arguments"
    arguments = data.get(key, data.get(other, {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            pass
    if not isinstance(arguments, dict):
        return f'error: the call\'s "{key}" is not a JSON object'
    return Call(data["name"], arguments)


# -----------------------------------------------------------------------------
# Running a call in the worker

_JSON_TYPES = {"integer": int, "number": (int, float), "string": str, "boolean": bool,
               "array": list, "object": dict, "null": type(None)}


def _is(value, kind):
    """Whether a JSON value is of a schema type (a bool is no integer or number)."""
    if isinstance(value, bool) and kind in ("integer", "number"):
        return False
    return kind not in _JSON_TYPES or isinstance(value, _JSON_TYPES[kind])


def _fits(value, schema):
    """Whether a JSON value fits a schema json_schema built: its type, null where nullable, its
    enum, a list's items (or each place of a tuple), a dict's values, one of a Union's."""
    if value is None and schema.get("nullable"):
        return True
    if "anyOf" in schema:
        return any(_fits(value, s) for s in schema["anyOf"])
    kinds = schema.get("type", [])
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if kinds and not any(_is(value, k) for k in kinds) or \
            "enum" in schema and value not in schema["enum"]:
        return False
    if isinstance(value, list) and "prefixItems" in schema:
        places = schema["prefixItems"]
        return len(value) == len(places) and all(map(_fits, value, places))
    if isinstance(value, list) and "items" in schema:
        return all(_fits(v, schema["items"]) for v in value)
    if isinstance(value, dict) and "additionalProperties" in schema:
        return all(_fits(v, schema["additionalProperties"]) for v in value.values())
    return True


def _allowed(schema):
    """What a schema allows, in words: 'integer', "one of ['a', 'b']", 'array of string or null'."""
    if "anyOf" in schema:
        text = " or ".join(_allowed(s) for s in schema["anyOf"])
    elif "enum" in schema:
        text = f"one of {schema['enum']}"
    else:
        kinds = schema.get("type", "any")
        text = kinds if isinstance(kinds, str) else "/".join(kinds)
        if "prefixItems" in schema:
            text += f" of [{', '.join(_allowed(s) for s in schema['prefixItems'])}]"
        elif "items" in schema:
            text += f" of {_allowed(schema['items'])}"
        elif "additionalProperties" in schema:
            text += f" of {_allowed(schema['additionalProperties'])} values"
    return text + (" or null" if schema.get("nullable") else "")


def check_arguments(schema, arguments):
    """An error text for arguments the schema refuses (missing, unknown, not what its type
    allows, not one of its choices), or None."""
    parameters = schema["function"]["parameters"]
    properties = parameters.get("properties", {})
    missing = [a for a in parameters.get("required", []) if a not in arguments]
    if missing:
        return f"error: missing argument {missing[0]!r}"
    for name, value in arguments.items():
        if name not in properties:
            return f"error: no argument {name!r}; allowed: {', '.join(properties) or 'none'}"
        try:
            fits = _fits(value, properties[name])
        except RecursionError:
            fits = False
        if not fits:
            shown = json.dumps(value, ensure_ascii=False)[:80]
            return f"error: argument {name!r} = {shown}; allowed: {_allowed(properties[name])}"
    return None


class Tool(NamedTuple):
    spec: str                 # what --tools named: calculator, or module:function
    schema_text: str          # its JSON schema as JSON text (a Tool is hashable)

    @property
    def schema(self):
        return json.loads(self.schema_text)


class Reply(NamedTuple):
    text: str                 # what the model reads back
    failed: bool              # an error: a malformed call, refused arguments, an unknown tool,
                              # the tool's exception or its timeout, past the calls allowed


def run_call(tools, call):
    """The Reply to `call` (a Call, or parse_calls' error text) with `tools` ({name: Tool}): the
    tool's result as text, cut at MAX_REPLY_CHARS, or an error text."""
    if isinstance(call, str):
        return Reply(call, True)
    if call.name not in tools:
        return Reply(f"error: no tool named {call.name[:80]!r}; tools: {', '.join(tools)}", True)
    problem = check_arguments(tools[call.name].schema, call.arguments)
    if problem:
        return Reply(problem, True)
    try:
        text = _worker().request("call", {"spec": tools[call.name].spec,
                                          "arguments": call.arguments}, RUN_SECONDS)
        return Reply(text, False)
    except sandbox.Timeout as e:                # its own time, or its restarted worker's
        return Reply(f"error: {call.name} ran past {RUN_SECONDS:g} s" + (f" ({e})" if str(e)
                                                                        else ""), True)
    except sandbox.Died as e:
        return Reply(f"error: {call.name} ended its process ({e})", True)
    except sandbox.Failed as e:                # the tool's own failure: the model reads it
        return Reply(f"error: {e}", True)


# -----------------------------------------------------------------------------
# Built in, and --tools

def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly: integers, + - * and parentheses.

    Args:
        expression: The expression, e.g. 12*(3+4)
    """
    value = toolcalc.calculator(expression)
    if value.startswith("error: "):                     # a failed call, as any tool's exception
        raise ValueError(value.removeprefix("error: "))
    return value


BUILT_IN = {"calculator": calculator}


def resolve(spec):
    """--tools: comma-separated names, built in (BUILT_IN) or module:function (a function of an
    importable module) -> {name: Tool}, each imported and given its JSON schema in the worker.
    ValueError naming the one that is wrong and what is allowed."""
    out = {}
    for name in [s.strip() for s in spec.split(",")]:
        if ":" not in name and name not in BUILT_IN:
            raise ValueError(f"--tools {name or repr(spec)}: allowed: {', '.join(BUILT_IN)} (built "
                             f"in) or module:function")
        try:
            path = [os.path.abspath(p) for p in sys.path]      # the worker's cwd is its own
            schema = _worker().setup("load", {"key": name, "spec": name, "path": path},
                                     LOAD_SECONDS)
        except sandbox.Timeout:
            raise ValueError(f"--tools {name}: its module did not load within "
                             f"{LOAD_SECONDS:g} s") from None
        except sandbox.Died as e:
            raise ValueError(f"--tools {name}: loading it ended its process ({e})") from None
        except sandbox.Failed as e:
            raise ValueError(f"--tools {name}: {e}") from None
        tool = Tool(name, json.dumps(schema))
        called = schema["function"]["name"]
        if called in out and out[called].spec != name:
            raise ValueError(f"--tools {spec}: two tools named {called} ({out[called].spec} and "
                             f"{name}); allowed: one tool of each name")
        out[called] = tool
    return out


def _worker():
    return sandbox.worker(__name__, MEMORY)


def keep_environment(names):
    """--tools_env: the run's environment variables (a comma-separated string) the tools' worker
    keeps besides sandbox.ENV_KEPT; ValueError naming one that is not a set variable."""
    names = tuple(n for n in names.split(",") if n)
    for name in names:
        if name not in os.environ:
            raise ValueError(f"--tools_env {name}: no such variable in this run's environment "
                             f"(names of set variables, comma-separated)")
    if names != _worker().env_names:
        _worker().stop()
        _worker().env_names = names


_LOADED = {}                            # in the worker: spec -> function


def _worker_load(key, spec, path):
    """In the worker: the tool `spec` imported, checked and kept; its JSON schema."""
    sys.path[:] = path
    if ":" in spec:
        module, _, attr = spec.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except BaseException as e:      # the user's module: SystemExit too
            raise sandbox.Failed(f"cannot import it ({sandbox.describe(e)})") from None
    else:
        fn = BUILT_IN[spec]
    if not (inspect.isfunction(fn) or inspect.ismethod(fn) or inspect.isbuiltin(fn)):
        what = "class" if inspect.isclass(fn) else type(fn).__name__
        raise sandbox.Failed(f"a {what}, not a function (a tool is a function called with JSON "
                             f"arguments)")
    try:
        kinds = {p.kind for p in inspect.signature(fn).parameters.values()}
    except (TypeError, ValueError):
        kinds = set()
    for kind, what in ((inspect.Parameter.VAR_POSITIONAL, "*args"),
                       (inspect.Parameter.VAR_KEYWORD, "**kwargs"),
                       (inspect.Parameter.POSITIONAL_ONLY, "positional-only arguments")):
        if kind in kinds:
            raise sandbox.Failed(f"its {what} cannot be given by name from a JSON call")
    try:
        schema = json_schema(fn)
    except SchemaError as e:
        raise sandbox.Failed(str(e)) from None
    except Exception as e:              # e.g. a type hint that names nothing defined
        raise sandbox.Failed(f"no JSON schema ({sandbox.describe(e)})") from None
    _LOADED[spec] = fn
    return schema


def _worker_call(spec, arguments):
    """In the worker: the tool's result as text (cut at MAX_REPLY_CHARS)."""
    fn = _LOADED[spec]
    result = fn(**arguments)
    try:
        text = str.__str__(result) if isinstance(result, str) else \
            json.dumps(result, ensure_ascii=False, default=str)
    except BaseException as e:          # 10**5000, a cycle, a __str__ that raises
        raise sandbox.Failed(f"the result of {fn.__name__} cannot be shown as text "
                             f"({sandbox.describe(e)})") from None
    n = len(text)
    return text if n <= MAX_REPLY_CHARS else f"{text[:MAX_REPLY_CHARS]} ... ({n:,} characters, cut)"


WORKER_OPS = {"load": _worker_load, "call": _worker_call}


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
    """Episodes in a chat template's protocol (episode.sample, env.chat): the prompt rendered
    with the tools' schemas; a finished assistant turn's calls parsed and run; the replies
    rendered as the template's tool messages, then its next generation prompt: the environment's
    ids, from just after the model's end of turn (the model's own ids stay as it sampled them).
    Refused in one line (ValueError): a template that teaches no call form or cannot write a
    tool message. `note`: where the template is not prefix-stable, what that means (said once)."""

    def __init__(self, tokenizer, tools):
        self.tok, self.chat, self.tools = tokenizer, tokenizer.chat, tools
        self.schemas = [t.schema for t in tools.values()]
        source, where = tokenizer.template[0], tokenizer.name.removeprefix("hf:")
        self.style = call_style(source)
        if self.style is None:
            raise ValueError(f"{where}: its chat template teaches no call form read here "
                             f"(<tool_call> JSON as Qwen2.5, or Llama 3.x's JSON with "
                             f"\"parameters\")")
        self.opener = "<tool_call>" if self.style == "hermes" else "<|python_tag|>"
        self.reasoning = "</think>" in source            # Qwen3's: calls in <think> never run
        try:
            alone = self.tok.decode(self.after_turn([{"role": "tool", "content": TOOL_PROBE}]))
            then = self.tok.decode(self.after_turn([{"role": "tool", "content": TOOL_PROBE},
                                                    {"role": "assistant", "content": PROBE}]))
        except ChatTemplateError as e:
            raise ValueError(f"{where}: its chat template cannot write a tool message "
                             f"({e})") from None
        if TOOL_PROBE not in alone:
            raise ValueError(f"{where}: its chat template does not write a tool message (the "
                             f"tools' replies would never reach the model); it cannot run "
                             f"--tools")
        self.note = None
        if not then.startswith(alone):
            at = next(i for i, (a, b) in enumerate(zip(alone, then)) if a != b)
            self.note = (f"note: {where}: its chat template writes a tool message differently "
                         f"once another message follows it ({alone[at:at + 30]!r} against "
                         f"{then[at:at + 30]!r}): an episode's ids are what the model read at "
                         f"each turn, not a re-render of the whole conversation")

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
        """A finished assistant turn's text -> None where it calls nothing, or with the tools
        disabled (it is the answer), else (calls, failed, the environment's ids): each call run
        (past max_calls an episode, an error text instead), each reply a tool message."""
        calls = parse_calls(text, self.style, self.reasoning) if enabled else []
        if not calls:
            return None
        replies = [Reply(f"error: at most {max_calls} calls an episode", True)
                   if calls_before + i >= max_calls else run_call(self.tools, call)
                   for i, call in enumerate(calls)]
        return len(calls), sum(r.failed for r in replies), self.after_turn(
            [{"role": "tool", "content": r.text} for r in replies])

    def unfinished(self, text):
        """(calls, failed) of a turn cut by the budget: every call in it failed, never run; a
        call opened and cut before its end counts as one."""
        calls = parse_calls(text, self.style, self.reasoning)
        if not calls and self.opener in text:
            return 1, 1
        return len(calls), len(calls)

    def demonstration(self, prompt, messages):
        """chat.demonstration with the tools' schemas in the template's place."""
        return demonstration(self.tok, prompt, messages, tools=self.schemas)
