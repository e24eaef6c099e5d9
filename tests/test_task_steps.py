"""arithmetic.step_labels: the exact step labels of prm.py's process reward model, on hand-written
completions (each expected label list written by hand from the rule: a step is good when the steps
up to it start the correct derivation, precedence respected and arithmetic right; the final step
also needs the right answer)."""
import pytest

import task
from tasks import arithmetic

CASES = [
    # prompt, completion, labels
    ("3+4*2=", "4*2=8,3+8=11#11", [1, 1]),           # the correct derivation
    ("3+4*2=", "3+4=7,7*2=14#14", [0, 0]),           # left to right: precedence broken at step 1
    ("9+8*1=", "9+8=17,17*1=17#17", [0, 0]),         # a+b*1: wrong order, right answer, still bad
    ("9-8*1=", "9-8=1,1*1=1#1", [0, 0]),             # the same with a minus
    ("9+8*1=", "8*1=8,9+8=17#17", [1, 1]),
    ("3+4*2=", "4*2=9,3+9=12#12", [0, 0]),           # an arithmetic slip at step 1 poisons the rest
    ("3+4*2=", "4*2=8,3+8=12#12", [1, 0]),           # ... at step 2
    ("3+4*2=", "4*2=8,3+8=11#12", [1, 0]),           # right steps, wrong answer after '#'
    ("3+4*2=", "4*2=8,3+8=11", [1, 0]),              # no answer: the last step is not finished
    ("3+4*2=", "4*2=8,3+8=11#11\r\n", [1, 1]),       # trailing whitespace, as the verifier allows
    ("3+4*2=", "4*2=8\n,3+8=11#11", [0, 0]),      # ... but not inside a step: '8\n' is not a result
    ("3+4*2=", "4*2=8#8,3+8=11#11", [0, 0]),                 # '#' before the last step
    ("3+4*2=", "4*2=8,3+8=11#11,1+1=2", [1, 1, 0]),          # a step after the answer
    ("3+4*2=", "2*4=8,3+8=11#11", [0, 0]),         # operands in another order than the derivation's
    ("3+4*2=", "4*2=8,8+3=11#11", [1, 0]),
    ("2*3+4=", "2*3=6,6+4=10#10", [1, 1]),        # the * comes first anyway: left to right is right
    ("9-8-7=", "9-8=1,1-7=-6#-6", [1, 1]),                   # negative numbers
    ("9-8-7=", "8-7=1,9-1=8#8", [0, 0]),                     # subtraction is left-associative
    ("1-9*9=", "9*9=81,1-81=-80#-80", [1, 1]),
    ("1-9*9=", "9*9=81,1--81=82#82", [1, 0]),
    ("(3+4)*2=", "3+4=7,7*2=14#14", [1, 1]),         # parenthesised problems: the parentheses first
    ("(3+4)*2=", "4*2=8,3+8=11#11", [0, 0]),
    ("3+4*2=", "", [0]),                                     # one empty step
    ("3+4*2=", "#11", [0]),
    ("3+4*2=", "4*2=8,", [1, 0]),               # a prefix cut at a ',' : the empty last step is bad
    ("3+4*2=", "4 *2=8,3+8=11#11", [0, 0]),                  # no spaces inside a step
]


@pytest.mark.parametrize("prompt,completion,labels", CASES)
def test_hand_written_step_labels(prompt, completion, labels):
    assert arithmetic.step_labels(prompt, completion) == labels
    assert len(labels) == len(arithmetic.split_steps(completion)) == completion.count(",") + 1


def test_one_label_per_step_and_the_split():
    assert arithmetic.split_steps("4*2=8,3+8=11#11") == ["4*2=8", "3+8=11#11"]
    assert arithmetic.split_steps("") == [""]


def test_every_demonstration_is_all_good_and_every_changed_answer_is_bad():
    """On every problem of the task: the correct demonstration is [1, 1]; the left-to-right one is
    [1, 1] exactly where its steps are the correct ones (no precedence problem), else [0, 0]
    whatever its answer; the correct steps with a wrong answer end in 0; and every all-good
    completion is one the verifier accepts."""
    for prompt in arithmetic.all_prompts():
        good = task.demonstration(prompt)
        assert arithmetic.step_labels(prompt, good) == [1, 1]
        assert task.reward(prompt, good) == 1.0
        ltr = arithmetic.demonstration(prompt, left_to_right=True)
        assert arithmetic.step_labels(prompt,
                                      ltr) == ([0, 0] if task.is_precedence(prompt) else [1, 1])
        wrong = good.rsplit("#", 1)[0] + f"#{arithmetic.answer(prompt) + 1}"
        assert arithmetic.step_labels(prompt, wrong) == [1, 0]


def test_never_raises():
    assert arithmetic.step_labels("not a prompt", "4*2=8,3+8=11#11") == [0, 0]
    assert arithmetic.step_labels("3+4*2=", None) == []
    assert arithmetic.step_labels(None, "1+1=2#2") == [0]
    assert arithmetic.step_labels("3+4*2=", "4*2=8,3+8=99999999999999#1") == [1, 0]
