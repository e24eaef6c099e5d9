"""
The tasks, one module each, and the interface they share. Every algorithm file reaches a task only
through task.py, which holds the one chosen with --task; each module here builds its Task with
`task(...)`.

    arithmetic   three-operand arithmetic where operator precedence matters (default; generated)
    countdown    reach a target from 3 or 4 numbers with + - * / (Gandhi et al. 2024; generated)
    gsm8k        grade-school word problems from a local JSONL file (Cobbe et al. 2021)
    toolcalc     two-digit products too hard to do in one's head, and a calculator (agent.py)
"""
from typing import Callable, NamedTuple


class Task(NamedTuple):
    name: str
    max_new_tokens: int          # the completion budget the default demonstrations fit in
    eval_prompts: Callable       # () -> the fixed held-out prompts (a list)
    sample_prompts: Callable     # (rng, n, precedence_share) -> n training prompts, none held out
    demonstration: Callable      # (prompt, mistake) -> the right completion, or the slip (mistake)
    synthetic_mistake: Callable  # (prompt) -> a wrong completion (a rejected side of a pair)
    reward: Callable             # (prompt, completion, format_weight) -> correct + format bonus
    split_answer: Callable       # (completion) -> (reasoning, answer text), for the R1 format
    score_answer: Callable       # (prompt, answer text) -> bool: the verifier on an answer alone
    is_precedence: Callable      # (prompt) -> bool: a problem where the demonstrator's slip shows
    max_prompt_tokens: Callable  # (tokenizer) -> the longest prompt's length in tokens
