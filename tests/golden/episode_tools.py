"""The calculator as make_golden.py's TOOLS describes it (its golden episodes' tool), for
tests/test_tools.py."""
from tasks import toolcalc


def calculator(expression: str):
    """Evaluate an arithmetic expression.

    Args:
        expression: e.g. 12*46
    """
    return toolcalc.calculator(expression)
