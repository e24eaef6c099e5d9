"""--chat: prompts through a checkpoint's own chat template (hf/chat.py), against what transformers'
apply_chat_template renders and encodes for the tiny Llama 3 (Llama 3.2's template) and Qwen3
(Qwen2.5's ChatML template) folders of tests/golden (make_golden.py): the text and the ids exactly,
a control token inside the message encoded as text (as sanitize_control_tokens=True does), the end
of an assistant turn found, ending completions and demonstrations; the scripts with --chat, and its
refusals."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime

import pytest

import task
from conftest import ROOT, refuses_all, run_script, task_args
from hf.chat import ChatTemplate
from hf.checkpoint import CheckpointError, load_checkpoint
from hf.tokenizer import Tokenizer

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
# folder: the end of an assistant turn, its id
CHAT = {"llama3": ("<|eot_id|>", 4), "qwen3": ("<|im_end|>", 2)}
TOOLS = [{"type": "function", "function": {     # make_golden.py's
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object",
                   "properties": {"expression": {"type": "string", "description": "e.g. 12*46"}},
                   "required": ["expression"]}}}]


def chat_tokenizer(name):
    folder = os.path.join(GOLDEN, name)
    with open(os.path.join(folder, "golden.json")) as f:
        return Tokenizer.from_pretrained(folder).use_chat(), json.load(f)["chat"]


def check_golden(tok, chat, golden):
    """chat renders and encodes each golden message as transformers did, without and with its
    tool."""
    for key, tools in (("messages", None), ("with_tools", TOOLS)):
        for m in golden[key]:
            messages, kw = [{"role": "user",
                             "content": m["content"]}], dict(date_string="26 Jul 2024", tools=tools)
            assert chat.render(messages, **kw) == m["rendered"], (key, m["content"])
            assert chat.encode(messages, tok.encode_special, tok.encode, **kw) == m["ids"], (
                key, m["content"])
    turn = [{"role": "user", "content": "3+4*2="},
            {"role": "assistant", "content": "4*2=8,3+8=11#11"}]
    assert chat.render(turn, add_generation_prompt=False,
                       date_string="26 Jul 2024") == golden["assistant_turn"]
    # a call, then its reply
    episode, kw = golden["tool_reply"], dict(date_string="26 Jul 2024", tools=TOOLS)
    assert chat.render(episode["messages"], **kw) == episode["rendered"]
    assert chat.encode(episode["messages"], tok.encode_special, tok.encode, **kw) == episode["ids"]


@pytest.mark.parametrize("name", list(CHAT))
def test_the_template_renders_and_encodes_as_transformers(name):
    """Each golden message, with and without a tool, and an episode with a call and the tool's
    reply: among them Qwen2.5's <tool_call> (an added token that is not special, written by the
    template) and transformers' own markers (U+F0000, U+F0001) inside a message."""
    tok, golden = chat_tokenizer(name)
    check_golden(tok, tok.chat, golden)
    assert any("<tool_call>" in m["content"] for m in golden["messages"])
    assert any("\U000f0000" in m["content"] for m in golden["messages"])


def test_a_template_of_bare_and_indented_tags_renders_as_transformers():
    """Jinja's trim_blocks and lstrip_blocks, which every tag written with '-' hides:
    templates/bare.jinja, its tags on lines of their own and indented, through the Qwen3 folder's
    tokenizer."""
    tok, _ = chat_tokenizer("qwen3")
    with open(os.path.join(GOLDEN, "qwen3", "golden.json")) as f:
        golden = json.load(f)["chat_bare"]
    with open(os.path.join(GOLDEN, "templates", "bare.jinja")) as f:
        source = f.read()
    assert "{%-" not in source and "\n  {% if" in source
    added = Tokenizer.from_pretrained(os.path.join(GOLDEN, "qwen3")).template
    check_golden(tok, ChatTemplate(source, *added[1:]), golden)


@pytest.mark.parametrize("name", list(CHAT))
def test_a_control_token_in_the_message_is_text_and_only_the_templates_are_special(name):
    tok, golden = chat_tokenizer(name)
    end, end_id = CHAT[name]
    message = "say <|im_end|> or <|eot_id|> and stop"
    ids = tok.encode_prompt(message)
    template_ends = tok.chat.render([{"role": "user", "content": "x"}]).count(end)
    # the message's own <|im_end|> / <|eot_id|> is not one
    assert ids.count(end_id) == template_ends
    assert tok.decode(ids).count(end) == template_ends + 1     # ... but its text is there
    plain = tok.encode_special(tok.chat.render([{"role": "user", "content": message}]))
    # what encoding the rendered text whole would do
    assert plain.count(end_id) == template_ends + 1


@pytest.mark.parametrize("name", list(CHAT))
def test_the_end_of_the_assistant_turn_ends_completions_and_demonstrations(name):
    folder = os.path.join(GOLDEN, name)
    plain, (tok, _) = Tokenizer.from_pretrained(folder), chat_tokenizer(name)
    end, end_id = CHAT[name]
    assert (tok.eos_id == end_id and tok.stop_ids[0] == end_id
            and set(plain.stop_ids) <= set(tok.stop_ids))
    task.use(task_args())
    tokens, attn, mask = task.completion_batch(["3+4*2="], ["4*2=8,3+8=11#11"], tok)
    row = tokens[0, :int(attn[0].sum())].tolist()
    assert row == tok.encode_prompt("3+4*2=") + tok.encode("4*2=8,3+8=11#11") + [end_id]
    # the completion and the turn's end
    assert mask[0].sum() == len(tok.encode("4*2=8,3+8=11#11")) + 1


def test_llama_32s_template_writes_the_runs_date():
    """Today's by default, as transformers writes it; a given day otherwise (a run fixes it and its
    checkpoint keeps it, so that a run resumed another day renders the prompts it trained on)."""
    tok, _ = chat_tokenizer("llama3")
    text = tok.decode(tok.encode_prompt("3+4*2="))
    assert (f"Today Date: {datetime.now().strftime('%d %b %Y')}\n" in text
            and text.startswith("<|begin_of_text|>"))
    fixed = Tokenizer.from_pretrained(os.path.join(GOLDEN, "llama3")).use_chat("2024-02-29")
    assert "Today Date: 29 Feb 2024\n" in fixed.decode(fixed.encode_prompt("3+4*2="))


def test_the_longest_prompt_counts_the_template():
    tok, _ = chat_tokenizer("qwen3")
    task.use(task_args())
    longest = max(len(tok.encode_prompt(p)) for p in task.eval_prompts())
    assert longest <= task.max_prompt_tokens(tok) <= longest + 2 + 4
    plain = Tokenizer.from_pretrained(os.path.join(GOLDEN, "qwen3"))
    assert task.max_prompt_tokens(tok) > task.max_prompt_tokens(plain) + 20


def test_grpo_and_sft_train_through_the_template_and_resume(tmp_path):
    out = str(tmp_path)
    llama = os.path.join(GOLDEN, "llama3")
    p = run_script("sft.py", ["--init", llama, "--chat", "--steps", "2", "--batch_size", "4",
                              "--eval_n", "4", "--out", out])
    assert p.returncode == 0, p.stderr
    assert "in the chat template" in p.stdout
    p = run_script("grpo.py", ["--init", os.path.join(out, "sft.pt"), "--chat", "--steps", "1",
                               "--prompts_per_step", "2", "--group_size", "2", "--eval_n", "4",
                               "--out", out])
    assert p.returncode == 0, p.stderr
    p = run_script("grpo.py", ["--init", os.path.join(out, "sft.pt"), "--chat", "--steps", "2",
                               "--prompts_per_step", "2", "--group_size", "2", "--eval_n", "4",
                               "--out", out, "--resume"])
    assert p.returncode == 0, p.stderr


def test_chat_refusals_are_one_line_before_any_work(tmp_path):
    """--chat without a template, from the byte tokenizer, with a template that does not compile or
    that raises: one line each, and no output folder left behind. A new model under --chat gets
    bytes-chat and its template."""
    broken, raising = tmp_path / "broken", tmp_path / "raising"
    for folder, source in ((broken, "{% if %}"),
                           (raising, "{{ raise_exception('only system messages') }}")):
        shutil.copytree(os.path.join(GOLDEN, "qwen3"), folder)
        (folder / "chat_template.jinja").write_text(source)
    refuses_all("grpo.py", [
        (["--init", os.path.join(GOLDEN, "qwen2"), "--chat"], ["--chat", "has no chat template"]),
        (["--init", str(tmp_path / "none.pt"), "--chat"],
         ["--chat needs --init", "none.pt is missing"]),
        (["--init", str(broken), "--chat"], ["--chat", "does not compile"]),
        (["--init", str(raising), "--chat"], ["--chat", "fails to render", "only system messages"]),
    ], tmp_path)
    assert not any(x.name.startswith("out") for x in tmp_path.iterdir())
    with pytest.raises(CheckpointError, match="has no chat template"):
        Tokenizer().use_chat()
    p = run_script("sft.py", ["--chat", "--steps", "2", "--eval_n", "2",
                              "--out", str(tmp_path / "sft")])
    assert p.returncode == 0, p.stderr[-2000:]      # a new model: bytes-chat, its built-in template
    assert load_checkpoint(str(tmp_path / "sft" / "sft.pt"))[1]["tokenizer"] == "bytes-chat"


# A downloaded template is untrusted input: each of these is one ChatTemplateError, none a hang or a
# crash.
HOSTILE = {
    "nested loops":
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "lipsum": "{{ lipsum(10**6) }}", "a repeated string": "{{ 'a' * 10**8 }}",
    "a huge range": "{% for i in range(10**9) %}{% endfor %}",
    "a doubling string": "{% set ns = namespace(s='a') %}{% for i in range(40) %}"
                         "{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "a huge power": "{{ 2 ** 100000000 }}",
    "a wide format": "{{ '{:>100000000}'.format(1) }}", "a wide %": "{{ '%*d' % (100000000, 1) }}",
    "a wide filter": "{{ 'a'|center(100000000) }}",
    "endless output": "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}",
    "division by zero": "{{ 1/0 }}", "a type error": "{{ 'x' + 1 }}",
    "strftime_now's argument": "{{ strftime_now(123) }}", "tojson": "{{ cycler|tojson }}",
    "a float overflow": "{{ 10.0**400 }}", "include": "{% include 'other.jinja' %}",
    "recursion": "{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}",
    "an unsafe attribute": "{{ strftime_now.__globals__ }}",
    "attr()": "{{ messages|attr('__class__') }}",
    "no message": "hello", "nothing": "",
    "a million spaces for the tokenizer":                 # within every bound of the worker's
        "{{ ' ' * (1000000 - messages[0].content|length) }}",
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_template_is_one_error(case, monkeypatch):
    from hf import chat
    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.5)
    tok = Tokenizer.from_pretrained(os.path.join(GOLDEN, "qwen3"))
    tok.template = (HOSTILE[case]
                    + "{{ messages[0]['content'] }}" * (case not in ("no message", "nothing")),
                    *tok.template[1:])
    with pytest.raises(CheckpointError, match="--chat: .*qwen3: the chat template"):
        tok.use_chat()
    assert (tok.chat is None
            and tok.stop_ids == Tokenizer.from_pretrained(os.path.join(GOLDEN, "qwen3")).stop_ids)


@pytest.mark.slow
def test_a_hostile_template_is_refused_by_the_scripts_and_sigterm_stops_a_loading_run(tmp_path):
    """Through grpo.py: a template that raises, one that never writes the message, one that loops
    past the render's time limit (5 s): one line each, no folder left. SIGTERM, or Ctrl-C, while
    the looping one renders stops the run at once (its handler used to wait for a first step that
    never came), exit 143 or 130."""
    folders = {}
    for name in ("raises", "empty", "loops"):
        folders[name] = tmp_path / name
        shutil.copytree(os.path.join(GOLDEN, "qwen3"), folders[name])
    (folders["raises"] / "chat_template.jinja").write_text("{{ messages[0]['content'] }}{{ 1/0 }}")
    (folders["empty"] / "chat_template.jinja").write_text("")
    (folders["loops"] / "chat_template.jinja").write_text(HOSTILE["nested loops"]
                                                          + "{{ messages[0]['content'] }}")
    refuses_all("grpo.py", [(["--init", str(folders["raises"]), "--chat"],
                             ["--chat", "ZeroDivisionError"]),
                            (["--init", str(folders["empty"]), "--chat"],
                             ["--chat", "does not write the user's"]),
                            (["--init", str(folders["loops"]), "--chat"],
                             ["--chat", "within 5 s"])], tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        out = tmp_path / f"stopped{code}"
        p = subprocess.Popen([sys.executable, "grpo.py", "--init", str(folders["loops"]),
                              "--chat", "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
        for line in p.stdout:                          # Run's start line; the template renders next
            if line.startswith("task "):
                break
        time.sleep(1.0)
        p.send_signal(sig)
        stdout, stderr = p.communicate(timeout=120)
        # not 1: the render's own time limit would have ended it with a refusal
        assert p.returncode == code, (p.returncode, stderr)
        assert f"{sig.name} while loading" in stdout and "Traceback" not in stderr, stderr
        assert not out.exists()


# Templates that, rendered in the run's process, allocate gigabytes before any size check can see
# the value, or hold the CPU in one C-level call that no timer inside the process can interrupt
# (the outside review's R1 and R2). In the worker each is one error in bounded time, and this
# process's memory does not move.
HEAVY = {
    "join": "{{ range(100000)|join('x'*40000) }}",
    "%": "{{ ('%999999s' * 4000) % (('x',) * 4000) }}",
    "str.format": "{{ ('{0:>999999}' * 4000).format('x') }}",
    "replace": "{{ ('a'*40000)|replace('a', 'b'*100000) }}",
    "tojson(indent)": "{{ range(40000)|list|tojson(indent=100000) }}",
    "~": "{% set ns = namespace(s='a'*1000000) %}{% for i in range(40) %}"
         "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "a list membership test": "{% set z = [0]*1000000 %}{% set L = [z]*100000 %}"
                              "{{ ((z[:-1] + [1]) in L)|string|length * '' }}",
    "a quadratic sum": "{% set z = [0]*1000000 %}{{ ([z]*150)|sum(start=[])|length }}",
}


@pytest.mark.parametrize("case", list(HEAVY))
@pytest.mark.slow
def test_a_template_that_allocates_or_holds_the_cpu_is_stopped_in_its_worker(case, monkeypatch):
    import resource

    from hf import chat
    monkeypatch.setattr(chat, "RENDER_SECONDS", 2.0)
    template = ChatTemplate(HEAVY[case] + "{{ messages[0]['content'] }}", {}, set(), {})
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # its own words: the render's bound (memory) or its 2 s deadline ended it, not the test's
    with pytest.raises(chat.ChatTemplateError, match="the chat template (fails to render|did not "
                                                     "finish rendering within 2 s)"):
        template.render([{"role": "user", "content": "hi"}])
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 100_000      # KB


def test_compiling_rendering_and_a_runs_renders_are_bounded(monkeypatch):
    """A source past MAX_SOURCE_CHARS is refused unread, a slow compile stops at COMPILE_SECONDS, a
    rendering past MAX_CHARS stops at once (not at the timer), a template slow to render one message
    is refused at load (PROBE_SECONDS), and one whose renders add up past BUDGET stops the run."""
    from hf import chat
    with pytest.raises(chat.ChatTemplateError, match="262,145 characters long .at most 262,144"):
        ChatTemplate("x" * (chat.MAX_SOURCE_CHARS + 1), {}, set(), {})
    ChatTemplate("x" * chat.MAX_SOURCE_CHARS, {}, set(), {})              # at the bound: read
    at_most = ChatTemplate("{{ 'x' * (%d - messages[0].content|length) }}{{ messages[0].content }}"
                           % chat.MAX_CHARS, {}, set(), {})
    assert len(at_most.render([{"role": "user", "content": "hi"}])) == chat.MAX_CHARS
    one_past = ChatTemplate("{{ 'x' * (%d - messages[0].content|length) }}{{ messages[0].content }}"
                            % (chat.MAX_CHARS + 1), {}, set(), {})
    with pytest.raises(chat.ChatTemplateError, match="writes more than 1,000,000 characters"):
        one_past.render([{"role": "user", "content": "hi"}])
    with monkeypatch.context() as patch:        # the worker it kills restarts meanwhile
        patch.setattr(chat, "COMPILE_SECONDS", 0.3)
        with pytest.raises(chat.ChatTemplateError, match="did not compile within 0.3 s"):
            ChatTemplate("{% if 1 %}x{% endif %}" * 10_000, {}, set(), {})
    writes = ChatTemplate("{% for i in range(20000) %}{{ 'x' * 99 }}{% endfor %}", {}, set(), {})
    with pytest.raises(chat.ChatTemplateError, match="writes more than 1,000,000 characters"):
        writes.render([{"role": "user", "content": "hi"}])     # the size's words, not the timer's
    slow = ("{% for i in range(3000) %}{% for j in range(100) %}{% endfor %}{% endfor %}"
            "{{ messages[0]['content'] }}")
    times = []                            # one render of it, here: the fastest of three (a
    for k in range(3):                    # load spike in one makes the budgets below no laxer)
        times.append(time.time())
        ChatTemplate(slow, {}, set(), {}).render([{"role": "user", "content": f"x{k}"}])
        times[-1] = time.time() - times[-1]
    one = min(times)
    monkeypatch.setattr(chat, "PROBE_SECONDS", one / 4)
    with pytest.raises(chat.ChatTemplateError, match="to render one message .at most"):
        ChatTemplate(slow, {}, set(), {}).check()
    monkeypatch.setattr(chat, "BUDGET", (2.5 * one, 0.0))
    template, n = ChatTemplate(slow, {}, set(), {}), 0
    with pytest.raises(chat.ChatTemplateError, match="has spent .* rendering in"):
        for n in range(10):
            template.render([{"role": "user", "content": str(n)}])
    assert 1 <= n < 10 and template.spent > 2.5 * one    # renders slow under load: fewer
    assert template.render([{"role": "user", "content": "0"}])       # a render it has: cached


def test_the_render_cache_tells_apart_every_argument_that_changes_the_text():
    template = ChatTemplate("{{ messages[0]['content'] }}|{{ add_generation_prompt }}|{{ tools }}|"
                            "{{ documents }}|{{ extra }}", {}, set(), {})
    hi = [{"role": "user", "content": "hi"}]
    texts = [template.render(hi), template.render(hi, False), template.render(hi, tools=[{"a": 1}]),
             template.render(hi, documents=["d"]), template.render(hi, extra="x"),
             template.render([{"role": "user", "content": "ho"}])]
    assert len(set(texts)) == len(texts), texts
    assert template.render(hi) == texts[0] and len(template.cache) == len(texts)


def test_a_control_token_in_a_tools_schema_is_text(monkeypatch):
    """A tool whose description shows the call syntax: its <tool_call> is text, as transformers'
    sanitize_control_tokens marks `tools` too; the prompt holds only the template's own."""
    monkeypatch.syspath_prepend(GOLDEN)
    folder = os.path.join(GOLDEN, "qwen3")
    tag = Tokenizer.from_pretrained(folder).encode_special("<tool_call>")
    assert len(tag) == 1
    counts = []
    for spec in ("episode_tools:calculator", "hostile_tools:tagged"):
        task.use(task_args("arithmetic", chat=True, tools=spec))
        tok = Tokenizer.from_pretrained(folder).use_chat("2024-07-26")
        ids = task.chat_tools(tok).prompt("37+12*46=")
        counts.append(ids.count(tag[0]))
    assert counts[0] == counts[1] == 2                    # the template's: the example and its
    task.use(task_args("arithmetic"))                     # instruction's tags


def test_a_template_that_fails_mid_run_stops_it_with_one_line(tmp_path):
    """A template that renders its probes but raises on the task's prompts (at the starting
    evaluation): one line naming it and that no checkpoint exists yet, no traceback, nothing left
    on disk."""
    folder = tmp_path / "picky"
    shutil.copytree(os.path.join(GOLDEN, "qwen3"), folder)
    (folder / "chat_template.jinja").write_text(
        "{% if '=' in messages[0]['content'] %}{{ raise_exception('no equations') }}{% endif %}"
        "<|im_start|>user\n{{ messages[0]['content'] }}<|im_end|>\n<|im_start|>assistant\n")
    p = run_script("grpo.py", ["--init", str(folder), "--chat", "--steps", "1", "--eval_n", "2",
                               "--out", str(tmp_path / "out")])
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert p.stderr.strip() == ("error: --chat: the chat template fails to render "
                                "(TemplateError: no equations); no checkpoint was written yet")
    assert not (tmp_path / "out").exists()
