"""Two or three real Ray nodes on this machine, each in its own network namespace.

::

    namespace rdA (head)        namespace rdB (worker)       namespace rdC (third node)
    rdveth 10.77.0.1/24         rdveth 10.77.0.2/24          rdveth 10.77.0.3/24
          |                           |                            |
          +----- veth ----- bridge rdbr (namespace rdnet) ----- veth ----+
    ray start --head            ray start --address=10.77.0.1:6379 (both workers)
    drivers run here (ip netns exec rdA)

Every node has its own link to the bridge, so the bytes a node sends and
receives are counted on its own ``rdveth`` (``link_bytes``): a test can check
that a fan-out crossed each link once. Every node's veth end is called ``rdveth``
inside its namespace, so one
``GLOO_SOCKET_IFNAME=rdveth`` fits every worker (Ray's own RDT needs it; raydirect
must not). Each node has its own ``--temp-dir`` and a custom resource (``nodeA`` /
``nodeB``) so actors can be placed on it. Ray 2.60 turns on token auth: every
process gets ``RAY_AUTH_MODE=token`` and one ``RAY_AUTH_TOKEN`` made for this
cluster (nothing is read from or written to ``~/.ray``).

Tear-down kills the processes ``ip netns pids`` lists (never by name), deletes
the namespaces (the veth pair goes with them) and the temp dir; a run that
crashed is cleaned up by the next one. Every command has a time limit.

Used by ``tests/multinode`` and ``benchmarks/rdbench/multinode.py`` (workloads 15
and 16 of ``raydirect bench``); stdlib only, and it never connects to Ray itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from raydirect.transports import nixl_agent

NS_HEAD, NS_WORKER, NS_THIRD = "rdA", "rdB", "rdC"
ADDR_HEAD, ADDR_WORKER, ADDR_THIRD = "10.77.0.1", "10.77.0.2", "10.77.0.3"
NS_NET, BRIDGE = "rdnet", "rdbr"  # the switch every node's link plugs into
# What ``auto`` picks between the two nodes (one venv runs both): nixl when it
# is installed, else tcp (the test objects share no group).
CROSS_NODE = "nixl" if nixl_agent.installed() else "tcp"
_OUTER_CLUSTER = ("RAY_ADDRESS", "RAY_NAMESPACE", "RAYDIRECT_NODE_IP", "GLOO_SOCKET_IFNAME")
VETH = "rdveth"  # the name of the veth end inside each namespace
GCS_PORT = 6379
ADDRESS = f"{ADDR_HEAD}:{GCS_PORT}"
RESOURCE_HEAD, RESOURCE_WORKER, RESOURCE_THIRD = "nodeA", "nodeB", "nodeC"
# namespace, address, custom resource; the head first
NODES = (
    (NS_HEAD, ADDR_HEAD, RESOURCE_HEAD),
    (NS_WORKER, ADDR_WORKER, RESOURCE_WORKER),
    (NS_THIRD, ADDR_THIRD, RESOURCE_THIRD),
)
TMP_PREFIX = "raydirect-multinode-"
OWNER_FILE = "owner.pid"
MESSAGE_PREFIX = "@@RD "  # a driver's JSON messages on stdout start with this

CMD_TIMEOUT_S = 30.0
RAY_START_TIMEOUT_S = 120.0
KILL_TIMEOUT_S = 20.0


# How long a reader may take to learn that a node it reads from is gone.
LOSS_BOUND_S = 60.0


def is_producer_lost(error: dict) -> bool:
    """A driver's ``describe``d error is raydirect.ProducerLostError itself, or Ray's
    wrapper carrying its message."""
    if error["is_producer_lost"] or error["type"] == "ProducerLostError":
        return True
    return "ProducerLostError" in error["message"] or "tensors are lost" in error["message"]


class HarnessError(RuntimeError):
    """A step of setting up or driving the cluster failed; the message says which."""


def _run(cmd: list[str], timeout: float = CMD_TIMEOUT_S, check: bool = True, **kw: Any):
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as exc:
        raise HarnessError(f"{' '.join(cmd)} timed out after {timeout}s") from exc
    if check and proc.returncode != 0:
        raise HarnessError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}"
            f"\n{proc.stderr[-3000:]}"
        )
    return proc


def unavailable_reason() -> str | None:
    """Why two namespaced nodes cannot run here, or None when they can."""
    if not sys.platform.startswith("linux"):
        return "multi-node tests need Linux network namespaces"
    if os.environ.get("RAYDIRECT_SKIP_MULTINODE"):
        return "RAYDIRECT_SKIP_MULTINODE is set"
    if shutil.which("ip") is None:
        return "multi-node tests need the `ip` command (iproute2)"
    probe = f"rdprobe{os.getpid()}"
    try:
        proc = _run(["ip", "netns", "add", probe], check=False)
    except HarnessError as exc:
        return f"`ip netns add` did not answer: {exc}"
    if proc.returncode != 0:
        return f"`ip netns add` is not permitted here: {proc.stderr.strip()}"
    with contextlib.suppress(HarnessError):
        proc = _run(["ip", "netns", "exec", probe, "ip", "link", "set", "lo", "up"], check=False)
    _run(["ip", "netns", "del", probe], check=False)
    if proc.returncode != 0:
        return f"`ip netns exec` is not permitted here: {proc.stderr.strip()}"
    return None


def namespace_exists(ns: str) -> bool:
    return Path("/run/netns", ns).exists()


def namespace_pids(ns: str) -> list[int]:
    """Processes whose network namespace is ``ns``."""
    if not namespace_exists(ns):
        return []
    out = _run(["ip", "netns", "pids", ns], check=False).stdout
    return sorted({int(p) for p in out.split() if p.isdigit()} - {os.getpid()})


def kill_namespace_processes(ns: str, timeout: float = KILL_TIMEOUT_S) -> list[int]:
    """SIGKILL every process in ``ns`` until none is left (Ray may start workers
    while we kill). Returns the pids killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while True:
        pids = namespace_pids(ns)
        if not pids:
            return sorted(killed)
        if time.monotonic() > deadline:
            raise HarnessError(f"processes in namespace {ns} survive SIGKILL: {pids}")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
        time.sleep(0.1)


def remove_shm_segments_of(pids: list[int]) -> list[str]:
    """Unlink raydirect segments (``/dev/shm/rd-<pid>-...``) of dead ``pids``."""
    removed = []
    wanted = {str(p) for p in pids}
    for name in os.listdir("/dev/shm"):
        parts = name.split("-")
        if name.startswith("rd-") and len(parts) > 2 and parts[1] in wanted:
            if Path(f"/proc/{parts[1]}").exists():
                continue  # pid reused by a live process: not ours to remove
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join("/dev/shm", name))
                removed.append(name)
    return removed


def shm_segments_of(pids: list[int], seals: bool = True) -> list[str]:
    """raydirect files in /dev/shm named after one of ``pids``: staged segments, and
    the slabs of their seals (``rd-<pid>-<start>-seals-<n>``) unless ``seals=False``."""
    wanted = {str(p) for p in pids}
    return sorted(
        n
        for n in os.listdir("/dev/shm")
        if n.startswith("rd-") and n.split("-")[1] in wanted and (seals or "-seals-" not in n)
    )


def delete_namespace(ns: str) -> list[int]:
    killed = kill_namespace_processes(ns)
    if namespace_exists(ns):
        _run(["ip", "netns", "del", ns], check=False)
    return killed


def cleanup_leftovers() -> None:
    """Remove what a crashed earlier run left: namespaces, processes, temp dirs."""
    killed: list[int] = []
    for ns, _, _ in NODES:
        killed += delete_namespace(ns)
    delete_namespace(NS_NET)
    remove_shm_segments_of(killed)
    for path in Path(tempfile.gettempdir()).glob(f"{TMP_PREFIX}*"):
        try:
            owner = int((path / OWNER_FILE).read_text())
        except (OSError, ValueError):
            owner = 0
        if owner and Path(f"/proc/{owner}").exists():
            continue  # another run that is still alive
        shutil.rmtree(path, ignore_errors=True)


class Driver:
    """A driver script running inside the head's namespace, talking JSON lines."""

    def __init__(self, proc: subprocess.Popen, stderr_path: Path, what: str) -> None:
        self.proc = proc
        self.stderr_path = stderr_path
        self.what = what
        self._buffer = b""
        self._selector = selectors.DefaultSelector()
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        self._selector.register(proc.stdout, selectors.EVENT_READ)
        self.output: list[str] = []

    def stderr_tail(self, chars: int = 6000) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _fail(self, why: str) -> HarnessError:
        return HarnessError(
            f"driver {self.what}: {why}\n--- stdout (tail) ---\n"
            + "\n".join(self.output[-40:])
            + f"\n--- stderr (tail) ---\n{self.stderr_tail()}"
        )

    def expect(self, event: str | tuple[str, ...], timeout: float) -> dict[str, Any]:
        """The next message with ``event`` (or one of several); skips other output."""
        events = (event,) if isinstance(event, str) else event
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while True:
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                text = line.decode(errors="replace")
                self.output.append(text)
                if text.startswith(MESSAGE_PREFIX):
                    message = json.loads(text[len(MESSAGE_PREFIX) :])
                    if message.get("event") in events:
                        return message
                    if message.get("event") == "crash":
                        raise self._fail(f"crashed: {message.get('error')}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(f"no {event!r} message within {timeout}s")
            if self._selector.select(min(left, 0.5)):
                chunk = self.proc.stdout.read()
                if chunk:
                    self._buffer += chunk
                    continue
            if self.proc.poll() is not None:
                rest = self.proc.stdout.read() or b""
                if rest:
                    self._buffer += rest
                    continue
                raise self._fail(f"exited ({self.proc.returncode}) before sending {event!r}")

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def close(self, timeout: float = 30.0) -> None:
        with contextlib.suppress(Exception):
            if self.proc.stdin:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._selector.close()
        if self.proc.stdout:
            self.proc.stdout.close()


def link_bytes(ns: str) -> dict[str, int]:
    """Bytes received and sent so far on the node's link (its ``rdveth``)."""
    out = _run(["ip", "-n", ns, "-s", "-j", "link", "show", VETH]).stdout
    stats = json.loads(out)[0]["stats64"]
    return {"rx": int(stats["rx"]["bytes"]), "tx": int(stats["tx"]["bytes"])}


def throttle(ns: str, rate: str | None) -> None:
    """Limit what the node sends to ``rate`` (tc's syntax, e.g. "400mbit"); None
    removes the limit."""
    _run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", VETH, "root"], check=False)
    if rate is not None:
        _run(
            [
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                "add",
                "dev",
                VETH,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "256kb",
                "latency",
                "100ms",
            ]
        )


class Cluster:
    """The head and one or two worker nodes, each in its own network namespace on
    one bridge; ``start()`` then ``teardown()``."""

    def __init__(
        self, object_store_bytes: int = 1 << 30, num_cpus: int = 4, workers: int = 1
    ) -> None:
        if not 1 <= workers < len(NODES):
            raise ValueError(f"workers: 1 or {len(NODES) - 1}, not {workers}")
        self.nodes = NODES[: 1 + workers]
        self.object_store_bytes = object_store_bytes
        self.num_cpus = num_cpus
        self.token = secrets.token_hex(32)
        self.tmp: Path | None = None
        self.address = ADDRESS
        self.python = sys.executable
        ray_cli = Path(sys.executable).with_name("ray")
        self.ray_cli = str(ray_cli) if ray_cli.exists() else (shutil.which("ray") or "ray")
        self.killed_worker_pids: list[int] = []

    # -- environment
    def env(self, **extra: str) -> dict[str, str]:
        """The environment of every Ray process and driver of this cluster."""
        env = {
            k: v
            for k, v in os.environ.items()
            # what names the test process's own cluster (the vLLM plug-in exports
            # RAY_NAMESPACE and RAYDIRECT_NODE_IP there) is not this cluster's
            if k not in _OUTER_CLUSTER and not k.startswith("RAY_AUTH")
        }
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token, PYTHONUNBUFFERED="1")
        # The "nodes" are namespaces of one machine: UCX (NIXL, where installed) would
        # see one host and use shared memory, never the links the tests measure.
        env.setdefault("UCX_TLS", "tcp")
        env.update(extra)
        return env

    def _in_ns(self, ns: str, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, *cmd]

    # -- life cycle
    def start(self) -> Cluster:
        cleanup_leftovers()
        self.tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX))
        (self.tmp / OWNER_FILE).write_text(str(os.getpid()))
        try:
            self._make_network()
            self._start_head()
            for ns, _, _ in self.nodes[1:]:
                self.start_worker(ns)
        except BaseException:
            self.teardown()
            raise
        return self

    def _make_network(self) -> None:
        _run(["ip", "netns", "add", NS_NET])
        _run(["ip", "-n", NS_NET, "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "-n", NS_NET, "link", "set", BRIDGE, "up"])
        for i, (ns, addr, _) in enumerate(self.nodes):
            _run(["ip", "netns", "add", ns])
            # Temporary names in the root namespace, renamed inside each namespace.
            node_end, bridge_end = (
                f"rdv{os.getpid() % 100000}n{i}",
                f"rdv{os.getpid() % 100000}b{i}",
            )
            _run(["ip", "link", "add", node_end, "type", "veth", "peer", "name", bridge_end])
            _run(["ip", "link", "set", bridge_end, "netns", NS_NET])
            port = f"rdport{i}"
            _run(["ip", "-n", NS_NET, "link", "set", bridge_end, "name", port])
            _run(["ip", "-n", NS_NET, "link", "set", port, "master", BRIDGE, "up"])
            _run(["ip", "link", "set", node_end, "netns", ns])
            _run(self._in_ns(ns, ["ip", "link", "set", node_end, "name", VETH]))
            _run(self._in_ns(ns, ["ip", "addr", "add", f"{addr}/24", "dev", VETH]))
            _run(self._in_ns(ns, ["ip", "link", "set", VETH, "up"]))
            _run(self._in_ns(ns, ["ip", "link", "set", "lo", "up"]))

    def _ray_start(self, ns: str, args: list[str], temp_dir: Path) -> None:
        cmd = [
            self.ray_cli,
            "start",
            *args,
            f"--temp-dir={temp_dir}",
            f"--num-cpus={self.num_cpus}",
            f"--object-store-memory={self.object_store_bytes}",
            "--disable-usage-stats",
        ]
        _run(self._in_ns(ns, cmd), timeout=RAY_START_TIMEOUT_S, env=self.env())

    def _start_head(self) -> None:
        assert self.tmp is not None
        self._ray_start(
            NS_HEAD,
            [
                "--head",
                f"--node-ip-address={ADDR_HEAD}",
                f"--port={GCS_PORT}",
                "--include-dashboard=false",
                f"--resources={json.dumps({RESOURCE_HEAD: 1})}",
            ],
            self.tmp / "head",
        )

    def start_worker(self, ns: str = NS_WORKER) -> None:
        assert self.tmp is not None
        [(addr, resource)] = [(a, r) for n, a, r in self.nodes if n == ns and n != NS_HEAD]
        self._ray_start(
            ns,
            [
                f"--address={self.address}",
                f"--node-ip-address={addr}",
                f"--resources={json.dumps({resource: 1})}",
            ],
            self.tmp / f"{ns}-{len(self.killed_worker_pids)}",
        )

    def worker_alive(self, ns: str = NS_WORKER) -> bool:
        return bool(namespace_pids(ns))

    def ensure_worker(self, ns: str = NS_WORKER) -> None:
        """Bring a worker node back (link up, ``ray start``) after a node-loss test."""
        if not self.worker_alive(ns):
            self.restore_worker_link(ns)
            self.start_worker(ns)

    def kill_worker_node(self, ns: str = NS_WORKER) -> list[int]:
        """SIGKILL every process of a worker node (the namespace stays)."""
        killed = kill_namespace_processes(ns)
        self.killed_worker_pids += killed
        return killed

    def cut_worker_link(self, ns: str = NS_WORKER) -> None:
        """Take the worker's link down: packets to its address go nowhere (no
        connection refused), as when a machine vanishes."""
        _run(self._in_ns(ns, ["ip", "link", "set", VETH, "down"]))

    def restore_worker_link(self, ns: str = NS_WORKER) -> None:
        _run(self._in_ns(ns, ["ip", "link", "set", VETH, "up"]))

    def teardown(self) -> None:
        killed = list(self.killed_worker_pids)
        errors = []
        for ns in [n for n, _, _ in reversed(NODES)] + [NS_NET]:
            try:
                killed += delete_namespace(ns)
            except HarnessError as exc:
                errors.append(str(exc))
        remove_shm_segments_of(killed)
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
        if errors:
            raise HarnessError("; ".join(errors))

    # -- drivers
    def start_driver(self, script: str | Path, *args: str, env: dict[str, str] | None = None):
        """Run ``python script ADDRESS args...`` inside the head's namespace."""
        assert self.tmp is not None, "start() the cluster first"
        stderr_path = Path(tempfile.mkstemp(prefix="driver-", suffix=".err", dir=self.tmp)[1])
        with open(stderr_path, "wb") as err:
            proc = subprocess.Popen(
                self._in_ns(NS_HEAD, [self.python, str(script), self.address, *args]),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env or self.env(),
            )
        return Driver(proc, stderr_path, f"{Path(script).name} {' '.join(args)}")

    def run_driver(self, script: str | Path, *args: str, timeout: float = 240.0) -> dict:
        """Run a driver to the end; its ``result`` message."""
        driver = self.start_driver(script, *args)
        try:
            return driver.expect("result", timeout)
        finally:
            driver.close()


@contextlib.contextmanager
def started(**options: Any) -> Iterator[Cluster]:
    """A ``Cluster(**options)`` running for the block, torn down after it (it
    tears itself down if starting fails). Check ``unavailable_reason()`` first."""
    nodes = Cluster(**options).start()
    try:
        yield nodes
    finally:
        nodes.teardown()
