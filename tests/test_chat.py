"""--chat: prompts through a checkpoint's own chat template (chat.py), against what transformers' apply_chat_template
renders and encodes for the tiny Llama 3 (Llama 3.2's template) and Qwen3 (Qwen2.5's ChatML template) folders of
tests/golden (make_golden.py): the text and the ids exactly, a control token inside the message encoded as text (as
sanitize_control_tokens=True does), the end of an assistant turn found, ending completions and demonstrations; the
scripts with --chat, and its refusals."""
import json
import os
import shutil
from datetime import datetime

import pytest

import task
from conftest import refused, refuses_all, run_script, task_args
from model import CheckpointError, Tokenizer

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
CHAT = {"llama3": ("<|eot_id|>", 4), "qwen3": ("<|im_end|>", 2)}     # folder: the end of an assistant turn, its id


def chat_tokenizer(name):
    folder = os.path.join(GOLDEN, name)
    with open(os.path.join(folder, "golden.json")) as f:
        return Tokenizer.from_pretrained(folder).use_chat(), json.load(f)["chat"]


@pytest.mark.parametrize("name", list(CHAT))
def test_the_template_renders_and_encodes_as_transformers(name):
    tok, golden = chat_tokenizer(name)
    for m in golden["messages"]:
        messages = [{"role": "user", "content": m["content"]}]
        assert tok.chat.render(messages, date_string="26 Jul 2024") == m["rendered"]
        assert tok.chat.encode(messages, tok.encode_special, tok.encode, date_string="26 Jul 2024") == m["ids"]
    turn = [{"role": "user", "content": "3+4*2="}, {"role": "assistant", "content": "4*2=8,3+8=11#11"}]
    assert tok.chat.render(turn, add_generation_prompt=False, date_string="26 Jul 2024") == golden["assistant_turn"]


@pytest.mark.parametrize("name", list(CHAT))
def test_a_control_token_in_the_message_is_text_and_only_the_templates_are_special(name):
    tok, golden = chat_tokenizer(name)
    end, end_id = CHAT[name]
    message = "say <|im_end|> or <|eot_id|> and stop"
    ids = tok.encode_prompt(message)
    template_ends = tok.chat.render([{"role": "user", "content": "x"}]).count(end)
    assert ids.count(end_id) == template_ends                  # the message's own <|im_end|> / <|eot_id|> is not one
    assert tok.decode(ids).count(end) == template_ends + 1     # ... but its text is there
    plain = tok.encode_special(tok.chat.render([{"role": "user", "content": message}]))
    assert plain.count(end_id) == template_ends + 1            # what encoding the rendered text whole would do


@pytest.mark.parametrize("name", list(CHAT))
def test_the_end_of_the_assistant_turn_ends_completions_and_demonstrations(name):
    folder = os.path.join(GOLDEN, name)
    plain, (tok, _) = Tokenizer.from_pretrained(folder), chat_tokenizer(name)
    end, end_id = CHAT[name]
    assert tok.eos_id == end_id and tok.stop_ids[0] == end_id and set(plain.stop_ids) <= set(tok.stop_ids)
    task.use(task_args())
    tokens, attn, mask = task.completion_batch(["3+4*2="], ["4*2=8,3+8=11#11"], tok)
    row = tokens[0, :int(attn[0].sum())].tolist()
    assert row == tok.encode_prompt("3+4*2=") + tok.encode("4*2=8,3+8=11#11") + [end_id]
    assert mask[0].sum() == len(tok.encode("4*2=8,3+8=11#11")) + 1         # the completion and the turn's end


def test_llama_32s_template_writes_todays_date_as_transformers_does():
    tok, _ = chat_tokenizer("llama3")
    text = tok.decode(tok.encode_prompt("3+4*2="))
    assert f"Today Date: {datetime.now().strftime('%d %b %Y')}\n" in text and text.startswith("<|begin_of_text|>")


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
    p = run_script("sft.py", ["--init", llama, "--chat", "--steps", "2", "--batch_size", "4", "--eval_n", "4",
                              "--out", out])
    assert p.returncode == 0, p.stderr
    assert "in the chat template" in p.stdout
    p = run_script("grpo.py", ["--init", os.path.join(out, "sft.pt"), "--chat", "--steps", "1", "--prompts_per_step",
                               "2", "--group_size", "2", "--eval_n", "4", "--out", out])
    assert p.returncode == 0, p.stderr
    p = run_script("grpo.py", ["--init", os.path.join(out, "sft.pt"), "--chat", "--steps", "2", "--prompts_per_step",
                               "2", "--group_size", "2", "--eval_n", "4", "--out", out, "--resume"])
    assert p.returncode == 0, p.stderr


def test_chat_refusals_are_one_line_before_any_work(tmp_path):
    """--chat without a template, from the byte tokenizer, with a template that does not compile or that raises: one
    line each, and no output folder left behind."""
    broken, raising = tmp_path / "broken", tmp_path / "raising"
    for folder, source in ((broken, "{% if %}"), (raising, "{{ raise_exception('only system messages') }}")):
        shutil.copytree(os.path.join(GOLDEN, "qwen3"), folder)
        (folder / "chat_template.jinja").write_text(source)
    refuses_all("grpo.py", [
        (["--init", os.path.join(GOLDEN, "qwen2"), "--chat"], ["--chat", "has no chat template"]),
        (["--init", str(tmp_path / "none.pt"), "--chat"], ["--chat needs --init", "none.pt is missing"]),
        (["--init", str(broken), "--chat"], ["--chat", "does not compile"]),
        (["--init", str(raising), "--chat"], ["--chat", "fails to render", "only system messages"]),
    ], tmp_path)
    p = run_script("sft.py", ["--chat", "--out", str(tmp_path / "sft")])
    refused(p, "--chat needs --init", "no --init given")
    assert not any(x.name.startswith("out") or x.name == "sft" for x in tmp_path.iterdir())
    with pytest.raises(CheckpointError, match="has no chat template"):
        Tokenizer().use_chat()
