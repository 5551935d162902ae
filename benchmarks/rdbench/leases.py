"""Workload 13: what a value's lifetime costs a transfer, in time and in CPU.

The question (issue 41): through the same two Ray calls, what do raydirect's
lifetimes add to a 1 MiB transfer when transfers follow one another? Workload 8
asks the producer to wait, untimed, until its last object is freed before each
transfer, which moves the lease's release out of the timed window; here nothing
waits, so each system pays for its own releases, as a loop of transfers does.

Rows, each a producer method and a consumer method that takes the value:

- the two bare calls, returning an int (the baseline);
- the floor of a transfer through them: the producer returns a ``StandIn``
  (Payload-sized, pickled as a Payload is) and the consumer makes the one
  copy of 1 MiB into new memory that any receive makes (no raydirect);
- ``@rd.method`` (the default lifetime: a lease, Ray's reference counting);
- ``@rd.method(reads=1, ttl=60)`` (freed after its one read: no lease);
- the producer returns ``[ray.put(an int)]`` and the consumer ``ray.get``s it
  (the calls and a put ref, no raydirect: ``rd.put``'s baseline);
- the producer returns ``[rd.put(tensor)]`` (no lease: the free hangs on the
  put ref itself).

Each system runs in blocks of ``_BLOCK`` consecutive transfers (the first
``_WARM`` not counted), systems rotating, ``--lease-blocks`` blocks each:
alternating call by call would charge one system's background work (the
lease's release, plasma eviction, pubsub) to the next. Beside the latency, each
row measures the CPU per transfer of the driver, the producer, the consumer,
the raylet and the GCS together (``/proc``): the work a lease spreads over
processes that no single timer sees. The tensor is written once per block
(its seed checked by the consumer), since writing it in between would wait for
the frees this workload means to count.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray._private import ray_constants
from ray._private import worker as ray_worker

from rdbench.common import (
    ELEMENT_BYTES,
    GROUP_FLOORS,
    GROUP_RAY,
    GROUP_RAYDIRECT,
    MIB,
    SETUP_TIMEOUT_S,
    TRANSFER_TIMEOUT_S,
    Row,
    describe_error,
    format_size,
    log,
)
from rdbench.fleet import Context, allocate
from rdbench.report import TargetLine, render_targets

NBYTES = 1 * MIB  # the size issue 41's targets are stated at
TENSOR = "x"
BARE = "the two calls, returning an int"
FLOOR = "floor: the two calls, a Payload-sized object, one 1 MiB copy"
LEASED = "raydirect auto (a lease)"
READ_ONCE = "raydirect auto, reads=1 (no lease)"
PUT_INT = "ray.put of an int, ref returned"
RD_PUT = "rd.put, ref returned"
CPU = "CPU ms per transfer (driver, producer, consumer, raylet, GCS)"
_BLOCK, _WARM = 25, 5  # transfers per block, and those of each block not counted
# (system, group, producer method, consumer method)
SYSTEMS = (
    (BARE, GROUP_RAY, "number", "take_number"),
    (FLOOR, GROUP_FLOORS, "stand_in", "take_stand_in"),
    (LEASED, GROUP_RAYDIRECT, "one_auto", "consume"),
    (READ_ONCE, GROUP_RAYDIRECT, "one_read_once", "consume"),
    (PUT_INT, GROUP_RAY, "put_number", "consume_put"),
    (RD_PUT, GROUP_RAYDIRECT, "put_auto", "consume_put"),
)
TARGETS = ((LEASED, 2.0), (READ_ONCE, 1.3))  # issue 41, over the bare calls at 1 MiB


def leases(ctx: Context) -> list[Row]:
    """Workload 13: every chosen system in rotating blocks at 1 MiB (the module's
    docstring). Timed from the driver, per transfer:
    ``ray.get(consumer.<take>.remote(producer.<method>.remote("x"), seed, n))``."""
    cfg = ctx.config
    chosen = [s for s in SYSTEMS if cfg.wants(s[1])]
    if not chosen:
        return []
    point = format_size(NBYTES)
    rows = {s[0]: Row(13, s[0], point, NBYTES, NBYTES, unit="us") for s in chosen}
    producer, consumer = ctx.producers(1)[0], ctx.consumers(1)[0]
    if not allocate([producer], {TENSOR: (NBYTES // ELEMENT_BYTES,)}, list(rows.values())):
        return list(rows.values())
    pids = _pids(producer, consumer)
    ops = {name: _operation(producer, consumer, method, take) for name, _, method, take in chosen}
    live = list(rows)
    log(f"w13 @ {point}: {len(live)} systems, {cfg.lease_blocks} blocks of {_BLOCK} each")
    for block in range(cfg.lease_blocks):
        seed = next(ctx.seed_iter)
        for system in list(live):
            try:
                ray.get(producer.prepare.remote(seed), timeout=SETUP_TIMEOUT_S)
                _block(rows[system], ops[system], seed, pids, first=block == 0)
            except Exception as exc:  # the row says why; the others go on
                rows[system].error = describe_error(exc)
                log(f"w13 {system}: FAILED: {rows[system].error}")
                live.remove(system)
    for system in live:
        row = rows[system]
        # The mean, so the whole run's CPU over all its counted transfers: each
        # block's figure comes in steps of 0.5 ms (10 ms ticks over 20), and a
        # median of such steps is one of them.
        cpu = statistics.fmean(row.samples[CPU]) * 1e3
        row.measured[CPU] = cpu
        log(f"w13 {system}: median {row.median():.0f} us, CPU {cpu:.2f} ms per transfer")
    ctx.release()
    return list(rows.values())


def _operation(producer: Any, consumer: Any, method: str, take: str) -> Callable[[int], Any]:
    """One transfer, not waited for: the consumer's ref."""
    make, consume = getattr(producer, method).remote, getattr(consumer, take).remote
    return lambda seed: consume(make(TENSOR), seed, NBYTES)


def _block(row: Row, op: Callable[[int], Any], seed: int, pids: list[int], first: bool) -> None:
    """``_BLOCK`` consecutive transfers; the first of the run is the row's cold
    one, the first ``_WARM`` of each block are not counted, and the CPU of the
    counted ones is sampled, per transfer."""
    for i in range(_BLOCK):
        if i == _WARM:
            used = _cpu_seconds(pids)
        start = time.perf_counter()
        got = ray.get(op(seed), timeout=TRANSFER_TIMEOUT_S)
        seconds = time.perf_counter() - start
        if got != NBYTES:
            raise ValueError(f"the consumer reported {got} bytes, expected {NBYTES}")
        if first and i == 0:
            row.cold_s = seconds
        elif i >= _WARM:
            row.times_s.append(seconds)
    row.samples.setdefault(CPU, []).append((_cpu_seconds(pids) - used) / (_BLOCK - _WARM))


def _pids(producer: Any, consumer: Any) -> list[int]:
    """The processes a transfer works in: this driver, the two actors, and this
    session's raylet and GCS (the node's own, not any other Ray on the machine)."""
    actors = ray.get([producer.pid.remote(), consumer.pid.remote()], timeout=SETUP_TIMEOUT_S)
    node = ray_worker._global_node
    running: dict[str, list[Any]] = node.all_processes if node is not None else {}
    daemons = [
        info.process.pid
        for kind in (ray_constants.PROCESS_TYPE_RAYLET, ray_constants.PROCESS_TYPE_GCS_SERVER)
        for info in running.get(kind, [])
    ]
    return [os.getpid(), *actors, *daemons]


def _cpu_seconds(pids: list[int]) -> float:
    """User and system CPU seconds the processes have used so far."""
    ticks = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command, which may hold spaces
        ticks += int(fields[11]) + int(fields[12])  # utime + stime
    return ticks / os.sysconf("SC_CLK_TCK")


def lease_targets(rows: Sequence[Row]) -> str:
    """Issue 41's latency targets over the bare calls as this run measured them,
    and each row's CPU per transfer beside the bare calls' (the CPU target: the
    default lifetime's at most half of what a ``ray.put`` lease cost, 4 ms)."""
    median: dict[str, float] = {r.system: m for r in rows if (m := r.median()) is not None}
    bare = median.get(BARE)

    def over_bare(system: str) -> float | None:
        return median[system] / bare if bare and system in median else None

    lines = [
        TargetLine(f"{system} / the two calls", bound, True, format_size(NBYTES),
                   over_bare(system), over_bare(FLOOR))
        for system, bound in TARGETS
    ]  # fmt: skip
    title = (
        "Targets (ratios of median times in this run; the floor: the two calls "
        "returning a Payload-sized object, with one 1 MiB copy):"
    )
    table = render_targets(lines, title)
    cpu = [f"| {r.system} | {r.measured[CPU]:.2f} |" for r in rows if CPU in r.measured]
    if not cpu:
        return table
    cpu_table = "\n".join([f"| system | {CPU} |", "|---|---:|", *cpu])
    return f"{table}\n\n{cpu_table}" if table else cpu_table
