"""tools.py: a Python function's JSON schema against transformers' get_json_schema
(tests/golden/tools.json, the same output key for key and in order, since a template renders it as
it is); the calls a chat template teaches, parsed from well-formed and hostile text; a call run with
its bounds, every failure an error text the model reads."""
import json
import os
import re
import sys
import time

import pytest
import torch

import task
import tools
from conftest import task_args
from model import GPTConfig
from tasks import toolcalc
from tokenizer import Tokenizer
from tools import Call, json_schema, parse_calls, run_call

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
sys.path.insert(0, GOLDEN)
import tool_functions  # noqa: E402

TOOLS_GOLDEN = [{"type": "function", "function": {      # make_golden.py's TOOLS
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object",
                   "properties": {"expression": {"type": "string", "description": "e.g. 12*46"}},
                   "required": ["expression"]}}}]


@pytest.mark.parametrize("fn", tool_functions.FUNCTIONS, ids=lambda f: f.__name__)
def test_a_functions_schema_is_transformers(fn):
    with open(os.path.join(GOLDEN, "tools.json")) as f:
        want = json.load(f)[fn.__name__]
    assert json.dumps(json_schema(fn)) == json.dumps(want)         # the same keys, values and order
    assert json_schema(tools.calculator) == json_schema(tool_functions.calculator)


def test_a_function_that_cannot_be_a_tool_is_one_error():
    def undocumented(x: int):
        return x

    def unhinted(x):
        """Add.

        Args:
            x: a number
        """

    def undescribed(x: int, y: int):
        """Add.

        Args:
            x: a number
        """

    def custom(x: Call):
        """Add.

        Args:
            x: a call
        """
    for fn, words in ((undocumented, "no docstring"), (unhinted, "no type hint"),
                      (undescribed, "'y'"), (custom, "has no JSON schema")):
        with pytest.raises(tools.SchemaError, match=words):
            json_schema(fn)


def test_hermes_calls_well_formed_and_hostile():
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*46"}}\n</tool_call>'
    assert parse_calls(call, "hermes") == [Call("calculator", {"expression": "12*46"})]
    assert parse_calls("no call here", "hermes") == []
    assert parse_calls(f"first {call} then {call}",
                       "hermes") == [Call("calculator", {"expression": "12*46"})] * 2
    unicode = ('<tool_call>{"name": "calculator", "arguments": {"expression": "东京 😀 \\u00e9"}}'
               '</tool_call>')
    assert parse_calls(unicode, "hermes") == [Call("calculator", {"expression": "东京 😀 é"})]
    big = ('<tool_call>{"name": "calculator", "arguments": {"expression": "' + "1+" * 50_000
           + '1"}}</tool_call>')
    hostile = {
        '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>': "not JSON",
        '<tool_call>{"name": "calculator"': "never closed",
        '<tool_call><tool_call>{"name": "x"}</tool_call></tool_call>': "inside another",
        big: "a call of 100,056 characters (at most 4,096)",
        '<tool_call>["calculator"]</tool_call>': 'a JSON object with a "name"',
        '<tool_call>{"name": "calculator", "arguments": "12*46"}</tool_call>':
            "is not a JSON object",
        '<tool_call>' + "[" * 3000 + "]" * 1000 + '</tool_call>': "not JSON (nested too deeply)",
    }
    for text, words in hostile.items():
        got = parse_calls(text, "hermes")
        assert len(got) >= 1 and isinstance(got[0], str) and words in got[0], (text[:60], got)
    many = parse_calls(call * (tools.MAX_CALLS + 3), "hermes")
    assert len(many) == tools.MAX_CALLS + 1 and "at most" in many[-1]


def test_llama3_calls():
    call = '{"name": "calculator", "parameters": {"expression": "12*46"}}'
    assert parse_calls(call, "llama3") == parse_calls("<|python_tag|>" + call, "llama3") == \
        [Call("calculator", {"expression": "12*46"})]
    assert parse_calls("The answer is 552.", "llama3") == []
    assert "not JSON" in parse_calls('{"name": "calculator", "parameters": ', "llama3")[0]
    with pytest.raises(ValueError, match="allowed: hermes, llama3"):
        parse_calls(call, "json")


def test_a_call_runs_bounded_and_every_failure_is_the_tools_reply(monkeypatch):
    def slow(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: how long
        """
        time.sleep(seconds)
        return "done"

    def failing(x: int) -> str:
        """Divide by zero.

        Args:
            x: a number
        """
        return str(x / 0)

    def long(n: int) -> str:
        """Write n characters.

        Args:
            n: how many
        """
        return "x" * n

    def mode(m: str) -> str:
        """Echo a mode.

        Args:
            m: the mode (choices: ["a", "b"])
        """
        return m
    monkeypatch.setattr(tools, "RUN_SECONDS", 0.3)
    table = {**tools.BUILT_IN, "slow": slow, "failing": failing, "long": long, "mode": mode}
    assert run_call(table, Call("calculator", {"expression": "37+12*46"})) == "589"
    # the task's rule
    assert run_call(table, Call("calculator", {"expression": "12/4"})).startswith("error")
    cases = [(Call("weather", {}), "no tool named 'weather'; tools: calculator, slow"),
             (Call("calculator", {}), "missing argument 'expression'"),
             (Call("calculator", {"expression": 12}),
              "argument 'expression' = 12; allowed: string"),
             (Call("calculator", {"expression": "1", "x": 1}),
              "no argument 'x'; allowed: expression"),
             (Call("mode", {"m": "c"}), "allowed: one of ['a', 'b']"),
             (Call("failing", {"x": True}), "allowed: integer"),
             (Call("failing", {"x": 1}), "error: ZeroDivisionError: division by zero"),
             (Call("slow", {"seconds": 5}), "error: slow ran past 0.3 s"),
             ("error: the call is not JSON (x)", "error: the call is not JSON (x)")]
    for call, words in cases:
        got = run_call(table, call)
        assert got.startswith("error") and words in got, (call, got)
    cut = run_call(table, Call("long", {"n": 100_000}))
    assert len(cut) < tools.MAX_REPLY_CHARS + 50 and cut.endswith("(100,000 characters, cut)")


# -----------------------------------------------------------------------------
# Episodes in a chat template's protocol (sampler.episodes with tools.ChatTools)

class Turns(torch.nn.Module):
    """A policy that writes turns[n] in its n-th assistant turn (n: the times `opening` was written
    after the prompt), all its probability on the next id, whatever it was fed; past a turn's end it
    names `after` (None: its last id)."""

    def __init__(self, vocab_size, opening, turns, after=None):
        super().__init__()
        self.config, self.opening, self.turns, self.after = (GPTConfig(vocab_size=vocab_size),
                                                             opening, turns, after)
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, idx, mask=None, cache=None):
        if cache.length == 0:
            self.history, self.start = [[t for t, m in zip(r, mr) if m > 0]
                                        for r, mr in zip(idx.tolist(), mask.tolist())], None
            self.start = [len(h) for h in self.history]
        else:
            for h, t in zip(self.history, idx[:, -1].tolist()):
                h.append(t)
        cache.length += idx.size(1)
        logits = torch.zeros(idx.size(0), idx.size(1), self.config.vocab_size)
        for i, h in enumerate(self.history):
            after, n, k, last = h[self.start[i]:], 0, 0, 0
            while k + len(self.opening) <= len(after):
                if after[k:k + len(self.opening)] == self.opening:
                    n, last, k = n + 1, k + len(self.opening), k + len(self.opening)
                else:
                    k += 1
            turn = self.turns[min(n, len(self.turns) - 1)]
            offset = len(after) - last
            logits[i, -1, turn[offset] if offset < len(turn) else (self.after or turn[-1])] = 100.0
        return logits


def toy(tools_spec="calculator", max_calls=2):
    """The toy's chat tokenizer (bytes-chat) with the task's tools, and its ChatTools."""
    task.use(task_args("toolcalc", chat=True, tools=tools_spec))
    tok = Tokenizer("bytes-chat").use_chat("2026-01-01")
    return tok, task.chat_tools(tok)


def call_turn(tok, body, end=None):
    """A turn writing <tool_call>body</tool_call>, then its end (default: the end of turn)."""
    return tok.encode_special(f"<tool_call>{body}</tool_call>") + [
        tok.eos_id if end is None else end]


def episode(tok, turns, budget=100, **kw):
    opening = tok.encode_special("<|im_start|>assistant\n")
    policy = Turns(tok.vocab_size, opening, turns)
    return task.episodes(policy, tok, ["37+12*46="], 1, 0.0, budget, **kw)


def who(e):
    return [int(s) for s, m in zip(e.sampled[0].tolist(), e.mask[0].tolist()) if m]


def test_a_chat_episode_is_the_templates_conversation_and_its_masks_say_who_wrote_each_token():
    tok, protocol = toy()
    call = call_turn(tok, '{"name":"calculator","arguments":{"expression":"37+12*46"}}')
    answer = tok.encode("#589") + [tok.eos_id]
    e = episode(tok, [call, answer])
    reply = protocol.after_turn([{"role": "tool", "content": "589"}])
    assert tok.decode(reply) == "\n<|im_start|>tool\n589<|im_end|>\n<|im_start|>assistant\n"
    ids = e.tokens[0][e.mask[0] > 0].tolist()
    assert ids == call + reply + answer                # the template's conversation, ids as written
    assert who(e) == [1] * len(call) + [0] * len(reply) + [1] * len(answer)
    messages = [{"role": "user", "content": "37+12*46="}, *toolcalc.messages("37+12*46=")]
    whole = tok.chat.encode(messages, tok.encode_special, tok.encode, False, tools=protocol.schemas)
    # the template's, to the turn's end
    assert e.prompt[0].tolist() + ids + tok.encode("\n") == whole
    assert (e.correct.tolist() == [[1.0]] and e.calls.tolist() == [[1.0]]
            and e.malformed.tolist() == [[0.0]])
    assert e.policy_turns.tolist() == [2.0] and not e.truncated.any()


def test_every_stop_id_ends_a_turn_and_the_environment_answers_after_it():
    tok, protocol = toy()
    assert tok.stop_ids == (tok.encode_special("<|im_end|>")[0],
                            tok.encode_special("<|endoftext|>")[0])
    call = call_turn(tok, '{"name":"calculator","arguments":{"expression":"2*3"}}',
                     end=tok.stop_ids[1])
    e = episode(tok, [call, tok.encode("#43") + [tok.stop_ids[1]]])
    reply = protocol.after_turn([{"role": "tool", "content": "6"}])
    assert e.tokens[0][e.mask[0] > 0].tolist() == call + reply + tok.encode("#43") + [
        tok.stop_ids[1]]
    assert (e.calls.tolist() == [[1.0]] and e.policy_turns.tolist() == [2.0]
            and e.correct.tolist() == [[0.0]])


@pytest.mark.parametrize("body, error", [
    ('{"name":"calculator","arguments":{"expression":"2*3"', "error: the call is not JSON"),
    ('{"name":"search","arguments":{"q":"x"}}', "error: no tool named 'search'; tools: calculator"),
    ('{"name":"calculator","arguments":{"expr":"2*3"}}', "error: missing argument 'expression'"),
    ('{"name":"calculator","arguments":{"expression":"2/3"}}', "error: '/' is not allowed"),
    ('<tool_call>{"name":"calculator","arguments":{}}', "error: a <tool_call> inside another"),
    ('{"name":"calculator","arguments":{"expression":12}}',
     "error: argument 'expression' = 12; allowed: string"),
])
def test_a_broken_call_is_answered_with_its_error_and_counted(body, error):
    tok, protocol = toy()
    e = episode(tok, [call_turn(tok, body), tok.encode("#589") + [tok.eos_id]], budget=200)
    text = tok.decode(e.tokens[0][(e.mask[0] - e.sampled[0]) > 0].tolist())
    assert text.startswith("\n<|im_start|>tool\n" + error), text[:200]
    assert (e.calls.tolist() == [[1.0]] and e.malformed.tolist() == [[1.0]]
            and e.correct.tolist() == [[1.0]])


def test_calls_past_max_calls_are_refused_and_a_cut_turn_ends_the_episode():
    tok, protocol = toy()
    call = call_turn(tok, '{"name":"calculator","arguments":{"expression":"2*3"}}')
    e = episode(tok, [call, call, call, tok.encode("#589") + [tok.eos_id]], budget=400, max_calls=2)
    env = tok.decode(e.tokens[0][(e.mask[0] - e.sampled[0]) > 0].tolist())
    assert env.count("\n6<|im_end|>") == 2 and env.count("error: at most 2 calls an episode") == 1
    assert (e.calls.tolist() == [[3.0]] and e.malformed.tolist() == [[1.0]]
            and e.policy_turns.tolist() == [4.0])
    e = episode(tok, [tok.encode("12*46=552,37+552=589#589" * 9)], budget=30)  # never ends its turn
    assert e.truncated.all() and e.mask.sum() == 30 and e.policy_turns.tolist() == [1.0]
    assert e.correct.tolist() == [[0.0]]                            # the cut text: '...#' no number
    e = episode(tok, [call_turn(tok, '{"name":"calculator","arguments":{"expression":"2*3"}}'
                                + "x" * 50)], budget=20)                   # cut inside an open call
    assert e.truncated.all() and e.calls.tolist() == [[1.0]] and e.malformed.tolist() == [[1.0]]


def test_without_the_tool_no_call_is_opened():
    tok, protocol = toy()
    call = call_turn(tok, '{"name":"calculator","arguments":{"expression":"2*3"}}')
    e = episode(tok, [call, tok.encode("#589") + [tok.eos_id]], tool=False)
    assert tok.encode_special("<tool_call>")[0] not in e.tokens[0].tolist() and e.calls.sum() == 0


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_the_environments_tokens_after_a_call_are_transformers(name):
    """The golden episode (make_golden.py's TOOL_EPISODE: a call, the tool's reply '552', the next
    turn's opening) as transformers encodes it, from a scripted episode in the folder's own
    template: the prompt with the tools, the policy's call turn as the template writes it, then the
    environment's ids, the same ids exactly."""
    folder = os.path.join(GOLDEN, name)
    with open(os.path.join(folder, "golden.json")) as f:
        golden = json.load(f)["chat"]["tool_reply"]
    task.use(task_args("arithmetic", chat=True, tools="episode_tools:calculator"))
    tok = Tokenizer.from_pretrained(folder).use_chat("2024-07-26")
    protocol = task.chat_tools(tok)
    assert protocol.schemas == [json.loads(json.dumps(t)) for t in TOOLS_GOLDEN]
    prompt = protocol.prompt("37+12*46=")
    ids = golden["ids"]
    assert ids[:len(prompt)] == prompt
    end = ids.index(tok.eos_id, len(prompt)) + 1
    call = ids[len(prompt):end]                                # the call turn, its end of turn last
    assert parse_calls(tok.decode(call[:-1]),
                       protocol.style) == [Call("calculator", {"expression": "12*46"})]
    opening = {"qwen3": "<|im_start|>assistant\n",
               "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n"}
    policy = Turns(tok.vocab_size, tok.encode_special(opening[name]),
                   [call, tok.encode("#589") + [tok.eos_id]])
    e = task.episodes(policy, tok, ["37+12*46="], 1, 0.0, 200)
    written = e.tokens[0][e.mask[0] > 0].tolist()
    assert e.prompt[0][e.prompt_mask[0] > 0].tolist() + written == ids + tok.encode("#589") + [
        tok.eos_id]
    assert (who(e) == [1] * len(call) + [0] * (len(ids) - end) + [1] * 5
            and e.calls.tolist() == [[1.0]])


def test_a_chat_demonstration_trains_the_policys_turns_and_never_the_tools_message():
    """sft.py --chat --tools: toolcalc's demonstration (a call, its reply, the answer) as the
    template writes it; the loss mask on the call turn and the answer, each with its end of turn,
    and 0 on the environment's tokens."""
    tok, protocol = toy()
    prompt = "37+12*46="
    tokens, attn, mask = task.completion_batch([prompt, "3+4*2="], [toolcalc.messages(prompt),
                                                                  toolcalc.messages("3+4*2=")], tok)
    messages = [{"role": "user", "content": prompt}, *toolcalc.messages(prompt)]
    whole = tok.chat.encode(messages, tok.encode_special, tok.encode, False, tools=protocol.schemas)
    n = int(attn[0].sum())
    assert tokens[0, :n].tolist() + tok.encode("\n") == whole
    trained = tok.decode([t for t, m in zip(tokens[0, 1:n].tolist(),
                                            mask[0, :n - 1].tolist()) if m])
    assert trained == ('<tool_call>{"name":"calculator","arguments":{"expression":"37+12*46"}}'
                       '</tool_call><|im_end|>#589<|im_end|>')
    n = int(attn[1].sum())
    # an easy one: in the head
    assert tok.decode([t for t, m in zip(tokens[1, 1:n].tolist(), mask[1, :n - 1].tolist())
                       if m]) == "4*2=8,3+8=11#11<|im_end|>"


def test_a_template_that_teaches_no_call_form_is_refused_in_one_line(tmp_path):
    """A folder whose template writes tools nowhere (bare.jinja): --chat --tools stops before any
    work."""
    import shutil
    from conftest import refuses_all
    folder = tmp_path / "bare"
    shutil.copytree(os.path.join(GOLDEN, "qwen3"), folder)
    shutil.copy(os.path.join(GOLDEN, "templates", "bare.jinja"), folder / "chat_template.jinja")
    refuses_all("agent.py", [(["--init", str(folder), "--chat", "--tools", "calculator",
                               "--task", "arithmetic"],
                              [f"{folder}: its chat template teaches no call form"])], tmp_path)


def test_a_tool_that_cannot_be_loaded_is_one_line(tmp_path, monkeypatch):
    """--tools module:function where the module raises on import, or a string type hint names
    nothing: ValueError naming the tool (flags.py makes it the parse error), never a traceback."""
    (tmp_path / "boom_tools.py").write_text('raise RuntimeError("boom")\n')
    (tmp_path / "hint_tools.py").write_text(
        'def f(x: "Undefined"):\n    """F.\n\n    Args:\n        x: y\n    """\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec, words in (("boom_tools:f", "cannot import it (RuntimeError: boom)"),
                        ("hint_tools:f", "no JSON schema (NameError"),
                        ("calculator,abacus", "--tools abacus")):
        with pytest.raises(ValueError, match=re.escape(words)):
            tools.resolve(spec)
    assert list(tools.resolve("calculator")) == ["calculator"]
