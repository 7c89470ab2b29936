"""Lenient scalar casts shared by config and request parsing.

Triton parameters and JSON sampling parameters often carry numbers and booleans
as strings ("0", "1500", "true"); these accept them and raise ValueError otherwise.
"""

from __future__ import annotations

from typing import Any


def to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(value)
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        if "." in text or "e" in text.lower():
            as_float = float(text)
            if not as_float.is_integer():
                raise ValueError(value)
            return int(as_float)
        return int(text)
    return int(value)


def to_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(value)
    return float(value)


def to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(value)
