"""The agent runtime: this process's one server, started on first use.

Starting it allows cross-memory reads of this process (``cma``), removes what
dead producers on this node left in shared memory, binds the server (CURVE) and
its stream port for bulk ``tcp`` reads to the node's Ray address (the stream
port in TLS when ``_tls.encryption_wanted``) and announces it in Ray's key-value
store for ``raydirect status``. The ``stats`` op is served from here.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import threading
from typing import Any

from raydirect import _process, _ray, _server, _stream_server, _tls, _wire
from raydirect._server import CONTROL, Reply, Server
from raydirect._store import store
from raydirect.transports.shm import sweep_dead_segments

log = logging.getLogger("raydirect")

_agent: Server | None = None
_agent_lock = threading.Lock()


def agent(label: str | None = None) -> Server:
    """This process's agent, started on first use. ``label`` names the process in
    ``raydirect status`` (default: the task running now)."""
    global _agent
    if _agent is None:
        with _agent_lock:
            if _agent is None:
                _process.allow_memory_reads()
                sweep_dead_segments()
                security = _tls.server_security() if _tls.encryption_wanted() else None
                streams = _stream_server.start(_ray.node_ip(), security)
                _agent = Server(_ray.node_ip(), tls=None if security is None else security.pin)
                store.encryption = streams.encryption
                _announce(_agent, label, streams.encryption)
                if _ray.tls_enabled() and security is None:
                    log.warning(
                        "raydirect: Ray TLS is on (RAY_USE_TLS), but %s=0: raydirect's tcp "
                        "transport is not encrypted, tensor bytes cross the network in clear",
                        _tls.ENCRYPT_ENV,
                    )
    return _agent


def _announce(server: Server, label: str | None, encryption: str) -> None:
    """Publish this agent for ``raydirect status``; withdrawn at a clean exit."""
    key = f"{_ray.node_id()}/{_process.PID}"
    info = {
        "address": server.address,
        "pid": _process.PID,
        "start_time": _process.START_TIME,  # with the pid: this process, not a reuse
        "node_id": _ray.node_id(),
        "actor_id": _ray.current_actor_id(),
        "label": label or _ray.current_task_label(),
        "encryption": encryption,
    }
    try:
        _ray.publish_agent(key, json.dumps(info).encode())
        atexit.register(_withdraw, key, _process.PID)
    except Exception:  # status is a convenience: never fail a transfer for it
        log.debug("raydirect: could not publish the agent", exc_info=True)


def _withdraw(key: str, pid: int) -> None:
    """At exit: withdraw this agent's announcement, waiting on the GCS no longer
    than ``_ray.EXIT_TIMEOUT_S``. A cluster that is gone cannot be told; the
    announcement it would have held is gone with it, or pruned by ``raydirect
    status`` once it finds the process dead."""
    if pid != os.getpid():  # a forked child exits without withdrawing its parent
        return
    try:
        _ray.withdraw_agent(key, timeout=_ray.EXIT_TIMEOUT_S)
    except Exception:  # the GCS is gone or slow: exit anyway, promptly
        log.debug("raydirect: could not withdraw the agent at exit", exc_info=True)


def _serve_stats(request: dict[str, Any], reply: Reply) -> None:
    # Counts only, no tensor data: needs no capability.
    reply.send({"ok": True, "stats": dataclasses.asdict(store.stats())})


_server.register(_wire.STATS, _serve_stats, needs_object=False, lane=CONTROL)


def _forget_after_fork() -> None:
    # The agent's threads did not survive the fork; its sockets are the parent's.
    global _agent, _agent_lock
    _process.keep_from_parent(_agent)
    _agent, _agent_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
