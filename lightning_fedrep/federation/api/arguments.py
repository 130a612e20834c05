"""Checks of public constructors' arguments, run at construction, before any Trainer starts.

Every failure names the argument (with its owner, e.g. ``NeuralCollapse(metrics_batch_size=...)``), says
what it got and what is valid: a ``TypeError`` for a value of the wrong kind (a string, a bool for a
number, NaN), a ``ValueError`` for one out of range. Numbers must be finite.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any


def _label(owner: str, name: str) -> str:
    return f"{owner}({name}=...)" if owner else name


def check_int(
    name: str, value: Any, minimum: int | None = None, maximum: int | None = None, owner: str = ""
) -> int:
    """``value`` as an ``int`` in ``[minimum, maximum]`` (an integral float such as ``2.0`` is refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{_label(owner, name)} must be an integer{_range(minimum, maximum)}, got {type(value).__name__} "
            f"({value!r})."
        )
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{_label(owner, name)} must be an integer{_range(minimum, maximum)}, got {value}.")
    return value


def check_optional_int(
    name: str, value: Any, minimum: int | None = None, maximum: int | None = None, owner: str = ""
) -> int | None:
    """``None`` or :func:`check_int`."""
    return None if value is None else check_int(name, value, minimum, maximum, owner)


def check_real(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    owner: str = "",
) -> float:
    """``value`` as a finite ``float`` in the interval from ``low`` to ``high`` (open ends as asked)."""
    interval = _interval(low, high, low_open, high_open)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{_label(owner, name)} must be a number{interval}, got {type(value).__name__} ({value!r})."
        )
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{_label(owner, name)} must be a finite number{interval}, got {value}.")
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if below or above:
        raise ValueError(f"{_label(owner, name)} must be a number{interval}, got {value}.")
    return value


def check_choice(name: str, value: Any, choices: Iterable[Any], owner: str = "") -> Any:
    """``value`` if it is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{_label(owner, name)} must be one of {listed}; got {value!r}.")
    return value


def check_bool(name: str, value: Any, owner: str = "") -> bool:
    """``value`` if it is ``True`` or ``False`` (not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise TypeError(
            f"{_label(owner, name)} must be True or False, got {type(value).__name__} ({value!r})."
        )
    return value


def check_clients_per_round(value: Any, owner: str = "") -> float | int:
    """How many clients a round samples: an ``int`` >= 1 is a count, a ``float`` in (0, 1] a fraction.

    The type decides, in Python and in YAML alike (``1`` is one client, ``1.0`` every client); a float
    above 1 (``5.0``) is refused as ambiguous, as are strings, bools, NaN and infinities.
    """
    name = _label(owner, "clients_per_round")
    rule = "an integer count >= 1 (e.g. 5) or a fraction in (0, 1] written as a float (e.g. 0.1; 1.0 = all)"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {rule}, got {type(value).__name__} ({value!r}).")
    if isinstance(value, numbers.Integral):
        if value < 1:
            raise ValueError(f"{name} must be {rule}, got {value}.")
        return int(value)
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be {rule}, got {value}.")
    if value > 1:
        raise ValueError(
            f"{name}={value} is a float above 1: ambiguous. Write {int(value)} for a count of clients "
            f"(an integer), or a fraction in (0, 1]."
            if value.is_integer()
            else f"{name} must be {rule}, got {value}."
        )
    return value


def _range(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    if minimum is not None:
        return f" >= {minimum}"
    return f" <= {maximum}" if maximum is not None else ""


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is None and high is None:
        return ""
    if high is None:
        return f" {'>' if low_open else '>='} {low:g}"
    if low is None:
        return f" {'<' if high_open else '<='} {high:g}"
    return f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
