"""Lenient scalar casts shared by config and request parsing.

Triton parameters and JSON sampling parameters often carry numbers and booleans
as strings ("0", "1500", "true"); these accept them and raise ValueError otherwise.
"""

from __future__ import annotations

import json
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


def setting_items(field: str, value: Any) -> dict[str, Any]:
    """A setting made of keys (vLLM's --speculative-config, --kv-events-config): a dict (Python
    API), a JSON object, or `key=value,key=value` (config.pbtxt and `pagedserve serve --set`,
    which cannot carry quotes). Errors name `field`."""
    from .errors import ConfigError

    if isinstance(value, dict):
        return dict(value)
    if not isinstance(value, str):
        raise ConfigError(field, f"expected a dict, a JSON object or key=value,key=value; got {value!r}")
    text = value.strip()
    if text.startswith("{"):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(field, f"is not valid JSON ({error.msg} at character {error.pos})") from None
        if not isinstance(parsed, dict):
            raise ConfigError(field, "must be a JSON object")
        return parsed
    items: dict[str, Any] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, item = part.partition("=")
        if not sep or not key.strip():
            raise ConfigError(field, f"expected key=value,key=value, got {part.strip()!r}")
        items[key.strip()] = item.strip()
    return items
