"""Run a script inside a network namespace that has only ``lo``.

Load, flood and chaos tests send traffic as fast as they can; inside such a
namespace Ray's node address is 127.0.0.1 and nothing they send can leave the
machine or reach its external address. The namespace's processes are killed
(by ``ip netns pids``, never by name) and the namespace deleted afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PREFIX = "@@RD "


def unavailable_reason() -> str | None:
    if not sys.platform.startswith("linux") or shutil.which("ip") is None:
        return "needs Linux network namespaces (iproute2)"
    probe = f"rdlo-probe{os.getpid()}"
    proc = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"`ip netns add` is not permitted here: {proc.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]


def _delete(ns: str) -> None:
    deadline = time.monotonic() + 20
    while (pids := _pids(ns)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def run(script: Path, *args: str, timeout: float = 600.0) -> dict[str, Any]:
    """Run ``python script args...`` in a fresh lo-only namespace; its last ``@@RD``
    JSON line. Raises with the script's output tail if it fails or sends none."""
    ns = f"rdlo{os.getpid()}"
    _delete(ns)
    subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        proc = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, str(script), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
        )
    finally:
        _delete(ns)
    results = [line for line in proc.stdout.splitlines() if line.startswith(PREFIX)]
    if proc.returncode != 0 or not results:
        raise AssertionError(
            f"{script.name} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
            f"{proc.stderr[-6000:]}"
        )
    return json.loads(results[-1][len(PREFIX) :])


TCP_CLOSE = 7  # TCP_INFO's state of a socket that is neither connected nor listening


def ipv6_tcp_sockets(only_closed: bool = False) -> int:
    """The calling process's IPv6 TCP sockets (only those in state CLOSE, which no
    /proc/net table lists, when ``only_closed``). Run inside the process counted.

    They are Ray's: its core worker's gRPC uses dual-stack sockets, and keeps one
    in state CLOSE per failed connection to a dead owner of a ref it borrowed
    (the chaos driver's nested control shows them growing with no raydirect).
    raydirect's own sockets are IPv4, on the node address (127.0.0.1 here).
    Drivers register this module for pickling by value to run it in actors."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=int(fd))
        except OSError:
            continue
        try:
            if sock.family == socket.AF_INET6 and sock.type == socket.SOCK_STREAM:
                state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
                count += not only_closed or state == TCP_CLOSE
        except OSError:
            pass
        finally:
            sock.detach()  # the fd stays its owner's
    return count
