"""
The tasks, one module each, and the interface they share. Every algorithm file reaches a task only through task.py,
which holds the one chosen with --task; each module here builds its Task with `task(...)`.

    arithmetic   three-operand arithmetic where operator precedence matters (the default; generated)
    countdown    reach a target from 3 or 4 numbers with + - * / (Gandhi et al. 2024; generated)
    gsm8k        grade-school word problems from a local JSONL file in GSM8K's format (Cobbe et al. 2021)
    toolcalc     two-digit products a small model cannot do in its head, and a calculator it may call (agent.py)
"""
from typing import Callable, NamedTuple


class Task(NamedTuple):
    name: str
    max_new_tokens: int                  # the completion budget the default demonstrations fit in
    eval_prompts: Callable               # () -> the fixed held-out prompts (a list)
    sample_prompts: Callable             # (rng, n, precedence_share) -> n training prompts, never held-out ones
    demonstration: Callable              # (prompt, mistake) -> a completion: the right one, or the demonstrator's slip
    synthetic_mistake: Callable          # (prompt) -> a wrong completion (the rejected side of a preference pair)
    reward: Callable                     # (prompt, completion, format_weight) -> correct + format_weight * well formed
    split_answer: Callable               # (completion) -> (reasoning, answer text), how the R1 format rewrites it
    score_answer: Callable               # (prompt, answer text) -> bool: the verifier on an answer alone
    is_precedence: Callable              # (prompt) -> bool: the problems where the demonstrator's slip shows
    max_prompt_tokens: Callable          # (tokenizer) -> the longest prompt's length in tokens
