"""Functions whose JSON schemas tests/test_tools.py compares with transformers' get_json_schema
(tests/golden/tools.json, written by make_golden.py): every kind of hint and docstring it reads."""
from enum import Enum
from typing import Any, Literal, Optional, Union


class Unit(Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly: integers, + - * and parentheses.

    Args:
        expression: The expression, e.g. 12*(3+4)
    """
    return expression


def weather(city: str, unit: Unit, days: int = 1, detailed: bool = False) -> dict:
    """
    Get the weather forecast for a city.

    Args:
        city: The city, for example
            Paris or Tokyo (a description on two lines)
        unit: The temperature unit
        days: How many days ahead
        detailed: Whether to add the wind

    Returns:
        The forecast, a day at a time.
    """
    return {}


def search(query: str, limit: Optional[int] = None, tags: list[str] = (),
           order: Literal["new", "old"] = "new", weights: dict[str, float] = None,
           span: tuple[int, int] = (0, 1), value: Union[int, str] = 0, anything: Any = None,
           mode: str = "fast"):
    """Search the archive.

    Args:
        query (str): What to look for
        limit: At most this many results
        tags: Tags every result must have
        order: Newest or oldest first
        weights: A weight per field
        span: The years to search, first and last
        value: A number or a name
        anything: Whatever else
        mode: How to search (choices: ["fast", "exact"])

    Raises:
        ValueError: never
    """
    return []


def unions(a: Union[str, int], b: Union[list[int], dict[str, int]], c: Optional[Union[float, bool]],
           d: Union[dict[str, int], list[str], None] = None) -> str:
    """Unions in declared order: scalars (a type list), and others (anyOf), nullable or not.

    Args:
        a: a name or a number
        b: numbers, as a list or by name
        c: a fraction or a flag, or null
        d: by name or a list of names, or null
    """
    return ""


FUNCTIONS = [calculator, weather, search, unions]
