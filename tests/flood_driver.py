"""A producer's agent flooded with 1 MiB junk messages at full rate while real
transfers go on; run inside a lo-only network namespace (tests/loopback.py) by
tests/test_flood.py.

    python flood_driver.py [FLOOD_SECONDS]
    python flood_driver.py --flood ADDRESS SECONDS SEED KIND   (one flooding client)

KIND ``stranger``: a ZeroMQ client with a CURVE key of its own (not the
cluster's) sending 1 MiB junk messages as fast as it can: its handshakes are
refused (ZAP), so its messages never leave it, and it retries without pause.
KIND ``raw``: plain TCP connections each sending 1 MiB of random bytes where
ZeroMQ's greeting belongs.

Prints one ``@@RD {json}`` line: transfer latencies before, during and after
the flood, the agent's refusal counts, the CPU seconds its loop thread (and its
ZAP thread) spent during the flood, and its fds and threads before and after.
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

from helpers import thread_cpu_s

TRANSFER_BYTES = 1 << 20
BIG_BYTES = 24 << 20
IDLE_CONNECTIONS = 300  # per port, idle; and HALF_SENT more that stop midway
HALF_SENT = 50
SETTLE_S = 60.0


JUNK_BYTES = 1 << 20


def flood(address: str, seconds: float, seed: int, kind: str) -> None:
    import zmq
    import zmq.utils.z85

    rng = random.Random(seed)
    junk = rng.randbytes(JUNK_BYTES)
    end = time.monotonic() + seconds
    endpoint, _, rest = address.partition("/curve/")
    if kind == "stranger":
        ctx = zmq.Context()
        server_key = zmq.utils.z85.encode(bytes.fromhex(rest[:64]))
        while time.monotonic() < end:  # a new connection, hence a new handshake, each time
            sock = ctx.socket(zmq.DEALER)
            public, secret = zmq.curve_keypair()  # not the cluster's key
            sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
            sock.setsockopt(zmq.LINGER, 0)
            events = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
            sock.connect(endpoint)
            for _ in range(8):
                with contextlib.suppress(zmq.Again):
                    sock.send(junk, zmq.NOBLOCK)
            events.poll(1000)  # until the agent refused the key
            sock.disable_monitor()
            events.close(0)
            sock.close(0)
        ctx.term()
    else:
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        while time.monotonic() < end:
            try:
                with socket.create_connection((host, int(port)), timeout=5) as conn:
                    conn.sendall(junk)
            except OSError:
                pass
    print("done", flush=True)


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
    endpoint = agent["address"].partition("/curve/")[0]
    host, agent_port = endpoint.rpartition("//")[2].rsplit(":", 1)
    ports = {"agent": int(agent_port), "streams": ray.get(p.stream_port.remote())}
    halves = {"agent": b"\xff\x00\x00\x00", "streams": b"\x16\x03\x01" + bytes(6)}
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

    flood_seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0

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
            import threading

            from raydirect import _runtime, _wire

            agent = _runtime.agent()
            tids = {t.name: t.native_id for t in threading.enumerate()}
            return {
                "address": agent.address,
                "pid": os.getpid(),
                "auth": _wire.cluster_keys() is not None,
                "node_ip": ray.util.get_node_ip_address(),
                "loop_tid": tids["raydirect-agent"],
                "zap_tid": tids["raydirect-zap"],
            }

        def admitted(self) -> int:
            from raydirect import _runtime

            return _runtime.agent().admission.admitted

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

    pid, loop_tid, zap_tid = agent["pid"], agent["loop_tid"], agent["zap_tid"]
    admitted_before = ray.get(p.admitted.remote())
    cpu_before = (thread_cpu_s(pid, loop_tid), thread_cpu_s(pid, zap_tid))
    kinds = ["stranger", "raw"]
    clients = [
        subprocess.Popen(
            [sys.executable, __file__, "--flood", agent["address"], str(flood_seconds),
             str(seed), kind],
            stdout=subprocess.PIPE,
        )
        for seed, kind in enumerate(kinds)
    ]  # fmt: skip
    during: list[float] = []
    t0 = time.monotonic()
    while any(c.poll() is None for c in clients):
        during.append(transfer())
        if time.monotonic() - t0 > flood_seconds + 120:
            raise AssertionError("the flooding clients did not stop")
    flood_s = time.monotonic() - t0
    codes = [c.wait(timeout=60) for c in clients]
    cpu_after = (thread_cpu_s(pid, loop_tid), thread_cpu_s(pid, zap_tid))
    # Every request the loop admitted was a real transfer's (two each: fetch, sent).
    admitted_during = ray.get(p.admitted.remote()) - admitted_before
    after = [transfer() for _ in range(10)]

    idle = idle_phase(ray, rd, torch, p, agent)

    deadline = time.monotonic() + SETTLE_S
    while grew(now := census(agent["pid"]), base) and time.monotonic() < deadline:
        time.sleep(0.2)  # the agent's sockets to the flooders close once it notices
    result = {
        "agent": agent,
        "client_exit_codes": codes,
        "flood_seconds": round(flood_s, 2),
        "loop_cpu_s": round(cpu_after[0] - cpu_before[0], 3),
        "zap_cpu_s": round(cpu_after[1] - cpu_before[1], 3),
        "admitted_during": admitted_during,
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
        flood(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        main()
