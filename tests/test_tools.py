"""hf/tools.py: a Python function's JSON schema against transformers' get_json_schema
(tests/golden/tools.json, the same output key for key and in order, since a template renders it as
it is); the calls a chat template teaches, parsed from well-formed and hostile text; a call run with
its bounds, every failure an error text the model reads."""
import json
import os
import re
import sys

import pytest
import torch

import task
from conftest import task_args
from hf import tools
from hf.tokenizer import Tokenizer
from hf.tools import Call, json_schema, parse_calls, run_call
from model import GPTConfig
from tasks import toolcalc

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
    want = [Call("calculator", {"expression": "12*46"})]
    assert parse_calls(call, "llama3") == parse_calls("<|python_tag|>" + call, "llama3") == want
    assert parse_calls("I'll use the calculator. " + call, "llama3") == want    # prose first
    assert parse_calls(call + "\nThe result will follow.", "llama3") == want      # and after
    assert parse_calls(f"{call}; {call}", "llama3") == parse_calls(f"{call}\n{call}",
                                                                   "llama3") == want * 2
    for answer in ("The answer is 552.", '{"answer": 589}', '{"name": "calculator", "parameters": ',
                   "the set {1, 2}", '{"name": 5, "parameters": {}}'):
        assert parse_calls(answer, "llama3") == [], answer        # not a call: the turn's answer
    with pytest.raises(ValueError, match="allowed: hermes, llama3"):
        parse_calls(call, "json")


# vLLM's parsers, transcribed (vllm/entrypoints/openai/tool_parsers/hermes_tool_parser.py and
# vllm/tool_parsers/llama_tool_parser.py, extract_tool_calls): the calls it runs, or None where it
# reads the turn as content (the answer). With `reasoning`, Qwen3ReasoningParser first keeps what
# follows </think> where both tags are written.
def vllm_calls(text, style, reasoning=False):
    if reasoning and "<think>" in text and "</think>" in text:
        text = text.partition("<think>")[2].partition("</think>")[2]
    calls = []
    try:
        if style == "hermes":
            if "<tool_call>" not in text:
                return None
            pattern = r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)"
            for a, b in re.findall(pattern, text, re.DOTALL):
                data = json.loads(a if a else b)
                calls.append((data["name"], data["arguments"]))
        else:
            end, decoder = -1, json.JSONDecoder()
            for m in re.finditer(r"\{", text):
                if m.start() <= end:
                    continue
                data, n = decoder.raw_decode(text[m.start():])
                end = m.start() + n
                calls.append((data["name"], data["arguments"] if "arguments" in data
                              else data["parameters"]))
    except Exception:
        return None
    if not isinstance(calls[0][0] if calls else "", str):
        return None
    # vLLM passes `arguments` on as JSON text; a client's json.loads of a string holding an object
    # gives that object
    return [Call(name, json.loads(args) if isinstance(args, str) else args)
            for name, args in calls] or None


CALL = {"name": "calculator", "arguments": {"expression": "12*46"}}
PARSE_CASES = [   # (style, text): each decision against vLLM's parser
    ("hermes", f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>"),
    ("hermes", f"I will compute. <tool_call>{json.dumps(CALL)}</tool_call> then "
               f"<tool_call>{json.dumps(CALL)}</tool_call>"),
    ("hermes", '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"12*46\\"}"}'
               '</tool_call>'),                              # arguments as a JSON string (4c)
    ("hermes", f"<tool_call>\n{json.dumps(CALL)}\n"),        # the last call left unclosed (4d)
    ("hermes", f"<think>\nI could write <tool_call>{json.dumps(CALL)}</tool_call> but 12*46 = 552."
               f"\n</think>\n\n#589"),                       # a call inside the reasoning (4e)
    ("hermes", f"<think>\nfirst\n</think>\n\n<tool_call>{json.dumps(CALL)}</tool_call>"),
    ("hermes", "no call here"),
    ("llama3", '{"name": "calculator", "parameters": {"expression": "12*46"}}'),
    ("llama3", '<|python_tag|>{"name": "calculator", "parameters": {"expression": "12*46"}}'),
    ("llama3", 'I\'ll use the calculator. {"name": "calculator", "parameters": '
               '{"expression": "12*46"}}'),                  # prose before the JSON (4f)
    ("llama3", '{"name": "calculator", "parameters": {"expression": "1"}}\nThe result follows.'),
    ("llama3", '{"name": "calculator", "parameters": {"expression": "1"}}; '
               '{"name": "calculator", "arguments": {"expression": "2"}}'),   # two calls (4f)
    ("llama3", '{"name": "calculator", "parameters": {"expression": "1"}}\n'
               '{"name": "calculator", "parameters": {"expression": "2"}}'),
    ("llama3", '{"answer": 589}'),                           # a JSON answer is an answer (4f)
    ("llama3", 'The answer is {589}.'),
    ("llama3", '{"name": "calculator", "parameters": '),
]


@pytest.mark.parametrize("style, text", PARSE_CASES)
def test_calls_are_what_vllms_parser_runs(style, text):
    """The same calls as vLLM's parser, and no call where it reads the turn as content. Where a
    call is broken vLLM drops every call of the turn; here the broken one is answered with its
    error and the others run (not among these cases: test_hermes_calls_well_formed_and_hostile)."""
    reasoning = "<think>" in text
    assert parse_calls(text, style, reasoning) == (vllm_calls(text, style, reasoning) or [])


@pytest.mark.slow
def test_a_call_runs_bounded_in_a_worker_and_every_failure_is_the_tools_reply(monkeypatch, capfd):
    """Every failure a tool's code can produce is an error text the model reads, never the end of
    the run; `failed` marks exactly the calls that failed (an ordinary result that begins with
    "error" did not)."""
    monkeypatch.setattr(tools, "RUN_SECONDS", 1.0)
    names = ("slow", "failing", "long", "mode", "typed", "big", "circular", "unprintable",
             "endless_text", "deep", "bye", "interrupt", "base", "exits", "stubborn", "c_level",
             "greedy", "prints")
    table = {**tools.resolve("calculator"),
             **tools.resolve(",".join(f"hostile_tools:{n}" for n in names))}
    assert run_call(table, Call("calculator", {"expression": "37+12*46"})) == ("589", False)
    assert run_call(table, Call("mode", {"m": "error rate 0.5%"}))[1]     # refused: not a choice
    monkeypatch.setitem(table, "echo", tools.resolve("hostile_tools:long")["long"])
    cases = [(Call("weather", {}), "no tool named 'weather'; tools: calculator, slow"),
             (Call("calculator", {}), "missing argument 'expression'"),
             (Call("calculator", {"expression": 12}),
              "argument 'expression' = 12; allowed: string"),
             (Call("calculator", {"expression": "12/4"}), "error: ValueError: '/' is not allowed"),
             (Call("calculator", {"expression": "1", "x": 1}),
              "no argument 'x'; allowed: expression"),
             (Call("mode", {"m": "c"}), "allowed: one of ['a', 'b']"),
             (Call("failing", {"x": True}), "allowed: integer"),
             (Call("failing", {"x": 1}), "error: ZeroDivisionError: division by zero"),
             (Call("slow", {"seconds": 5}), "error: slow ran past 1 s"),
             (Call("typed", {"items": [1, "2"]}), "allowed: array of integer"),
             (Call("typed", {"pair": [1, 2]}), "allowed: array of [integer, string]"),
             (Call("typed", {"pair": [1, "a", 3]}), "allowed: array of [integer, string]"),
             (Call("typed", {"pair": [1]}), "allowed: array of [integer, string]"),
             (Call("typed", {"table": {"a": "x"}}), "allowed: object of number values"),
             (Call("typed", {"either": {"a": 1.5}}),
              "allowed: array of integer or object of integer values"),
             (Call("typed", {"level": None}), "allowed: one of ['low', 'high']"),
             (Call("typed", {"ratio": True}), "allowed: number"),
             (Call("big", {"x": 1}), "the result of big cannot be shown as text (ValueError"),
             (Call("circular", {"x": 1}), "cannot be shown as text (ValueError: Circular"),
             (Call("unprintable", {"x": 1}), "cannot be shown as text (RuntimeError: no text)"),
             (Call("endless_text", {"x": 1}), "endless_text ran past 1 s"),
             (Call("deep", {"x": 1}), "cannot be shown as text (RecursionError"),
             (Call("bye", {"x": 1}), "error: SystemExit: tool said bye"),
             (Call("interrupt", {"x": 1}), "error: KeyboardInterrupt"),
             (Call("base", {"x": 1}), "error: BaseException: base"),
             (Call("exits", {"x": 1}), "error: exits ended its process (exit code 7)"),
             (Call("stubborn", {"x": 1}), "error: stubborn ran past 1 s"),
             (Call("c_level", {"x": 1}), "error: c_level ran past 1 s"),
             (Call("greedy", {"x": 1}), "error: MemoryError"),
             ("error: the call is not JSON (x)", "error: the call is not JSON (x)")]
    for call, words in cases:             # "ran past 1 s": the deadline's words, whatever it does
        text, failed = run_call(table, call)
        assert failed and text.startswith("error") and words in text, (call, text)
    ok = {"count": None, "items": [1, 2], "pair": [1, "a"], "table": {"a": 1, "b": 2.5},
          "either": [1, 2], "level": "high", "ratio": 1}
    assert run_call(table, Call("typed", ok)) == ("None [1, 2] [1, 'a'] {'a': 1, 'b': 2.5} "
                                                  "[1, 2] high 1", False)
    assert run_call(table, Call("echo", {"n": 3})) == ("xxx", False)
    cut = run_call(table, Call("long", {"n": 100_000})).text
    assert len(cut) < tools.MAX_REPLY_CHARS + 50 and cut.endswith("(100,000 characters, cut)")
    assert run_call(table, Call("prints", {"x": 1})) == ("printed", False)
    assert "FORGED" not in capfd.readouterr().out               # the worker's stdout is nowhere


def test_a_tool_that_cannot_be_called_from_json_or_shares_a_name_is_refused():
    for name, words in (("varargs", "its *args cannot be given by name"),
                        ("kwargs", "its **kwargs cannot be given by name"),
                        ("Klass", "a class, not a function")):
        with pytest.raises(ValueError, match=re.escape(f"--tools hostile_tools:{name}: {words}")):
            tools.resolve(f"hostile_tools:{name}")
    with pytest.raises(ValueError, match="two tools named calculator .calculator and "
                                         "hostile_tools:calculator."):
        tools.resolve("calculator,hostile_tools:calculator")
    assert list(tools.resolve("calculator,calculator")) == ["calculator"]     # one tool


# -----------------------------------------------------------------------------
# Episodes in a chat template's protocol (episode.sample with tools.ChatTools)

class Turns(torch.nn.Module):
    """A policy that writes turns[n] in its n-th assistant turn (n: the times `opening` was written
    after the prompt), all its probability on the next id, whatever it was fed; past a turn's end it
    names `after` (None: its last id)."""

    def __init__(self, vocab_size, opening, turns, after=None):
        super().__init__()
        self.config, self.opening, self.turns, self.after = (GPTConfig(vocab_size=vocab_size),
                                                             opening, turns, after)
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def hidden(self, idx, mask=None, cache=None):   # the sampler's call; logits() reads its logits
        self.out = self.forward(idx, mask, cache)
        return torch.zeros(*self.out.shape[:-1], 1)

    def logits(self, h, *args, **kwargs):
        return self.out

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
    ('{"name":"calculator","arguments":{"expression":"2/3"}}',
     "error: ValueError: '/' is not allowed"),
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


def test_malformed_counts_what_failed_not_a_result_that_begins_with_error():
    tok, protocol = toy("calculator,hostile_tools:grep")
    e = episode(tok, [call_turn(tok, '{"name":"grep","arguments":{"pattern":"timeout"}}'),
                      tok.encode("#589") + [tok.eos_id]], budget=200)
    env = tok.decode(e.tokens[0][(e.mask[0] - e.sampled[0]) > 0].tolist())
    assert "\nerror rate 0.5% (3 matching lines)<|im_end|>" in env
    assert e.calls.tolist() == [[1.0]] and e.malformed.tolist() == [[0.0]]


def test_turns_count_the_turns_the_policy_began():
    """A budget that runs out on the environment's last token (the next turn's opening) ends the
    episode before the policy's second turn: one turn; one token more, and it began a second."""
    tok, protocol = toy()
    call = call_turn(tok, '{"name":"calculator","arguments":{"expression":"2*3"}}')
    reply = protocol.after_turn([{"role": "tool", "content": "6"}])
    for extra, turns in ((0, 1.0), (1, 2.0)):
        e = episode(tok, [call, tok.encode("#589") + [tok.eos_id]],
                    budget=len(call) + len(reply) + extra)
        assert e.truncated.all() and e.policy_turns.tolist() == [turns], extra


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


def test_a_template_that_teaches_no_call_form_or_writes_no_tool_message_is_refused(tmp_path):
    """A folder whose template writes tools nowhere (bare.jinja), or drops tool messages: --chat
    --tools stops before any work, one line, no folder left."""
    import shutil
    from conftest import refuses_all
    cases = []
    for name, source, words in (
            ("bare", open(os.path.join(GOLDEN, "templates", "bare.jinja")).read(),
             "its chat template teaches no call form"),
            ("drops", NO_TOOL_MESSAGE, "its chat template does not write a tool message")):
        folder = tmp_path / name
        shutil.copytree(os.path.join(GOLDEN, "qwen3"), folder)
        (folder / "chat_template.jinja").write_text(source)
        cases.append((["--init", str(folder), "--chat", "--tools", "calculator", "--task",
                       "arithmetic"], [f"{folder}: {words}"]))
    refuses_all("agent.py", cases, tmp_path)


def test_a_tool_that_cannot_be_loaded_is_one_line(tmp_path, monkeypatch):
    """--tools module:function whose module raises anything on import (SystemExit and
    KeyboardInterrupt too), ends its process, or never finishes importing, or whose string type
    hint names nothing: ValueError naming the tool (plumbing/flags.py makes it the parse error),
    never a traceback and never the end of this process."""
    for name, body in (("boom", 'raise RuntimeError("boom")'), ("leave", 'raise SystemExit("bye")'),
                       ("ctrl", "raise KeyboardInterrupt"), ("gone", "import os; os._exit(3)"),
                       ("spin", "while True: pass"),
                       ("hint", 'def f(x: "Undefined"):\n    """F.\n\n    Args:\n        x: y\n'
                                '    """')):
        (tmp_path / f"{name}_tools.py").write_text(body + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(tools, "LOAD_SECONDS", 1.0)
    for spec, words in (("boom_tools:f", "cannot import it (RuntimeError: boom)"),
                        ("leave_tools:f", "cannot import it (SystemExit: bye)"),
                        ("ctrl_tools:f", "cannot import it (KeyboardInterrupt)"),
                        ("gone_tools:f", "loading it ended its process (exit code 3)"),
                        ("spin_tools:f", "its module did not load within 1 s"),
                        ("hint_tools:f", "no JSON schema (NameError"),
                        ("calculator,abacus", "--tools abacus"), (":f", "cannot import it"),
                        ("os:system", "has no type hint"), ("math:pi", "a float, not a function")):
        with pytest.raises(ValueError, match=re.escape(words)):
            tools.resolve(spec)
    assert list(tools.resolve("calculator")) == ["calculator"]


NO_TOOL_MESSAGE = ("{# <tool_call> #}{% for m in messages %}{% if m.role != 'tool' %}<|im_start|>"
                   "{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
RAISES_ON_TOOL = NO_TOOL_MESSAGE.replace("{% if m.role != 'tool' %}",
                                         "{% if m.role == 'tool' %}{{ raise_exception('no tools "
                                         "here') }}{% endif %}{% if 1 %}")
# vLLM's hermes example in miniature: a tool message ends '\n</tool_response>' when another
# message follows it, '</tool_response>' when it is the last one
UNSTABLE = ("{# <tool_call> #}{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n"
            "<tool_response>\n{{ m.content }}{% if not loop.last %}{{ '\\n' }}{% endif %}"
            "</tool_response>"
            "<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% endif %}")


def qwen3_with(template):
    tok = Tokenizer.from_pretrained(os.path.join(GOLDEN, "qwen3"))
    tok.template = (template, *tok.template[1:])
    return tok.use_chat("2024-07-26")


def test_a_template_without_tool_messages_is_refused_and_an_unstable_one_said():
    calc = tools.resolve("calculator")
    with pytest.raises(ValueError, match="qwen3: its chat template does not write a tool message"):
        tools.ChatTools(qwen3_with(NO_TOOL_MESSAGE), calc)
    with pytest.raises(ValueError, match="qwen3: its chat template cannot write a tool message "
                                         r"\(the chat template fails to render \(TemplateError: no "
                                         "tools here"):
        tools.ChatTools(qwen3_with(RAISES_ON_TOOL), calc)
    note = tools.ChatTools(qwen3_with(UNSTABLE), calc).note
    assert note.startswith("note: ") and "writes a tool message differently once another" in note
    assert "'</tool_response>" in note and "'\\n</tool_response>" in note
    task.use(task_args("arithmetic", chat=True, tools="calculator"))
    for tok in (Tokenizer.from_pretrained(os.path.join(GOLDEN, "qwen3")).use_chat("2024-07-26"),
                Tokenizer.from_pretrained(os.path.join(GOLDEN, "llama3")).use_chat("2024-07-26"),
                Tokenizer("bytes-chat").use_chat("2024-07-26"),
                qwen3_with(open(os.path.join(GOLDEN, "templates", "think.jinja")).read())):
        assert tools.ChatTools(tok, calc).note is None, tok.name     # prefix-stable
    task.use(task_args("arithmetic"))


def test_a_demonstration_is_the_whole_conversation_as_transformers_renders_it(monkeypatch):
    """A reasoning template (think.jinja: a <think> block on the last assistant message only): the
    demonstration's pieces put together are transformers' rendering of the whole conversation, the
    call turn without a think block and the answer with one; the environment's piece is what the
    episode's environment writes."""
    monkeypatch.syspath_prepend(GOLDEN)
    with open(os.path.join(GOLDEN, "qwen3", "golden.json")) as f:
        golden = json.load(f)["chat_think"]
    tok = qwen3_with(open(os.path.join(GOLDEN, "templates", "think.jinja")).read())
    protocol = tools.ChatTools(tok, tools.resolve("episode_tools:calculator"))
    head, pieces = protocol.demonstration(golden["messages"][0]["content"], golden["messages"][1:])
    assert head + [t for piece, _ in pieces for t in piece] + tok.encode("\n") == golden["ids"]
    assert [env for _, env in pieces] == [False, True, False]
    call, env, answer = (tok.decode(piece) for piece, _ in pieces)
    assert "<think>" not in call and answer == "<think>\n\n</think>\n\n#589<|im_end|>"
    assert pieces[1][0] == protocol.after_turn([golden["messages"][2]])


def test_each_bound_holds_at_its_limit_and_refuses_one_past_it():
    """Calls in a turn, a call's characters and a reply's characters: exactly at the limit runs as
    it is, one past is refused or cut, as the docstrings say."""
    one = '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>'
    assert parse_calls(one * tools.MAX_CALLS, "hermes") == [Call("calculator",
                                                                 {"expression": "1"})] * 4
    past = parse_calls(one * (tools.MAX_CALLS + 1), "hermes")
    assert len(past) == tools.MAX_CALLS + 1 and past[-1] == "error: at most 4 calls a turn"
    for style, key, wrap in (("hermes", "arguments", "<tool_call>{}</tool_call>"),
                             ("llama3", "parameters", "{}")):
        head = '{"name": "calculator", "%s": {"expression": "' % key
        for n, ok in ((tools.MAX_CALL_CHARS, True), (tools.MAX_CALL_CHARS + 1, False)):
            body = head + "1" * (n - len(head) - 3) + '"}}'
            assert len(body) == n
            got = parse_calls(wrap.format(body), style)[0]
            assert isinstance(got, Call) == ok and (ok or "(at most 4,096)" in got), (n, got)
    table = tools.resolve("hostile_tools:long")
    exact = run_call(table, Call("long", {"n": tools.MAX_REPLY_CHARS}))
    assert exact == ("x" * tools.MAX_REPLY_CHARS, False)
    cut = run_call(table, Call("long", {"n": tools.MAX_REPLY_CHARS + 1})).text
    assert cut == "x" * tools.MAX_REPLY_CHARS + " ... (1,025 characters, cut)"


def test_the_tool_protocols_task_defaults_are_the_documented_ones():
    """plumbing/flags.py's docstring states the defaults --chat --tools fills in: the out folder,
    agent.py's completion budget, sft.py's context. Each as documented, and as toolcalc defines
    it."""
    import agent
    from plumbing import flags
    import sft
    args = agent.parse_args(["--task", "toolcalc", "--chat", "--tools", "calculator"])
    assert args.max_new_tokens == toolcalc.CHAT_MAX_NEW_TOKENS == 100
    assert args.out == os.path.join("out", "toolcalc_tools")
    args = sft.parse_args(["--task", "toolcalc", "--chat", "--tools", "calculator"])
    assert args.block_size == toolcalc.CHAT_BLOCK_SIZE == 176
    assert sft.parse_args(["--task", "toolcalc"]).block_size == toolcalc.BLOCK_SIZE == 112
    assert sft.parse_args(["--chat", "--tools", "calculator"]).block_size == 176    # any task
    for words in ("out/toolcalc_tools/ with --tools", "176 with --tools, any task",
                  "112 for --task toolcalc", "--chat --tools: 100"):
        assert words in " ".join(flags.__doc__.split()), words


def test_a_cut_turn_after_a_complete_call_and_a_template_that_wants_the_user_first():
    """A turn that writes a whole call and is cut by the budget before its end: the call counts
    and failed (never run), as docs/metrics.md says. A Gemma-style template that refuses a
    conversation not opened by the user: the environment's ids after a turn still render (the
    turn is rendered after a user message)."""
    tok, protocol = toy()
    e = episode(tok, [call_turn(tok, '{"name":"calculator","arguments":{"expression":"2*3"}}')
                      [:-1] + tok.encode("x" * 50)], budget=70)
    assert e.truncated.all() and e.calls.tolist() == [[1.0]] and e.malformed.tolist() == [[1.0]]
    env = tok.decode(e.tokens[0][(e.mask[0] - e.sampled[0]) > 0].tolist())
    assert env == ""                                       # nothing ran
    user_first = ("{# <tool_call> #}{% if messages[0]['role'] != 'user' %}{{ raise_exception("
                  "'the user speaks first') }}{% endif %}{% for m in messages %}<|im_start|>"
                  "{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = qwen3_with(user_first)
    protocol = tools.ChatTools(tok, tools.resolve("calculator"))
    written = tok.decode(protocol.after_turn([{"role": "tool", "content": "6"}]))
    assert protocol.note is None
    assert written == "\n<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n"


def test_without_the_tool_the_first_turn_is_the_answer_in_either_form(monkeypatch):
    """eval_accuracy_no_tool means one thing in both forms: a Llama 3 JSON call needs no opening
    token to ban, so with the tools off its call turn is the episode's answer (a wrong one), never a
    call answered with an error; in the hermes form the same turn cannot open a call at all."""
    monkeypatch.syspath_prepend(GOLDEN)
    task.use(task_args("arithmetic", chat=True, tools="episode_tools:calculator"))
    tok = Tokenizer.from_pretrained(os.path.join(GOLDEN, "llama3")).use_chat("2024-07-26")
    call = tok.encode('{"name": "calculator", "parameters": {"expression": "12*46"}}') + [
        tok.eos_id]
    policy = Turns(tok.vocab_size, tok.encode_special(
        "<|start_header_id|>assistant<|end_header_id|>\n\n"), [call, tok.encode("#589") + [
            tok.eos_id]])
    for tool, calls, turns in ((True, 1.0, 2.0), (False, 0.0, 1.0)):
        e = task.episodes(policy, tok, ["37+12*46="], 1, 0.0, 200, tool=tool)
        assert e.calls.tolist() == [[calls]] and e.policy_turns.tolist() == [turns], tool
        assert e.malformed.sum() == 0 and (tool or e.correct.sum() == 0), tool
    task.use(task_args("arithmetic"))
