"""Chaos: producers (``max_restarts``) killed at random while consumers read from
them; run inside a lo-only network namespace by tests/test_chaos.py.

    python chaos_driver.py SECONDS SEED

Three consumers loop for SECONDS: ask a random producer for a value (random
size and transport), read it with a deadline, record exact / wrong / the error
and how long it took. Meanwhile the driver SIGKILLs a random producer every
1-4 s; Ray restarts it. Prints one ``@@RD {json}`` line.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from typing import Any

import loopback  # this script's folder is on sys.path

PRODUCERS = 2
CONSUMERS = 3
READ_TIMEOUT_S = 30.0
SIZES = (4 << 10, 1 << 20, 8 << 20)  # inline-sized, control channel, bulk streams
TRANSPORTS = ("auto", "shm", "tcp")
# The control: the same kills and reads through Ray alone (plain methods, ray.get),
# to tell what Ray itself holds after many restarts from what raydirect does.
# "nested": each value also holds a ref its producer owns, as a raydirect lease is.
CONTROL = os.environ.get("RAYDIRECT_CHAOS_CONTROL", "") in ("1", "nested")
NESTED = os.environ.get("RAYDIRECT_CHAOS_CONTROL") == "nested"


BOUND_S = READ_TIMEOUT_S + 30
RAY_ERRORS = ("Ray", "Actor", "Task", "ObjectLost", "GetTimeout")


def _sockets(pid: int) -> dict[str, str]:
    """Socket inode -> "tcp <state> <local port>-><remote port>" or "unix"."""
    found = {}
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                local, remote, state, inode = cols[1], cols[2], cols[3], cols[9]
                ports = f"{int(local.split(':')[1], 16)}->{int(remote.split(':')[1], 16)}"
                found[inode] = f"tcp {state} {ports}"
    for table, column in (("unix", 6), ("udp", 9), ("udp6", 9), ("netlink", 9), ("raw", 9)):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if len(cols) > column:
                    found[cols[column]] = table
    return found


def fd_kinds(pid: int, detail: bool = False) -> dict[str, int]:
    """What a process's fds point at ("socket", "anon_inode", a file's path), counted:
    says what grew when the count does. ``detail``: sockets by kind and ports."""
    kinds: Counter[str] = Counter()
    sockets = _sockets(pid) if detail else {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            kind = target.split(":")[0]
            if detail and kind == "socket":
                kind = sockets.get(target.split("[")[-1].rstrip("]"), "socket ?")
            kinds[kind] += 1
    return dict(kinds)


def unexplained(outcome: dict[str, Any]) -> bool:
    """An error that is neither raydirect's nor Ray's own."""
    if outcome["result"] != "error" or outcome["raydirect"]:
        return False
    return not any(word in outcome["type"] for word in RAY_ERRORS)


def main() -> None:
    import ray
    import torch
    from ray import cloudpickle

    import raydirect as rd

    cloudpickle.register_pickle_by_value(loopback)  # its probe runs in the consumers

    seconds, seed = float(sys.argv[1]), int(sys.argv[2])

    def value(nbytes: int, salt: int) -> torch.Tensor:
        return torch.arange(nbytes // 4, dtype=torch.int32) * 7 + salt

    @ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
    class Producer:
        def pid(self) -> int:
            return os.getpid()

        @rd.method(tensor_transport="auto")
        def make_auto(self, nbytes: int, salt: int) -> Any:
            return value(nbytes, salt)

        @rd.method(tensor_transport="shm")
        def make_shm(self, nbytes: int, salt: int) -> Any:
            return value(nbytes, salt)

        @rd.method(tensor_transport="tcp")
        def make_tcp(self, nbytes: int, salt: int) -> Any:
            return value(nbytes, salt)

        def make_plain(self, nbytes: int, salt: int) -> Any:
            if NESTED:
                return [value(nbytes, salt), ray.put(b"")]
            return value(nbytes, salt)

    @ray.remote(num_cpus=0)
    class Consumer:
        def fds(self) -> int:
            return len(os.listdir(f"/proc/{os.getpid()}/fd"))

        def pid(self) -> int:
            return os.getpid()

        def held(self) -> dict[str, Any]:
            """What raydirect holds here (channels to agents, ZeroMQ and Python
            sockets, threads), and Ray's closed dual-stack sockets, counted apart."""
            import gc
            import socket
            import threading

            import zmq

            from raydirect import _channel

            objects = gc.get_objects()
            live = [o for o in objects if isinstance(o, _channel.Channel) and not o.socket.closed]
            return {
                "closed_tcp6": loopback.ipv6_tcp_sockets(only_closed=True),
                "zmq_sockets": sum(isinstance(o, zmq.Socket) and not o.closed for o in objects),
                "open_channels": len(live),
                "channel_addresses": len({c.address for c in live}),
                "threads": threading.active_count(),
                "python_sockets": sum(
                    isinstance(o, socket.socket) and o.fileno() >= 0 for o in objects
                ),
            }

        def close_idle(self) -> int:
            from raydirect import _stream_client

            return _stream_client.close_idle()

        def run(self, producers: list[Any], until: float, seed: int) -> list[dict[str, Any]]:
            rng = random.Random(seed)
            outcomes = []
            while time.time() < until:
                p = rng.choice(producers)
                nbytes, transport = rng.choice(SIZES), rng.choice(TRANSPORTS)
                salt = rng.randrange(1 << 20)
                t0 = time.monotonic()
                try:
                    if CONTROL:
                        ref = p.make_plain.remote(nbytes, salt)
                        got = ray.get(ref, timeout=READ_TIMEOUT_S)
                        got = got[0] if NESTED else got
                    else:
                        ref = getattr(p, f"make_{transport}").remote(nbytes, salt)
                        got = rd.get(ref, timeout=READ_TIMEOUT_S, tensor_transport=transport)
                    ok = torch.equal(got, value(nbytes, salt))
                    outcome = {"result": "exact" if ok else "wrong"}
                except Exception as exc:
                    outcome = {"result": "error", "type": type(exc).__name__,
                               "raydirect": type(exc).__module__.startswith("raydirect"),
                               "message": str(exc)[:300]}  # fmt: skip
                outcome["seconds"] = round(time.monotonic() - t0, 3)
                outcomes.append(outcome)
            return outcomes

    def read_when_back(p: Any, transport: str, check: Any) -> bool:
        """One read from ``p`` once Ray has restarted it (the last kill may be recent)."""
        deadline = time.monotonic() + 120
        while True:
            try:
                ref = getattr(p, f"make_{transport}").remote(1 << 20, 5)
                return bool(check(rd.get(ref, timeout=60, tensor_transport=transport)))
            except (ray.exceptions.ActorUnavailableError, rd.ProducerLostError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    ray.init(num_cpus=4, include_dashboard=False, logging_level="error")
    rng = random.Random(seed)
    producers = [Producer.remote() for _ in range(PRODUCERS)]
    consumers = [Consumer.remote() for _ in range(CONSUMERS)]
    pids = ray.get([p.pid.remote() for p in producers])
    warm = ray.get([c.run.remote(producers, time.time() + 2, i) for i, c in enumerate(consumers)])
    fds_before = ray.get([c.fds.remote() for c in consumers])
    kinds_before = [fd_kinds(c, True) for c in ray.get([c.pid.remote() for c in consumers])]
    held_before = ray.get([c.held.remote() for c in consumers])
    consumer_pids = ray.get([c.pid.remote() for c in consumers])
    samples: list[list[int]] = []
    until = time.time() + seconds
    running = [c.run.remote(producers, until, seed * 10 + i) for i, c in enumerate(consumers)]
    killed: list[int] = []
    while time.time() < until - 1:
        pause = time.monotonic() + rng.uniform(1, 4)
        while time.monotonic() < pause:
            samples.append([len(os.listdir(f"/proc/{c}/fd")) for c in consumer_pids])
            time.sleep(0.5)
        i = rng.randrange(PRODUCERS)
        try:
            pid = ray.get(producers[i].pid.remote(), timeout=60)
        except Exception:
            continue  # still restarting: kill another time
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
    outcomes = [o for batch in ray.get(running, timeout=seconds + 120) for o in batch]
    # Restarted producers serve again: one exact read from each, over each transport.
    after = []
    for p in producers:
        for transport in TRANSPORTS:
            after.append(
                read_when_back(p, transport, lambda got: torch.equal(got, value(1 << 20, 5)))
            )
    deadline = time.monotonic() + 60
    while True:  # a restarted producer's agent sweeps what its dead predecessors left
        left = sorted(
            n for n in os.listdir("/dev/shm") if n.split("-")[1:2] in [[str(k)] for k in killed]
        )
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    pooled = ray.get([c.close_idle.remote() for c in consumers])
    kinds = [fd_kinds(c, True) for c in consumer_pids]
    fds_after = ray.get([c.fds.remote() for c in consumers])
    held_after = ray.get([c.held.remote() for c in consumers])
    result = {
        "killed": len(killed),
        "first_pids": pids,
        "reads": len(outcomes),
        "results": dict(Counter(o["result"] for o in outcomes)),
        "errors": dict(Counter(o.get("type") for o in outcomes if o["result"] == "error")),
        "bad": [o for o in outcomes if o["result"] == "wrong" or o["seconds"] > BOUND_S],
        "non_raydirect_non_ray": [o for o in outcomes if unexplained(o)],
        "max_seconds": max(o["seconds"] for o in outcomes),
        "served_again": after,
        "segments_left": left,
        "fds_before": fds_before,
        "fds_after": fds_after,
        "pooled_closed": pooled,
        "fd_kinds": kinds,
        "fd_kinds_before": kinds_before,
        "held": [held_before, held_after],
        "fd_samples": samples[:: max(1, len(samples) // 12)],
        "warm_reads": sum(len(w) for w in warm),
    }  # fmt: skip
    print("@@RD " + json.dumps(result), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
