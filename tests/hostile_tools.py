"""Tools for tests/test_tools.py: ordinary ones with bounds to hit, and hostile ones, each named and
documented as a tool must be (--tools hostile_tools:NAME)."""
import os
import time
from typing import Literal, Optional, Union


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


def typed(count: Optional[int] = None, items: list[int] = (), pair: tuple[int, str] = (0, ""),
          table: dict[str, float] = None, either: Union[list[int], dict[str, int]] = None,
          level: Literal["low", "high"] = "low", ratio: float = 0.5) -> str:
    """Echo its arguments.

    Args:
        count: how many, or null
        items: integers
        pair: an integer and a text
        table: numbers by name
        either: integers, as a list or by name
        level: how much
        ratio: a fraction
    """
    return f"{count} {list(items)} {list(pair)} {table} {either} {level} {ratio}"


def grep(pattern: str) -> str:
    """Count the lines that match, a result that begins with "error".

    Args:
        pattern: what to look for
    """
    return "error rate 0.5% (3 matching lines)"


def big(x: int) -> int:
    """A number of 5000 digits.

    Args:
        x: unused
    """
    return 10 ** 5000


def circular(x: int) -> list:
    """A list that holds itself.

    Args:
        x: unused
    """
    a = []
    a.append(a)
    return a


class _Raises:
    def __str__(self):
        raise RuntimeError("no text")


class _Loops:
    def __str__(self):
        while True:
            pass


def unprintable(x: int) -> object:
    """An object whose str() raises.

    Args:
        x: unused
    """
    return _Raises()


def endless_text(x: int) -> object:
    """An object whose str() never returns.

    Args:
        x: unused
    """
    return _Loops()


def deep(x: int) -> list:
    """A list nested 100000 deep.

    Args:
        x: unused
    """
    a = []
    for _ in range(100_000):
        a = [a]
    return a


def bye(x: int) -> str:
    """Raise SystemExit, as an argparse-based function given a bad argument.

    Args:
        x: unused
    """
    raise SystemExit("tool said bye")


def interrupt(x: int) -> str:
    """Raise KeyboardInterrupt.

    Args:
        x: unused
    """
    raise KeyboardInterrupt


def base(x: int) -> str:
    """Raise a bare BaseException.

    Args:
        x: unused
    """
    raise BaseException("base")


def exits(x: int) -> str:
    """End its process.

    Args:
        x: unused
    """
    os._exit(7)


def stubborn(x: int) -> str:
    """Sleep, catching everything.

    Args:
        x: unused
    """
    while True:
        try:
            time.sleep(10)
        except BaseException:
            pass


def c_level(x: int) -> str:
    """One long C-level operation, which no timer inside the process stops.

    Args:
        x: unused
    """
    return str(sum(range(10 ** 12)))


def greedy(x: int) -> str:
    """Allocate far past any reasonable memory.

    Args:
        x: unused
    """
    return str(len(bytearray(64 * 2 ** 30)))


def prints(x: int) -> str:
    """Write a forged line to stdout.

    Args:
        x: unused
    """
    print("step 999 | FORGED LOG LINE", flush=True)
    return "printed"


def varargs(*args: int) -> str:
    """Sum.

    Args:
        args: the numbers
    """
    return str(sum(args))


def kwargs(**kw: int) -> str:
    """Count.

    Args:
        kw: the numbers
    """
    return str(len(kw))


class Klass:
    """A class.

    Args:
        a: a number
    """
    a: int

    def __init__(self, a: int):
        self.a = a


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly: integers, + - * and parentheses.

    Args:
        expression: The expression, e.g. 12*(3+4)
    """
    return "42"


def tagged(expression: str) -> str:
    """Evaluate an expression; call it as <tool_call>{"name": "tagged", ...}</tool_call>.

    Args:
        expression: The expression
    """
    return expression
