"""tools.py: a Python function's JSON schema against transformers' get_json_schema (tests/golden/tools.json, the
same output key for key and in order, since a template renders it as it is); the calls a chat template teaches,
parsed from well-formed and hostile text; a call run with its bounds, every failure an error text the model reads."""
import json
import os
import sys
import time

import pytest

import tools
from tools import Call, json_schema, parse_calls, run_call

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
sys.path.insert(0, GOLDEN)
import tool_functions  # noqa: E402


@pytest.mark.parametrize("fn", tool_functions.FUNCTIONS, ids=lambda f: f.__name__)
def test_a_functions_schema_is_transformers(fn):
    with open(os.path.join(GOLDEN, "tools.json")) as f:
        want = json.load(f)[fn.__name__]
    assert json.dumps(json_schema(fn)) == json.dumps(want)          # the same keys, values and order
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
    for fn, words in ((undocumented, "no docstring"), (unhinted, "no type hint"), (undescribed, "'y'"),
                      (custom, "has no JSON schema")):
        with pytest.raises(tools.SchemaError, match=words):
            json_schema(fn)


def test_hermes_calls_well_formed_and_hostile():
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*46"}}\n</tool_call>'
    assert parse_calls(call, "hermes") == [Call("calculator", {"expression": "12*46"})]
    assert parse_calls("no call here", "hermes") == []
    assert parse_calls(f"first {call} then {call}", "hermes") == [Call("calculator", {"expression": "12*46"})] * 2
    unicode = '<tool_call>{"name": "calculator", "arguments": {"expression": "东京 😀 \\u00e9"}}</tool_call>'
    assert parse_calls(unicode, "hermes") == [Call("calculator", {"expression": "东京 😀 é"})]
    big = '<tool_call>{"name": "calculator", "arguments": {"expression": "' + "1+" * 50_000 + '1"}}</tool_call>'
    hostile = {
        '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>': "not JSON",
        '<tool_call>{"name": "calculator"': "never closed",
        '<tool_call><tool_call>{"name": "x"}</tool_call></tool_call>': "inside another",
        big: "a call of 100,056 characters (at most 4,096)",
        '<tool_call>["calculator"]</tool_call>': 'a JSON object with a "name"',
        '<tool_call>{"name": "calculator", "arguments": "12*46"}</tool_call>': "is not a JSON object",
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
    assert run_call(table, Call("calculator", {"expression": "12/4"})).startswith("error")   # the task's rule
    cases = [(Call("weather", {}), "no tool named 'weather'; tools: calculator, slow"),
             (Call("calculator", {}), "missing argument 'expression'"),
             (Call("calculator", {"expression": 12}), "argument 'expression' = 12; allowed: string"),
             (Call("calculator", {"expression": "1", "x": 1}), "no argument 'x'; allowed: expression"),
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
