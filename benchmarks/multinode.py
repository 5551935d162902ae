"""One tensor from an actor on node B to an actor on node A, across two real nodes.

Sets up the two-node cluster of tests/multinode (two network namespaces joined by
a veth pair, 10.77.0.1 and 10.77.0.2; needs root), runs the measurement as a
driver inside the head's namespace, prints a table and tears everything down.

Rows, side by side in one run: raydirect tcp, raydirect gloo, Ray's object
store, and Ray's built-in RDT over Gloo (``@ray.method(tensor_transport="gloo")``
with a ``torch_gloo`` group). RDT only works across these nodes once
``GLOO_SOCKET_IFNAME`` is set for every worker, so its actors get it (the veth
is called ``rdveth`` in both namespaces); raydirect's actors do not.

    sudo .venv/bin/python benchmarks/multinode.py [--sizes 64MiB,512MiB] [--repeats 5]

Each transfer: the producer rewrites its preallocated tensor with a new seed
(untimed), then the driver times ``consumer.consume.remote(producer.make.remote())``
end to end. The first (cold) transfer of each row is checked element by element
and left out of the median; the timed ones are checked by samples and a strided sum.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MIB = 1 << 20
GB = 1e9
DTYPE_BYTES = 4
SEED_STEP = 7919
IPERF = "iperf3 (1 stream)"
ROWS = (
    IPERF,
    "raydirect tcp (1 stream)",
    "raydirect tcp",
    "raydirect tcp (encrypted, TLS)",
    "raydirect tcp (encrypted, TLS records in user space)",
    "raydirect gloo",
    "ray object store",
    "ray RDT gloo",
)
IPERF_PORT = 5201
TIMEOUT_S = 300.0


def log(message: str) -> None:
    print(f"[multinode {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    text = text.strip().lower()
    for unit, factor in (("gib", 1 << 30), ("mib", MIB), ("kib", 1 << 10)):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


# ---------------------------------------------------------------- inside the head's namespace


def inner(address: str, sizes: list[int], repeats: int) -> dict[str, Any]:
    import ray
    import torch

    import raydirect as rd

    thp = {"THP_MEM_ALLOC_ENABLE": "1"}  # huge pages for every worker, every row
    ours = {"resources": {"nodeB": 0.001}, "runtime_env": {"env_vars": thp}}
    theirs_env = {"env_vars": {**thp, "GLOO_SOCKET_IFNAME": "rdveth"}}

    def fill(t: torch.Tensor, seed: int) -> None:
        torch.arange(seed, seed + t.numel(), dtype=torch.int32, out=t)

    def check(t: Any, seed: int, nbytes: int, full: bool) -> int:
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.numel() * 4 != nbytes:
            raise ValueError(f"wrong tensor: {type(t).__name__} {getattr(t, 'shape', '')}")
        n = t.numel()
        if full:
            want = torch.arange(seed, seed + n, dtype=torch.int32)
            if not torch.equal(t, want):
                raise ValueError(f"contents differ (seed {seed})")
            return nbytes
        idx = torch.randint(0, n, (64,), generator=torch.Generator().manual_seed(seed))
        idx = torch.cat([torch.tensor([0, n - 1]), idx])
        if not torch.equal(t[idx].long(), idx + seed):
            raise ValueError(f"sampled contents differ (seed {seed})")
        stride = max(1, n // 4096)
        last = (n - 1) // stride
        if (
            int(t[::stride].sum(dtype=torch.int64))
            != (last + 1) * seed + stride * last * (last + 1) // 2
        ):
            raise ValueError(f"strided sum differs (seed {seed})")
        return nbytes

    class Source:
        def __init__(self) -> None:
            self.t: Any = None

        def allocate(self, nbytes: int) -> str:
            self.t = None
            self.t = torch.empty(nbytes // DTYPE_BYTES, dtype=torch.int32)
            fill(self.t, 0)
            return ray.util.get_node_ip_address()

        def wait_free(self) -> None:
            pass

        def prepare(self, seed: int) -> None:
            self.wait_free()
            fill(self.t, seed)

    @ray.remote(num_cpus=0)
    class OursProducer(Source):
        def wait_free(self) -> None:
            if self.t is not None:
                rd.wait_tensor_freed(self.t, timeout=60)

        @rd.method(tensor_transport="tcp")
        def make_tcp(self) -> Any:
            return self.t

        @rd.method(tensor_transport="gloo")
        def make_gloo(self) -> Any:
            return self.t

    @ray.remote(num_cpus=0)
    class StoreProducer(Source):
        def make(self) -> Any:
            return self.t

    @ray.remote(num_cpus=0)
    class RdtProducer(Source):
        def wait_free(self) -> None:
            if self.t is not None:
                from ray.experimental import wait_tensor_freed

                wait_tensor_freed(self.t, timeout=60)

        @ray.method(tensor_transport="gloo")
        def make(self) -> Any:
            return self.t

    class Sink:
        def consume(self, t: Any, seed: int, nbytes: int, full: bool) -> int:
            return check(t, seed, nbytes, full)

        def where(self) -> str:
            return ray.util.get_node_ip_address()

        def stats(self) -> dict[str, int]:
            return dict(rd.local_stats().objects_received)

    @ray.remote(num_cpus=0)
    class Consumer(Sink):
        pass

    # RDT receives on a concurrency group Ray adds only with enable_tensor_transport=True.
    @ray.remote(num_cpus=0, enable_tensor_transport=True)  # type: ignore[call-overload]
    class RdtConsumer(Sink):
        pass

    on_a = {"resources": {"nodeA": 0.001}}
    seed = 1
    rows: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in ROWS}

    def run_rows(systems: list[tuple[str, Any, Any, Any]]) -> None:
        """Each (row, producer, make, consumer) at each size: one cold transfer each,
        then ``repeats`` rounds, one transfer of each row per round in a rotating
        order, so a burst of load from elsewhere hits the rows alike."""
        nonlocal seed
        for nbytes in sizes:
            live = []
            for name, producer, make, consumer in systems:
                entry: dict[str, Any] = {"times": []}
                rows[name][nbytes] = entry
                try:
                    ray.get(producer.allocate.remote(nbytes), timeout=TIMEOUT_S)
                    live.append((name, producer, make, consumer, entry))
                except Exception as exc:
                    entry["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
            for i in range(repeats + 1):
                for k in range(len(live)):
                    name, producer, make, consumer, entry = live[(k + i) % len(live)]
                    if "error" in entry:
                        continue
                    seed += SEED_STEP
                    try:
                        ray.get(producer.prepare.remote(seed), timeout=TIMEOUT_S)
                        t0 = time.perf_counter()
                        got = ray.get(
                            consumer.consume.remote(make(), seed, nbytes, i == 0),
                            timeout=TIMEOUT_S,
                        )
                        seconds = time.perf_counter() - t0
                        assert got == nbytes
                    except Exception as exc:
                        entry["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
                        log(f"{name} @ {nbytes // MIB} MiB FAILED: {entry['error']}")
                        continue
                    if i:
                        entry["times"].append(seconds)
                    else:
                        entry["cold"] = seconds
            for name, _, _, _, entry in live:
                if entry["times"]:
                    entry["median_gbps"] = statistics.median(
                        nbytes / t / GB for t in entry["times"]
                    )
                    log(f"{name} @ {nbytes // MIB} MiB: {entry['median_gbps']:.2f} GB/s")

    def run_row(name: str, producer: Any, make: Any, consumer: Any) -> None:
        run_rows([(name, producer, make, consumer)])

    log("raydirect: tcp and gloo")
    producer = OursProducer.options(**ours).remote()
    consumer = Consumer.options(**on_a, runtime_env={"env_vars": thp}).remote()
    where = ray.get([producer.allocate.remote(MIB), consumer.where.remote()], timeout=TIMEOUT_S)
    log(f"producer on {where[0]}, consumer on {where[1]}")
    rd.create_collective_group([producer, consumer], backend="gloo", name="bench")
    single = {**thp, "RAYDIRECT_TCP_STREAMS": "1"}
    one_stream = Consumer.options(**on_a, runtime_env={"env_vars": single}).remote()
    run_row("raydirect tcp (1 stream)", producer, producer.make_tcp.remote, one_stream)
    ray.kill(one_stream)
    tcp_rows = [("raydirect tcp", producer, producer.make_tcp.remote, consumer)]
    for records, name in (
        ("frames", "raydirect tcp (encrypted, TLS)"),
        ("tls", "raydirect tcp (encrypted, TLS records in user space)"),
    ):  # TLS 1.3 on the stream port (a certificate the producer makes), interleaved with clear
        sealed_env = {**thp, "RAYDIRECT_ENCRYPT": "1", "RAYDIRECT_TLS_RECORDS": records}
        options = {"resources": {"nodeB": 0.001}, "runtime_env": {"env_vars": sealed_env}}
        sealed = OursProducer.options(**options).remote()
        ray.get(sealed.allocate.remote(MIB), timeout=TIMEOUT_S)
        tcp_rows.append((name, sealed, sealed.make_tcp.remote, consumer))
    run_rows(tcp_rows)
    for _, sealed, _, _ in tcp_rows[1:]:
        ray.kill(sealed)
    run_row("raydirect gloo", producer, producer.make_gloo.remote, consumer)
    counts = ray.get(consumer.stats.remote(), timeout=TIMEOUT_S)
    log(f"raydirect consumer received, by transport: {counts}")
    rd.destroy_collective_group("bench")
    ray.kill(producer)
    ray.kill(consumer)

    log("Ray object store")
    producer = StoreProducer.options(**ours).remote()
    consumer = Consumer.options(**on_a, runtime_env={"env_vars": thp}).remote()
    run_row("ray object store", producer, producer.make.remote, consumer)
    ray.kill(producer)
    ray.kill(consumer)

    log("Ray RDT gloo (GLOO_SOCKET_IFNAME=rdveth for its workers)")
    from ray.experimental.collective import create_collective_group

    producer = RdtProducer.options(resources={"nodeB": 0.001}, runtime_env=theirs_env).remote()
    consumer = RdtConsumer.options(**on_a, runtime_env=theirs_env).remote()
    ray.get([producer.allocate.remote(MIB), consumer.where.remote()], timeout=TIMEOUT_S)
    create_collective_group([producer, consumer], backend="torch_gloo")
    run_row("ray RDT gloo", producer, producer.make.remote, consumer)
    return {"rows": rows, "raydirect_received": counts, "nodes": where}


# ---------------------------------------------------------------- outside: cluster and table


def iperf_rate(cluster: Any, harness: Any, args: list[str]) -> float:
    """GB/s that one iperf3 client run from node B to node A received."""
    server = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            harness.NS_HEAD,
            "iperf3",
            "-s",
            "-1",
            "-B",
            harness.ADDR_HEAD,
            "-p",
            str(IPERF_PORT),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _attempt in range(50):  # the server needs a moment to listen
            proc = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    harness.NS_WORKER,
                    "iperf3",
                    "-J",
                    "-c",
                    harness.ADDR_HEAD,
                    "-p",
                    str(IPERF_PORT),
                    *args,
                ],
                capture_output=True,
                text=True,
                timeout=120,
            )
            report = json.loads(proc.stdout or "{}")
            if proc.returncode == 0 and "sum_received" in report.get("end", {}):
                return report["end"]["sum_received"]["bits_per_second"] / 8 / GB
            time.sleep(0.1)
        raise RuntimeError(f"iperf3 failed: {proc.stdout[-500:]} {proc.stderr[-500:]}")
    finally:
        server.kill()
        server.wait(timeout=30)


def iperf_rows(cluster: Any, harness: Any, sizes: list[int], repeats: int) -> dict[str, Any]:
    """iperf3 over the same veth, same direction: per size (``-n``), and sustained."""
    rows: dict[str, Any] = {}
    for nbytes in sizes:
        rates = [iperf_rate(cluster, harness, ["-n", str(nbytes)]) for _ in range(repeats)]
        rows[str(nbytes)] = {"median_gbps": statistics.median(rates), "rates": rates}
        log(f"{IPERF} @ {nbytes // MIB} MiB: {rows[str(nbytes)]['median_gbps']:.2f} GB/s")
    sustained = {
        f"{p} streams, 3 s": iperf_rate(cluster, harness, ["-t", "3", "-P", str(p)]) for p in (1, 2)
    }
    log(f"iperf3 sustained: {sustained}")
    return {"rows": rows, "sustained": sustained}


def table(result: dict[str, Any], sizes: list[int]) -> str:
    rows = result["rows"]
    lines = [
        "| row | size | median GB/s | vs iperf3 | vs object store | vs RDT gloo |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in ROWS:
        for nbytes in sizes:
            entry = rows[name][str(nbytes)]
            rate = entry.get("median_gbps")
            base = rows["ray object store"][str(nbytes)].get("median_gbps")
            rdt = rows["ray RDT gloo"][str(nbytes)].get("median_gbps")
            wire = rows[IPERF][str(nbytes)].get("median_gbps")
            if rate is None:
                lines.append(f"| {name} | {nbytes // MIB} MiB | n/a ({entry.get('error')}) |||")
                continue
            ratios = [f"{rate / b:.2f}x" if b else "n/a" for b in (wire, base, rdt)]
            lines.append(f"| {name} | {nbytes // MIB} MiB | {rate:.2f} | {' | '.join(ratios)} |")
    return "\n".join(lines)


def outer(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "multinode"))
    import mn_harness

    reason = mn_harness.unavailable_reason()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    if shutil.which("iperf3") is None:
        print("cannot run: iperf3 is missing (apt-get install iperf3)", file=sys.stderr)
        return 2
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    cluster = mn_harness.Cluster(object_store_bytes=max(sizes) * 4 + (256 << 20))
    log("starting two Ray nodes in namespaces rdA (10.77.0.1) and rdB (10.77.0.2)")
    cluster.start()
    try:
        wire = iperf_rows(cluster, mn_harness, sizes, args.repeats)
        driver = cluster.start_driver(
            Path(__file__).resolve(),
            "--inner",
            "--sizes",
            args.sizes,
            "--repeats",
            str(args.repeats),
        )
        try:
            result = driver.expect("result", timeout=args.timeout)
        finally:
            driver.close()
            print(driver.stderr_tail(4000), file=sys.stderr)
    finally:
        cluster.teardown()
    result["rows"][IPERF] = wire["rows"]
    result["iperf3_sustained"] = wire["sustained"]
    print(table(result, sizes))
    print(f"\niperf3 sustained over the same veth: {wire['sustained']}")
    print(f"\nraydirect consumer received, by transport: {result['raydirect_received']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("address", nargs="?", help=argparse.SUPPRESS)
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="64MiB,512MiB,1GiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=1500.0, help="whole run, seconds")
    parser.add_argument("--json", help="also write the raw timings here")
    args = parser.parse_args()
    if not args.inner:
        return outer(args)
    import ray

    ray.init(address=args.address, logging_level="warning", log_to_driver=True)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    try:
        result = inner(args.address, sizes, args.repeats)
        print("@@RD " + json.dumps({"event": "result", **result}), flush=True)
    except Exception as exc:
        print("@@RD " + json.dumps({"event": "crash", "error": repr(exc)}), flush=True)
        raise
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
