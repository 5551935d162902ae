"""The one place where the KV connector checks values it did not make itself.

``kv_transfer_params`` reach a decode engine from any HTTP client: vLLM's
OpenAI routes take them in the request's body, where JSON's ``1e999`` arrives as
infinity and an integer may have any number of digits. Each value is checked
here before anything computes with it, and anything wrong raises one error,
``KVParamsError``, naming the field: ``int(inf)`` raised ``OverflowError``, which
no handler expected and which killed the engine from inside vLLM's scheduler.
The connector's own settings (``kv_connector_extra_config``) go through the
same checks.

Pure: nothing here imports vLLM or the rest of raydirect.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

# Offsets, sizes and counts fit the int64 arithmetic of the reads' rows.
INT64_MAX = (1 << 63) - 1
# vLLM's block tables are int32.
BLOCK_ID_MAX = (1 << 31) - 1
# The longest lease a prefill engine may set (kv_lease_duration), so the latest
# expiry a decode engine accepts: a read's deadline, and how long it keeps what it
# needs to refuse a second read of one hand-off, never exceed it.
MAX_LEASE_S = 3600.0
# A request id (vLLM's are ~50 characters; a client's X-Request-Id may be longer).
MAX_ID_CHARS = 1024


class KVParamsError(ValueError):
    """A field of ``kv_transfer_params`` (or of the connector's settings) that is
    missing or wrong; ``field`` names it as a path, ``raydirect.layout[...]``."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        super().__init__(f"{field}: {problem}")


def entry(mapping: Mapping[str, Any], key: str, where: str = "") -> Any:
    """``mapping[key]``, or ``KVParamsError`` naming ``where + key`` as missing."""
    if key not in mapping:
        raise KVParamsError(where + key, "missing")
    return mapping[key]


def whole(value: Any, name: str, low: int = 0, high: int = INT64_MAX) -> int:
    """An integer in ``[low, high]``: a bool, a float (``2.0``, ``inf``) or a
    string is refused, and so is an integer of any size outside the range."""
    if type(value) is not int:
        raise KVParamsError(name, f"{_shown(value)} is not an integer")
    if not low <= value <= high:
        raise KVParamsError(name, f"{_shown(value)} is not between {low} and {high}")
    return value


def finite(value: Any, name: str) -> float:
    """A finite number of JSON (an int or a float, not a bool): NaN, the
    infinities and integers beyond a float's range are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise KVParamsError(name, f"{_shown(value)} is not a number")
    try:
        number = float(value)
    except OverflowError:  # an integer of 309 digits or more
        raise KVParamsError(name, f"{_shown(value)} is too large") from None
    if not math.isfinite(number):
        raise KVParamsError(name, f"{_shown(value)} is not a finite number")
    return number


def flag(value: Any, name: str) -> bool:
    """``true``, ``false`` or absent (``None``: false)."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise KVParamsError(name, f"{_shown(value)} is neither true nor false")
    return value


def text(value: Any, name: str, max_chars: int = MAX_ID_CHARS) -> str:
    """A non-empty string of at most ``max_chars`` characters."""
    if not isinstance(value, str) or not 0 < len(value) <= max_chars:
        raise KVParamsError(name, f"{_shown(value)} is not a string of 1-{max_chars} characters")
    return value


def items(value: Any, name: str, low: int, high: int) -> list[Any]:
    """A JSON list (a tuple too, from Python) of ``low`` to ``high`` elements."""
    if not isinstance(value, (list, tuple)):
        raise KVParamsError(name, f"{_shown(value)} is not a list")
    if not low <= len(value) <= high:
        want = f"{low}" if low == high else f"{low}-{high}"
        raise KVParamsError(name, f"{len(value)} elements, not {want}")
    return list(value)


def table(value: Any, name: str, high: int) -> dict[str, Any]:
    """A JSON object of 1 to ``high`` entries."""
    if not isinstance(value, dict):
        raise KVParamsError(name, f"{_shown(value)} is not an object")
    if not 0 < len(value) <= high:
        raise KVParamsError(name, f"{len(value)} entries, not 1-{high}")
    return value


def _shown(value: Any) -> str:
    """``value`` for a message, cut short: a client's 400-digit number or a long
    string must not become a log line of its own size."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 1 << 64:
        return f"an integer of {value.bit_length()} bits"  # str() refuses 4,301 digits
    shown = repr(value)
    return shown if len(shown) <= 60 else f"{shown[:40]}... ({type(value).__name__})"
