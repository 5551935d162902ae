"""A producer's agent flooded with junk while real transfers go on; run inside a
lo-only network namespace (tests/loopback.py) by tests/test_flood.py.

    python flood_driver.py [MESSAGES_PER_CLIENT]
    python flood_driver.py --flood ADDRESS MESSAGES SEED      (one flooding client)

Prints one ``@@RD {json}`` line: transfer latencies before, during and after
the flood, the agent's refusal counts, and its fds and threads before and after.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import loopback  # this script's folder is on sys.path

CLIENTS = 2
TRANSFER_BYTES = 1 << 20
BIG_BYTES = 24 << 20
IDLE_CONNECTIONS = 300  # per port, idle; and HALF_SENT more that stop midway
HALF_SENT = 50
SETTLE_S = 60.0


def junk(rng: random.Random) -> list[bytes]:
    """One message of the kinds an attacker (or a confused program) sends."""
    kind = rng.randrange(5)
    if kind == 0:
        return [rng.randbytes(rng.randrange(1, 200))]
    if kind == 1:  # well-formed, no auth
        return [json.dumps({"op": "fetch", "obj": "00" * 16, "cap": "00" * 16}).encode()]
    if kind == 2:
        return [b'{"op": "stats", "reply": true}']
    if kind == 3:  # several frames
        return [b"x", rng.randbytes(64), b"y"]
    return [b'{"op": "fetch", "auth": "' + rng.randbytes(16).hex().encode() + b'"}']


def flood(address: str, messages: int, seed: int) -> None:
    import zmq

    rng = random.Random(seed)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    # Blocking sends into a bounded queue: every message reaches the agent, as
    # fast as it reads them.
    sock.setsockopt(zmq.LINGER, 120_000)
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.connect(address)
    for _ in range(messages):
        sock.send_multipart(junk(rng))
    # Stay connected until the driver says the agent has read it all: ZeroMQ drops
    # what a disconnected peer sent and the agent had not read yet.
    print("sent", flush=True)
    sys.stdin.readline()
    sock.close()
    ctx.term()


def describe(pid: int) -> dict[str, list[str]]:
    """Thread names and fd targets, to say what grew when something did."""
    names, fds = [], []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            fds.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return {"threads": sorted(names), "fds": sorted(fds)}


def census(pid: int) -> dict[str, int]:
    return {
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": len(os.listdir(f"/proc/{pid}/task")),
    }


def grew(now: dict[str, int], base: dict[str, int]) -> bool:
    return any(now[k] > base[k] for k in base)


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) << 10


def idle_phase(ray: Any, rd: Any, torch: Any, p: Any, agent: dict[str, Any]) -> dict[str, Any]:
    """Hundreds of idle connections and half-sent greetings and headers on both
    ports, while small and large transfers go on; then all of them closed."""
    host, agent_port = agent["address"].rpartition("//")[2].rsplit(":", 1)
    ports = {"agent": int(agent_port), "streams": ray.get(p.stream_port.remote())}
    halves = {"agent": b"\xff\x00\x00\x00", "streams": b"RDS1" + bytes(6)}
    rss_before = rss(agent["pid"])
    conns = []
    for name, port in ports.items():
        for i in range(IDLE_CONNECTIONS + HALF_SENT):
            conn = socket.create_connection((host, port), timeout=10)
            if i >= IDLE_CONNECTIONS:
                conn.sendall(halves[name])
            conns.append(conn)
    want_big = torch.arange(BIG_BYTES // 4, dtype=torch.int32)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        big = rd.get(p.make_big.remote(), timeout=60, tensor_transport="tcp")
        small = rd.get(p.make.remote(), timeout=60, tensor_transport="tcp")
        times.append(time.perf_counter() - t0)
        if not torch.equal(big, want_big) or small.numel() != TRANSFER_BYTES // 4:
            raise AssertionError("a transfer arrived wrong while connections sat idle")
    rss_during = rss(agent["pid"])
    open_at_end = census(agent["pid"])["fds"]
    for conn in conns:
        conn.close()
    from raydirect import _stream_client

    _stream_client.close_idle()  # this driver's pooled stream connections, too
    return {
        "connections": len(conns),
        "transfers_ok": len(times),
        "median_pair_s": statistics.median(times),
        "rss_growth_bytes": rss_during - rss_before,
        "producer_fds_while_open": open_at_end,
    }


def main() -> None:
    import ray
    import torch
    from ray import cloudpickle

    import raydirect as rd

    cloudpickle.register_pickle_by_value(loopback)  # its probe runs in the producer

    messages = int(sys.argv[1]) if len(sys.argv) > 1 else 50_000

    @ray.remote(num_cpus=0)
    class Producer:
        def __init__(self) -> None:
            self.t = torch.arange(TRANSFER_BYTES // 4, dtype=torch.int32)
            self.big = torch.arange(BIG_BYTES // 4, dtype=torch.int32)

        @rd.method(tensor_transport="tcp")
        def make(self) -> Any:
            return self.t

        @rd.method(tensor_transport="tcp")
        def make_big(self) -> Any:  # over the stream threshold: moves on the stream port
            return self.big

        def stream_port(self) -> int:
            from raydirect import _stream_server

            return _stream_server.running().port

        def agent(self) -> dict[str, Any]:
            from raydirect import _runtime, _wire

            return {
                "address": _runtime.agent().address,
                "pid": os.getpid(),
                "auth": _wire.auth_proof() is not None,
                "node_ip": ray.util.get_node_ip_address(),
            }

        def ray_sockets(self) -> int:
            return loopback.ipv6_tcp_sockets()

        def python_threads(self) -> list[str]:
            import threading

            return sorted(t.name for t in threading.enumerate())

        def refused(self) -> dict[str, int]:
            from raydirect import _runtime

            return dict(_runtime.agent().admission.refused)

    ray.init(num_cpus=4, include_dashboard=False, logging_level="warning")
    p = Producer.remote()
    agent = ray.get(p.agent.remote())
    want = torch.arange(TRANSFER_BYTES // 4, dtype=torch.int32)

    def transfer() -> float:
        t0 = time.perf_counter()
        got = rd.get(p.make.remote(), timeout=60, tensor_transport="tcp")
        seconds = time.perf_counter() - t0
        if not torch.equal(got, want):
            raise AssertionError("a transfer arrived wrong")
        return seconds

    for _ in range(5):
        transfer()  # warm: the agent, connections, receive buffers
    before = [transfer() for _ in range(30)]
    base = census(agent["pid"])
    base_detail = describe(agent["pid"])
    base_threads = ray.get(p.python_threads.remote())
    base_ray_sockets = ray.get(p.ray_sockets.remote())

    clients = [
        subprocess.Popen(
            [sys.executable, __file__, "--flood", agent["address"], str(messages), str(seed)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for seed in range(CLIENTS)
    ]
    for c in clients:
        os.set_blocking(c.stdout.fileno(), False)  # type: ignore[union-attr]
    during: list[float] = []
    t0 = time.monotonic()
    total = CLIENTS * messages
    while sum(ray.get(p.refused.remote()).values()) < total:
        during.append(transfer())
        if time.monotonic() - t0 > 300:
            raise AssertionError("the agent did not read the flood in 300 s")
    flood_s = time.monotonic() - t0
    for c in clients:
        c.stdin.close()  # type: ignore[union-attr]
    codes = [c.wait(timeout=60) for c in clients]
    after = [transfer() for _ in range(10)]

    idle = idle_phase(ray, rd, torch, p, agent)

    deadline = time.monotonic() + SETTLE_S
    while grew(now := census(agent["pid"]), base) and time.monotonic() < deadline:
        time.sleep(0.2)  # the agent's sockets to the flooders close once it notices
    result = {
        "agent": agent,
        "client_exit_codes": codes,
        "messages": CLIENTS * messages,
        "flood_seconds": round(flood_s, 2),
        "median_before_s": statistics.median(before),
        "median_during_s": statistics.median(during) if during else None,
        "transfers_during": len(during),
        "max_during_s": max(during) if during else None,
        "median_after_s": statistics.median(after),
        "refused": ray.get(p.refused.remote()),
        "idle": idle,
        "census_before": base,
        "census_after": now,
        "ray_sockets_before": base_ray_sockets,
        "ray_sockets_after": ray.get(p.ray_sockets.remote()),
        "python_threads_before": base_threads,
        "python_threads_after": ray.get(p.python_threads.remote()),
        "grown": {
            k: sorted((Counter(v) - Counter(base_detail[k])).elements())
            for k, v in describe(agent["pid"]).items()
        },
    }
    print("@@RD " + json.dumps(result), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--flood"]:
        flood(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
