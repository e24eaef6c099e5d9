"""
GSM8K-style grade-school word problems from a local JSONL file (Cobbe et al. 2021, "Training
Verifiers to Solve Math Word Problems", arXiv 2110.14168): one object per line, {"question": ...,
"answer": "... #### 42"}, the format GSM8K ships in. The user provides the file
(`--data path.jsonl`); nothing is downloaded. A tiny model of ours cannot solve these: the task is
for real checkpoints (`--init <Hugging Face folder>`).

    prompt       Question: Tom has 3 apples and buys 4 more. How many apples does he have?\nAnswer:
    completion    Tom has 3 + 4 = 7 apples. #### 7<|endoftext|>

Held-out set: a second file (`--data train.jsonl test.jsonl`, as GSM8K ships), else the last tenth
of the one file (at most 512 problems), never drawn for training. Demonstrations are the file's
solutions with GSM8K's calculator annotations (<<3+4=7>>) removed; there is no demonstrator's
slip here.

Verifier (`score_gsm8k`): GSM8K's own rule (grade_school_math/dataset.py): the answer is the number
right after the first '#### ' (`#### (-?[0-9.,]+)`), and a completion without one is wrong; with
R1's tags, the first number in the last <answer>...</answer>. One variant, stated: numbers compare
after normalising ("1,234", "1234.00" and "1234" are equal, where GSM8K compares the strings; "-3"
and "3" are not). A completion over MAX_CHARS characters scores 0 unread, which keeps every regex
here linear in what it reads. It never raises.
"""
import json
import os
import re
from decimal import Decimal, InvalidOperation

from tasks import Task

MAX_NEW_TOKENS = 512

MAX_CHARS = 20_000  # a longer completion scores 0 (1024 tokens of a real tokenizer: ~5,000 chars)
MAX_ROW_CHARS = 100_000    # the longest question or answer of a --data row (GSM8K's: under 1,000)

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")
_MARKS = re.compile(r"#### (\-?[0-9\.\,]+)")         # GSM8K's ANS_RE (grade_school_math/dataset.py)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)


def normalise(text):
    """A number's text as a Decimal ('1,234.50' -> 1234.5, '$7' -> 7); None if not one number."""
    if not isinstance(text, str):
        return None
    text = text.strip().rstrip(".").replace(",", "").replace("$", "")
    if not re.fullmatch(r"-?\d+(?:\.\d+)?", text) or len(text) > 40:
        return None
    try:
        return Decimal(text).normalize()
    except InvalidOperation:
        return None


def first_number(text):
    """The first number written in `text` (commas and a '$' allowed), normalised; else None."""
    match = _NUMBER.search(text) if isinstance(text, str) else None
    return normalise(match.group()) if match else None


def marked_answer(text):
    """GSM8K's answer: the number right after the first '#### ', normalised; else None."""
    match = _MARKS.search(text) if isinstance(text, str) else None
    return normalise(match.group(1)) if match else None


def extract_answer(completion):
    """The answer a completion gives: the first number in its last <answer>...</answer> if it has
    one, else the number right after its first '#### ' (GSM8K's rule); None otherwise, or past
    MAX_CHARS characters."""
    if not isinstance(completion, str) or len(completion) > MAX_CHARS:
        return None
    tags = _ANSWER_TAG.findall(completion)
    return first_number(tags[-1]) if tags else marked_answer(completion)


def score_gsm8k(completion, truth):
    """True when the completion's answer (extract_answer) equals `truth` (a number or its text).
    Never raises."""
    truth = normalise(str(truth)) if not isinstance(truth, Decimal) else truth
    answer = extract_answer(completion)
    return truth is not None and answer is not None and answer == truth


def load(path):
    """The problems of a GSM8K-style JSONL file: (problems, skipped). Each problem is {"question",
    "solution", "number"}, number the Decimal right after '#### ' in the answer. A line whose answer
    has no such number is skipped and counted. Anything else wrong is a ValueError naming the file
    and the line."""
    if not os.path.isfile(path):
        raise ValueError(f"--data {path}: no such file (a GSM8K-style JSONL file, one "
                         f'{{"question": ..., "answer": "... #### 42"}} per line)')
    problems, skipped = [], 0
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--data {path}: cannot be read ({e})") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            raise ValueError(f"--data {path}, line {i}: "
                             "not a JSON object (or nested too deeply)") from None
        if not (isinstance(row, dict) and isinstance(row.get("question"), str)
                and isinstance(row.get("answer"), str)):
            raise ValueError(f"--data {path}, line {i}: "
                             "needs a string \"question\" and a string \"answer\"")
        for key in ("question", "answer"):
            if len(row[key]) > MAX_ROW_CHARS:
                raise ValueError(f"--data {path}, line {i}: a {key} of {len(row[key]):,} "
                                 f"characters (at most {MAX_ROW_CHARS:,})")
        number = marked_answer(row["answer"])
        if number is None:
            skipped += 1
            continue
        solution = row["answer"].split("####", 1)[0].strip()
        problems.append({"question": row["question"].strip(), "solution": solution,
                         "number": number})
    if not problems:
        raise ValueError(f"--data {path}: no problem with a parsable answer after '####' "
                         f"({skipped} skipped)")
    return problems, skipped


# -----------------------------------------------------------------------------
# The interface every task module shares (tasks.Task)

def prompt_of(question):
    return f"Question: {question}\nAnswer:"


def split_answer(completion):
    """' 3 + 4 = 7. #### 7' -> (' 3 + 4 = 7.', ' 7'): the reasoning, the text after the last
    '####'."""
    reasoning, _, answer = completion.rpartition("####")
    return reasoning.rstrip(), answer


def task(paths):
    """(Task, skipped): this task as a tasks.Task over the problems of `paths` (one JSONL file, or a
    training and a held-out file), and how many lines were skipped for an answer with no number."""
    loaded = [load(p) for p in paths]
    skipped = sum(k for _, k in loaded)
    if len(loaded) == 2:
        train, held_out = loaded[0][0], loaded[1][0]
    else:
        problems = loaded[0][0]
        n = min(512, len(problems) // 10)
        if n == 0 or len(problems) - n == 0:
            raise ValueError(f"--data {paths[0]}: {len(problems)} usable problems; "
                             "a single file needs at least 10 "
                             "(the last tenth is held out), or give a held-out file as well")
        train, held_out = problems[:-n], problems[-n:]
    truth = {prompt_of(p["question"]): p for p in train + held_out}
    held_out_prompts = [prompt_of(p["question"]) for p in held_out]
    train_prompts = [prompt_of(p["question"]) for p in train
                     if prompt_of(p["question"]) not in set(held_out_prompts)]
    if not train_prompts:
        raise ValueError(f"--data {' '.join(paths)}: every training problem is also a held-out one")

    def demonstration(prompt, mistake=False):    # the file's solution; no slip (mistake is ignored)
        return (" " + re.sub(r"<<[^>]*>>", "", truth[prompt]["solution"])
                + f" #### {truth[prompt]['number']:f}")

    def synthetic_mistake(prompt):                   # the solution with its final number one larger
        return demonstration(prompt).rpartition("####")[0] + f"#### {truth[prompt]['number'] + 1:f}"

    def score_answer(prompt, text):                       # an <answer> tag's text: its first number
        return prompt in truth and score_gsm8k(f"<answer>{text}</answer>", truth[prompt]["number"])

    def reward(prompt, completion, format_weight=0.0):  # well formed: '#### ' and then a number
        correct = prompt in truth and score_gsm8k(completion, truth[prompt]["number"])
        well_formed = isinstance(completion, str) and len(completion) <= MAX_CHARS and \
            marked_answer(completion) is not None
        return float(correct) + format_weight * float(well_formed)

    return Task("gsm8k", MAX_NEW_TOKENS, lambda: list(held_out_prompts),
                lambda rng, n, precedence_share=None: [rng.choice(train_prompts) for _ in range(n)],
                demonstration, synthetic_mistake, reward, split_answer, score_answer,
                lambda prompt: False,
                lambda tok: max(len(tok.encode(p)) for p in truth)), skipped
