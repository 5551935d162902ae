"""An optional compiled helper: the facts of thousands of tensors read in one C++ loop.

Export reads eight facts of every tensor it keeps (shape, dtype, size, device,
grad flag, contiguity, address, version), and ``into=`` five of every target.
From Python each is a C call through torch's argument parsing: for 5,000
tensors, 8-13 ms a step in a trainer whose step has just swept its caches,
most of what 5,000 tensors cost beyond one. ``_native.cpp`` reads them as
fields: 1-1.5 ms.

It is compiled against the installed torch (``torch.utils.cpp_extension``, a
C++ compiler needed, ~40 s on 2 cores) and is off unless asked for:
``RAYDIRECT_NATIVE=1`` uses it, building it on first use in the background
(Python reads the facts until it is ready), and ``raydirect native`` builds it
ahead. Builds are kept per source, torch and Python version under
``RAYDIRECT_NATIVE_DIR`` (default ``~/.cache/raydirect/native``). Where it
cannot be built, raydirect says why once and goes on in Python.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
import torch

NATIVE_ENV = "RAYDIRECT_NATIVE"
DIR_ENV = "RAYDIRECT_NATIVE_DIR"
_SOURCE = Path(__file__).with_name("_native.cpp")
_NAME = "raydirect_native"
# Below this many tensors the Python reads cost less than a millisecond.
MIN_TENSORS = 64

CPU, REQUIRES_GRAD, CONTIGUOUS = 1, 2, 4  # the flag bits of _native.cpp

log = logging.getLogger("raydirect")
_module: ModuleType | None = None
_state = "off"  # off -> building -> ready | failed
_lock = threading.Lock()


class Facts(NamedTuple):
    """What ``_native.cpp`` read of each tensor, in order."""

    shapes: list[tuple[int, ...]]
    dtypes: list[torch.dtype]
    nbytes: list[int]
    flags: np.ndarray  # uint8, CPU | REQUIRES_GRAD | CONTIGUOUS
    addresses: np.ndarray  # int64 data pointers
    versions: list[int]

    def all(self, flag: int) -> bool:
        return bool((self.flags & flag).all())

    def any(self, flag: int) -> bool:
        return bool((self.flags & flag).any())


def wanted() -> bool:
    return os.environ.get(NATIVE_ENV, "0").strip() not in ("", "0")


def build_dir() -> Path:
    """Where this source, torch and Python's build lives."""
    root = Path(os.environ.get(DIR_ENV) or Path.home() / ".cache" / "raydirect" / "native")
    key = hashlib.sha256(
        _SOURCE.read_bytes() + f"{torch.__version__}|{sys.version}".encode()
    ).hexdigest()[:16]
    return root / key


def build(verbose: bool = False) -> Path:
    """Compile the helper now (or find it built); returns the library's path.
    Raises what the compiler raised: no compiler, no Python headers."""
    from torch.utils import cpp_extension  # heavy: only when building

    where = build_dir()
    where.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        _NAME,
        [str(_SOURCE)],
        extra_cflags=["-O2"],
        build_directory=str(where),
        verbose=verbose,
    )
    return _built(where)


def _built(where: Path) -> Path:
    return where / f"{_NAME}.so"


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def status() -> str:
    """``off`` (not asked for, or not yet used), ``building``, ``ready`` or ``failed``."""
    return _state


def _use(module: ModuleType | None, state: str) -> None:
    global _module, _state
    _module, _state = module, state


def _build_in_background() -> None:
    try:
        module = _load(build())
    except Exception as exc:  # no compiler, no headers, a torch without them
        log.warning(
            "raydirect: the native helper (%s=1) could not be built (%s: %s); "
            "tensor facts are read in Python",
            NATIVE_ENV,
            type(exc).__name__,
            exc,
        )
        _use(None, "failed")
        return
    _use(module, "ready")


def _ready() -> ModuleType | None:
    """The loaded helper, or None: not wanted, still building, or failed. The
    first call with the helper wanted loads its build or starts building it."""
    if not wanted():
        return None
    if _state == "ready":
        return _module
    with _lock:
        if _state != "off":
            return _module
        path = _built(build_dir())
        if path.exists():
            try:
                _use(_load(path), "ready")
                return _module
            except ImportError:
                pass  # a stale or broken build: build it again
        _use(None, "building")
        threading.Thread(target=_build_in_background, name="raydirect-native", daemon=True).start()
    return None


def facts(tensors: list[Any]) -> Facts | None:
    """The facts of ``tensors`` (plain torch tensors) read by the helper, or None
    (not wanted, not built yet, too few tensors, or a tensor without storage):
    the caller then reads them in Python."""
    if len(tensors) < MIN_TENSORS:
        return None
    module = _ready()
    if module is None:
        return None
    try:
        shapes, dtypes, nbytes, flags, addresses, versions = module.facts(tensors)
    except (TypeError, RuntimeError):  # not a tensor; no data pointer (meta, sparse)
        return None
    return Facts(
        shapes,
        dtypes,
        nbytes,
        np.frombuffer(flags, dtype=np.uint8),
        np.frombuffer(addresses, dtype=np.int64),
        versions,
    )
