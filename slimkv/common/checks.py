"""Validators shared by every option check: each raises ValueError naming the option and what is allowed."""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Iterable
from typing import Any


def close_matches(word: str, choices: Iterable[Any]) -> str:
    """' (did you mean ...?)' suffix for error messages, or ''."""
    near = difflib.get_close_matches(str(word), [str(c) for c in choices], n=3)
    return f" (did you mean {', '.join(near)}?)" if near else ""


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> None:
    """``value`` must be one of ``choices``."""
    choices = tuple(choices)
    if isinstance(value, bool) or value not in choices:
        raise ValueError(f"{name}={value!r} is not allowed; allowed values: {', '.join(map(str, choices))}{close_matches(value, choices)}")


def check_int(name: str, value: Any, minimum: int = 0, maximum: int | None = None) -> None:
    """``value`` must be an int (not a bool) in [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (maximum is not None and value > maximum):
        upper = f" and <= {maximum}" if maximum is not None else ""
        raise ValueError(f"{name} must be an integer >= {minimum}{upper}, got {value!r}")


def check_float(name: str, value: Any, low: float = -math.inf, high: float = math.inf, *, open_low: bool = False, open_high: bool = False) -> None:
    """``value`` must be a finite number in the interval (``open_low``/``open_high`` exclude the ends)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if open_low else value >= low) and (value < high if open_high else value <= high)
    if not ok:
        bounds = [f"> {low}" if open_low else f">= {low}"] if low != -math.inf else []
        bounds += [f"< {high}" if open_high else f"<= {high}"] if high != math.inf else []
        raise ValueError(f"{name} must be a finite number{' ' + ' and '.join(bounds) if bounds else ''}, got {value!r}")


def check_bool(name: str, value: Any) -> None:
    """``value`` must be True or False (not 1, "yes", ...)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def check_name(name: str, value: Any) -> None:
    """``value`` must be a plain file or folder name (letters, digits, '_', '.', '-'; no path
    separators, not starting with '.'), so it can never point outside the folder it is used in."""
    if not isinstance(value, str) or not _SAFE_NAME.fullmatch(value) or ".." in value:
        raise ValueError(f"{name} must start with a letter or digit and contain only letters, digits, '_', '.', '-' (no '..'), got {value!r}")


class Checked:
    """An attribute checked on every assignment (not on every use): ``backend = Checked(check_choice,
    ("sdpa", "reference"))`` in a class body runs ``check_choice("backend", value, ...)`` whenever
    ``obj.backend = value`` is set, so hot paths read it without validating."""

    def __init__(self, check: Callable[..., None], *args: Any) -> None:
        self.check, self.args = check, args

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot = name, f"_{name}"

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        return self if obj is None else getattr(obj, self.slot)

    def __set__(self, obj: Any, value: Any) -> None:
        self.check(self.name, value, *self.args)
        object.__setattr__(obj, self.slot, value)
