"""tasks/gsm8k.py: the loader on a handful of problems written for the test (and on broken files),
the answer extraction and its normalisation, hand-worked."""
import json
from decimal import Decimal

import pytest

from conftest import Counted
from tasks import gsm8k

PROBLEMS = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
     "answer": "Tom has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"},
    {"question": "A shop sells 1,200 pens a day. How many in 3 days?",
     "answer": "1,200 * 3 = <<1200*3=3600>>3,600 pens.\n#### 3,600"},
    {"question": "A ticket costs $12.50. What do 2 cost?",
     "answer": "2 * 12.50 = 25.00\n#### 25.00"},
    {"question": "It is 5 degrees and falls by 8. What is it now?",
     "answer": "5 - 8 = -3\n#### -3"},
]


def write(tmp_path, rows, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_load_reads_questions_solutions_and_the_number_after_the_marks(tmp_path):
    problems, skipped = gsm8k.load(write(tmp_path, PROBLEMS + [""]))      # a blank line is ignored
    assert skipped == 0 and len(problems) == 4
    assert [p["number"] for p in problems] == [Decimal(7), Decimal(3600), Decimal(25), Decimal(-3)]
    assert problems[0]["solution"] == "Tom has 3 + 4 = <<3+4=7>>7 apples."
    assert problems[1]["question"].startswith("A shop sells 1,200 pens")


def test_an_answer_without_a_number_is_skipped_and_counted(tmp_path):
    rows = PROBLEMS + [{"question": "q", "answer": "no marks here"},
                       {"question": "q", "answer": "#### many"}]
    problems, skipped = gsm8k.load(write(tmp_path, rows))
    assert (len(problems), skipped) == (4, 2)


@pytest.mark.parametrize("rows, words", [
    ([PROBLEMS[0], "{not json"], ["line 2", "not a JSON object"]),
    ([PROBLEMS[0], {"question": "q"}], ["line 2", '"answer"']),
    ([{"question": 3, "answer": "#### 3"}], ["line 1", '"question"']),
    ([[1, 2]], ["line 1"]),
    ([{"question": "q", "answer": "x"}], ["no problem with a parsable answer", "1 skipped"]),
])
def test_a_broken_file_is_one_error_naming_the_line(tmp_path, rows, words):
    with pytest.raises(ValueError) as e:
        gsm8k.load(write(tmp_path, rows))
    for w in words:
        assert w in str(e.value)


def test_a_missing_or_unreadable_file_is_one_error(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        gsm8k.load(str(tmp_path / "absent.jsonl"))
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ValueError, match="cannot be read"):
        gsm8k.load(str(tmp_path / "bin.jsonl"))


@pytest.mark.parametrize("text, want", [
    ("7", Decimal(7)), ("1,234", Decimal(1234)), ("$1,234", Decimal(1234)),
    ("1234.00", Decimal(1234)),
    ("1234.50", Decimal("1234.5")), ("-3", Decimal(-3)), ("7.", Decimal(7)), (" 42 ", Decimal(42)),
    ("seven", None), ("", None), ("1.2.3", None), (None, None), ("1" * 50, None),
])
def test_normalise(text, want):
    assert gsm8k.normalise(text) == want


@pytest.mark.parametrize("completion, truth, want", [
    ("so 3 + 4 = 7 apples. #### 7", 7, True),
    ("#### 3,600", "3600", True),
    ("#### 25", "25.00", True),                      # normalised (GSM8K compares the strings)
    ("#### 25.5", 25, False),
    (" #### 7 apples, 2 of them red", 7, True),      # the number right after the marks ...
    (" #### 7 apples, 2 of them red", 2, False),     # ... not the last one after them
    ("#### 7 #### 8", 7, True),                      # the first marks, as GSM8K's search finds them
    ("#### 7 #### 8", 8, False),
    ("####7", 7, False), ("#### $7", 7, False),      # GSM8K's rule: '#### ' then the number itself
    ("#### many, #### 12", 12, True),                # the first '#### ' followed by a number
    ("it is 5 - 8 = -3", -3, False),                 # no marks: no answer (GSM8K's [invalid])
    # the tag wins over the last number
    ("<think>3 + 4 = 7, wait, 8</think> <answer>7</answer>", 7, True),
    ("<answer>The answer is $1,200.</answer>", 1200, True),
    ("<answer>7 apples, 2 of them red</answer>", 7, True),      # the first number in the tag
    ("<answer>7 apples, 2 of them red</answer>", 2, False),
    ("no number at all", 7, False),
    (None, 7, False),
    ("#### 7", "not a number", False),
    ("#### 7" + " " * gsm8k.MAX_CHARS, 7, False),               # too long to read
])
def test_score_gsm8k_hand_worked(completion, truth, want):
    assert gsm8k.score_gsm8k(completion, truth) is want


def test_the_verifier_stays_fast_on_hostile_completions(monkeypatch):
    """400 kB of unclosed '<answer>' tags (quadratic for the tag regex) and of '#### ' marks without
    a number: each scored 0 with no regex run at all (past MAX_CHARS nothing is read); at MAX_CHARS
    and one past it, the work counted, not timed: two scans at most, of MAX_CHARS characters."""
    scanned = []
    # the tag regex's worst case is quadratic in what it scans: MAX_CHARS^2 / 9 steps, ~0.1 s
    assert gsm8k.MAX_CHARS <= 20_000
    for name in ("_NUMBER", "_MARKS", "_ANSWER_TAG"):
        monkeypatch.setattr(gsm8k, name, Counted(scanned, getattr(gsm8k, name)))
    for text in ("<answer>1" * 50_000, "#### x" * 80_000, "#" * (gsm8k.MAX_CHARS + 1)):
        assert gsm8k.score_gsm8k(text, 1) is False and scanned == []
    for text in (("<answer>1" * 3000)[:gsm8k.MAX_CHARS], ("#### x" * 4000)[:gsm8k.MAX_CHARS]):
        scanned.clear()
        assert len(text) == gsm8k.MAX_CHARS and gsm8k.score_gsm8k(text, 1) is False
        assert len(scanned) <= 2 and max(scanned) == gsm8k.MAX_CHARS, scanned


def test_a_deeply_nested_line_is_one_error(tmp_path):
    path = write(tmp_path, PROBLEMS + ["[" * 100_000 + "]" * 100_000])
    with pytest.raises(ValueError, match="line 5: not a JSON object"):
        gsm8k.load(path)
