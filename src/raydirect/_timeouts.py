"""The ``timeout=`` every public call takes, checked once where it enters: None
or a number of seconds >= 0 (infinity: no limit). Before, ``timeout=-1`` timed
out at once, saying it had waited -1 s; ``float("nan")`` and ``float("inf")``
failed deep in Ray ("cannot convert float NaN to integer"); ``"5"`` failed
adding a string to a clock."""

from __future__ import annotations

import math
from numbers import Real
from typing import Any


def checked_timeout(timeout: Any) -> float | None:
    """``timeout`` as seconds, or None for no limit; ``TypeError`` or ``ValueError``
    naming what was given otherwise."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, Real):
        raise TypeError(
            f"timeout must be None or a number of seconds, got {timeout!r} "
            f"({type(timeout).__name__})"
        )
    seconds = float(timeout)
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"timeout must be None or a number of seconds >= 0, got {timeout!r}")
    return None if math.isinf(seconds) else seconds
