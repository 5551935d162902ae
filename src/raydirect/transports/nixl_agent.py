"""NVIDIA NIXL found and one agent made: the import (on first use, from whichever
NIXL wheel is installed), UCX's settings, the progress thread's pause.

The ``nixl`` transport (``nixl.py``) moves bytes through the agent; benchmarks
make bare agents here too.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
import threading
import time
from typing import Any

from raydirect import _process
from raydirect.errors import TransferError

log = logging.getLogger("raydirect")

INSTALL_HINT = "pip install raydirect[nixl]  (or: pip install nixl-cu12)"
_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
_api: Any = None
_api_lock = threading.Lock()


def nixl_api() -> Any:
    """NIXL's Python API module (``nixl`` meta package, or a ``nixl_cuXX`` wheel)."""
    global _api
    with _api_lock:
        if _api is None:
            errors = []
            for name in _MODULES:
                try:
                    _api = importlib.import_module(name)
                    break
                except ImportError as exc:
                    errors.append(f"{name}: {exc}")
            else:
                raise ImportError(
                    "tensor_transport='nixl' needs NVIDIA NIXL, which is not installed "
                    f"({'; '.join(errors)}). Install it with: {INSTALL_HINT}"
                )
        return _api


@functools.cache
def installed() -> bool:
    """Whether NIXL can be imported here, found without importing it (cheap)."""
    return any(importlib.util.find_spec(name.split(".")[0]) is not None for name in _MODULES)


def available() -> bool:
    try:
        nixl_api()
    except ImportError:
        return False
    return True


ERROR_MODE_ENV = "RAYDIRECT_NIXL_UCX_ERROR_MODE"
UCX_INFO_ENV = "RAYDIRECT_NIXL_UCX_INFO"
_CUDA_TLS = ("cuda_copy", "cuda_ipc")


def ucx_settings(env: dict[str, str], cuda: bool) -> tuple[dict[str, str], dict[str, str]]:
    """(the UCX backend's init parameters, environment variables to set) for a NIXL
    agent made in a process whose environment is ``env``; ``cuda``: it uses CUDA.

    Why NIXL moved device memory at 0.45 GB/s on one H200 (500x slower than
    cuda_ipc): NIXL's UCX backend makes its endpoints with peer error handling,
    and UCX then selects only lanes whose transport can report a peer's failure.
    cuda_ipc and the shared-memory transports cannot, so on one node every byte
    went over UCX's tcp through host memory (ai-dynamo/nixl#1739, #2050 say the
    same of ROCm's IPC). ``RAYDIRECT_NIXL_UCX_ERROR_MODE=none`` makes those lanes
    eligible; the price is UCX's own notice of a dead peer, which on one node
    raydirect's pid check gives anyway, and across nodes the read's deadline.
    ``auto`` never picks NIXL on one node for CUDA memory (cuda_ipc does it).

    ``UCX_TLS``, where set and CUDA is used, gets ``cuda_copy,cuda_ipc`` added:
    without them UCX stages device memory through host buffers itself.
    ``RAYDIRECT_NIXL_UCX_INFO=1`` sets ``UCX_PROTO_INFO=y``: UCX prints the
    protocol and transport it picks for each kind of transfer."""
    params: dict[str, str] = {}
    mode = env.get(ERROR_MODE_ENV, "").strip().lower()
    if mode:
        if mode not in ("peer", "none"):
            raise ValueError(f"{ERROR_MODE_ENV}={mode!r}: write 'peer' (UCX's default) or 'none'")
        params["ucx_error_handling_mode"] = mode
    changes: dict[str, str] = {}
    tls = env.get("UCX_TLS")
    if cuda and tls and not tls.startswith("^"):
        wanted = [t for t in _CUDA_TLS if t not in tls.split(",") and "cuda" not in tls.split(",")]
        if wanted:
            changes["UCX_TLS"] = ",".join([tls, *wanted])
    if env.get(UCX_INFO_ENV) == "1" and "UCX_PROTO_INFO" not in env:
        changes["UCX_PROTO_INFO"] = "y"
    return params, changes


PROGRESS_DELAY_ENV = "RAYDIRECT_NIXL_PROGRESS_DELAY_US"
DEFAULT_PROGRESS_DELAY_US = 1000


def new_agent(api: Any, name: str, config: Any) -> Any:
    """A NIXL agent whose progress thread pauses between polls.

    NIXL's Python API hard-codes the progress thread's delay to 0, so the
    thread polls without pause and takes a core for as long as the process
    lives (measured here: 95% of a core idle, 4% with 1 ms). Its C++ config
    has the knob; this sets it, through a subclass whose ``pthrDelay`` keeps
    our value when the API assigns 0. The target side of a read needs the
    progress thread (without one, reads over UCX's tcp never complete).
    """
    delay = int(os.environ.get(PROGRESS_DELAY_ENV, DEFAULT_PROGRESS_DELAY_US))
    base = api.nixlBind.nixlAgentConfig

    class _Config(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:  # noqa: N802 (NIXL's name)
            return int(base.pthrDelay.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, _value: int) -> None:  # noqa: N802
            base.pthrDelay.__set__(self, delay)

    with _api_lock:  # the API module is shared: patch it only while building
        api.nixlBind.nixlAgentConfig = _Config
        try:
            return api.nixl_agent(name, config)
        finally:
            api.nixlBind.nixlAgentConfig = base


def _log_ucx(agent: Any, changes: dict[str, str]) -> None:
    """Say how UCX was set up (info: once per process), so a slow NIXL read can be
    told apart: peer error handling keeps device memory off cuda_ipc."""
    try:
        params = agent.get_backend_params("UCX")
    except Exception:  # noqa: BLE001 (an older NIXL: the rest still says enough)
        params = {}
    log.info(
        "raydirect: NIXL's UCX backend: error handling %s, UCX_TLS=%s%s (%s=1 prints "
        "UCX's choice of transports)",
        params.get("ucx_error_handling_mode", "peer (NIXL's default)"),
        os.environ.get("UCX_TLS", "(unset: all)"),
        f", set here: {changes}" if changes else "",
        UCX_INFO_ENV,
    )


def make_agent(name: str, cuda: bool) -> Any:
    """This process's agent ``name``, on UCX, its progress thread pausing between
    polls and no listener (metadata travels in the objects); ``cuda``: it reads or
    serves CUDA memory (``ucx_settings``)."""
    api = nixl_api()
    params, changes = ucx_settings(dict(os.environ), cuda)
    os.environ.update(changes)  # read by UCX when the backend starts, below
    config = api.nixl_agent_config(
        enable_prog_thread=True,
        enable_listen_thread=False,
        backends=[] if params else ["UCX"],  # with params: made below
        sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    started = time.perf_counter()
    agent = new_agent(api, name, config)
    if params:
        agent.create_backend("UCX", params)
    _log_ucx(agent, changes)
    if "UCX" not in agent.backends:
        raise TransferError("NIXL's UCX backend failed to start in this process")
    log.debug("raydirect: NIXL agent %s up in %.2fs", name, time.perf_counter() - started)
    return agent


def _forget_after_fork() -> None:
    global _api, _api_lock
    _process.keep_from_parent(_api)
    _api, _api_lock = None, threading.Lock()  # the NIXL agent is the parent's


os.register_at_fork(after_in_child=_forget_after_fork)
