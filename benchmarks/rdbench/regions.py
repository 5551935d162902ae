"""Workload 10: ranged reads of a long-lived region, against the copy they cost.

The question (issue 40): what does reading a decode request's KV blocks out of
another process's paged cache cost, next to one in-process copy of the same
bytes, next to NIXL reading the same bytes between the same two processes, and
next to moving the same amount as an object? An owner exports its cache once
(``rd.export_region``: 4 layers of 1,024 blocks of 8 KiB; and a copy of it on
4 KiB pages, exported with ``huge_pages=False``, for what the owner's huge
pages give a cross-memory read); a reader reads a
fixed random choice of blocks of every layer into its own blocks: 1 MiB is 128
runs of 8 KiB, 16 MiB is 2,048. Each operation is timed inside the reader (a
region read needs no Ray call, so one around it would be most of what a 1 MiB
read is timed at), the systems in interleaved rounds; every read is checked,
untimed, against the seed the owner wrote before it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

from rdbench.common import (
    GROUP_FLOORS,
    GROUP_NIXL,
    GROUP_RAY,
    GROUP_RAYDIRECT,
    MIB,
    OBJECT_STORE,
    SETUP_TIMEOUT_S,
    Row,
    describe_error,
    format_size,
    log,
)
from rdbench.fleet import Context, raydirect_nixl_missing, skip
from rdbench.region_actors import (
    FLOOR,
    NIXL,
    OBJECT_RD,
    REGION_4K,
    REGION_AUTO,
    REGION_SHM,
    REGION_TCP,
    RegionOwner,
    RegionReader,
)
from rdbench.region_actors import OBJECT_STORE as OBJECT_STORE_OP

REGION_READ = "raydirect region read (auto: cma)"
REGION_READ_4K = "raydirect region read (auto: cma), owner on 4 KiB pages (huge_pages=False)"
REGION_READ_SHM = "raydirect region read, shm"
REGION_READ_TCP = "raydirect region read, tcp"
OBJECT_READ = "raydirect rd.get of an equal object"
NIXL_READ = "nixl READ of the same runs"
FLOOR_GATHER = "floor: one in-process copy of the same runs"
SIZES = (1 * MIB, 16 * MIB)

# (system, group, the reader's operation), in the order of a round.
SYSTEMS = (
    (REGION_READ, GROUP_RAYDIRECT, REGION_AUTO),
    (REGION_READ_4K, GROUP_RAYDIRECT, REGION_4K),
    (REGION_READ_SHM, GROUP_RAYDIRECT, REGION_SHM),
    (REGION_READ_TCP, GROUP_RAYDIRECT, REGION_TCP),
    (OBJECT_READ, GROUP_RAYDIRECT, OBJECT_RD),
    (OBJECT_STORE, GROUP_RAY, OBJECT_STORE_OP),
    (NIXL_READ, GROUP_NIXL, NIXL),
    (FLOOR_GATHER, GROUP_FLOORS, FLOOR),
)
NOT_ASKED = "NIXL rows run in a run of their own: --workloads 10 --groups raydirect,floors,nixl"


def region_reads(ctx: Context) -> list[Row]:
    """Workload 10: at 1 MiB and 16 MiB, ``--rounds`` interleaved rounds of one
    read per system, each timed inside the reader: ``rd.read_ranges`` of the
    region (auto, shm, tcp); ``rd.get`` and ``ray.get`` of a ``@rd.method`` /
    plain method returning an equal tensor (the Ray call included: an object
    needs one); a NIXL READ of the same runs into the same blocks, prepared once
    and reposted; and the floor, ``torch.index_select`` of the same blocks in
    the reader, one thread."""
    cfg, rows = ctx.config, list[Row]()
    owner, reader = RegionOwner.remote(), RegionReader.remote()
    try:
        handle = ray.get(owner.handles.remote(), timeout=SETUP_TIMEOUT_S)
        huge = ray.get(owner.huge_pages.remote(), timeout=SETUP_TIMEOUT_S)
        log(f"w10: the owner's memory on huge pages: {huge >> 20} MiB (its region: 32 MiB)")
        for nbytes in SIZES:
            family = _family(ctx, nbytes)
            rows += family.values()
            ops = _ready(owner, reader, handle, nbytes, family)
            _rounds(ctx, family, ops, cfg.medium_rounds)
        ray.get(owner.close.remote(), timeout=SETUP_TIMEOUT_S)
    finally:
        ray.kill(owner)
        ray.kill(reader)
    return rows


def _family(ctx: Context, nbytes: int) -> dict[str, Row]:
    family = {}
    for system, group, _ in SYSTEMS:
        if group == GROUP_NIXL or ctx.config.wants(group):
            family[system] = Row(10, system, format_size(nbytes), nbytes, nbytes, unit="us")
    nixl = family.get(NIXL_READ)
    if nixl is not None:
        skip(
            nixl, raydirect_nixl_missing() or (None if ctx.config.wants(GROUP_NIXL) else NOT_ASKED)
        )
    return family


def _ready(
    owner: Any, reader: Any, handle: Any, nbytes: int, family: dict[str, Row]
) -> dict[str, Callable[[int], float]]:
    """Set both processes up for reads of ``nbytes``; one timed read per system."""
    ray.get(owner.allocate.remote(nbytes), timeout=SETUP_TIMEOUT_S)
    merged = ray.get(reader.setup.remote(handle, owner, nbytes), timeout=SETUP_TIMEOUT_S)
    for row in family.values():
        if row.system.startswith("raydirect region"):
            row.note = f"{merged} rows after merging"
    nixl = family.get(NIXL_READ)
    if nixl is not None and nixl.skipped is None:
        try:
            meta, addresses = ray.get(owner.nixl_metadata.remote(), timeout=SETUP_TIMEOUT_S)
            ray.get(reader.setup_nixl.remote(meta, addresses, nbytes), timeout=SETUP_TIMEOUT_S)
        except Exception as exc:
            nixl.error = f"NIXL setup failed: {describe_error(exc)}"

    def operation(name: str) -> Callable[[int], float]:
        def one(seed: int) -> float:
            ray.get(owner.prepare.remote(seed), timeout=SETUP_TIMEOUT_S)
            return float(ray.get(reader.timed.remote(name, nbytes, seed), timeout=SETUP_TIMEOUT_S))

        return one

    return {system: operation(op) for system, _, op in SYSTEMS if system in family}


def _rounds(
    ctx: Context, family: dict[str, Row], ops: dict[str, Callable[[int], float]], rounds: int
) -> None:
    """One cold read of each system, then ``rounds`` rounds of one each; a system
    that fails leaves the rounds, the others go on."""
    live = [s for s, row in family.items() if row.error is None and row.skipped is None]
    point = next(iter(family.values())).param
    log(f"w10 @ {point}: {len(live)} systems, 1 cold + {rounds} interleaved rounds")
    for i in range(rounds + 1):
        for system in list(live):
            try:
                seconds = ops[system](next(ctx.seed_iter))
            except Exception as exc:
                family[system].error = describe_error(exc)
                log(f"w10 {system} @ {point}: FAILED: {family[system].error}")
                live.remove(system)
                continue
            if i == 0:
                family[system].cold_s = seconds
            else:
                family[system].times_s.append(seconds)
    for system in live:
        log(f"w10 {system} @ {point}: median {family[system].median():.0f} us")
