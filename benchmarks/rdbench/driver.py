"""Workload 5: the driver reads one large tensor (raydirect, Ray's object store,
Ray's RDT and its object-store fallback)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import ray

import raydirect as rd
from rdbench.common import (
    ELEMENT_BYTES,
    GROUP_NIXL,
    GROUP_RAY,
    GROUP_RAYDIRECT,
    GROUP_RDT,
    OBJECT_STORE,
    RDT_GLOO,
    RDT_NIXL,
    SETUP_TIMEOUT_S,
    TRANSFER_TIMEOUT_S,
    Layout,
    Row,
    check_pattern,
    describe_error,
    format_size,
    raydirect_system,
    run_row,
)
from rdbench.fleet import Context, allocate, rdt_nixl_missing, rdt_ready, skip


def to_driver(ctx: Context) -> list[Row]:
    """Workload 5: the driver reads one large tensor (``--driver-size``, 512 MiB by
    default). Timed: the producer's call until the value is in the driver and
    checked. Rows: raydirect auto (``rd.get``), Ray's object store (``ray.get``),
    RDT over Gloo (Ray refuses ``ray.get`` of a two-sided RDT object; the row says
    so, and ``ray.get(..., _use_object_store=True)``, its fallback through the
    object store, is measured as its own row) and RDT over NIXL (one-sided)."""
    cfg, rows = ctx.config, list[Row]()
    nbytes = cfg.driver_bytes
    param = format_size(nbytes)
    layout: Layout = {"x": (nbytes // ELEMENT_BYTES,)}

    def measure(
        row: Row, producer: Any, make: Callable[[], Any], read: Callable[[Any], Any]
    ) -> Row:
        def transfer(seed: int) -> float:
            ray.get(producer.prepare.remote(seed), timeout=SETUP_TIMEOUT_S)
            start = time.perf_counter()
            value = read(make())
            check_pattern(value, seed, nbytes)
            seconds = time.perf_counter() - start
            del value
            return seconds

        return run_row(row, cfg.repeats(nbytes), transfer, ctx.seed_iter)

    def row(system: str) -> Row:
        r = Row(5, system, param, nbytes, nbytes)
        rows.append(r)
        return r

    def rd_get(ref: Any) -> Any:
        return rd.get(ref, timeout=TRANSFER_TIMEOUT_S)

    def ray_get(ref: Any) -> Any:
        return ray.get(ref, timeout=TRANSFER_TIMEOUT_S)

    if cfg.wants(GROUP_RAYDIRECT) or cfg.wants(GROUP_RAY):
        producer = ctx.producers(1)[0]
        wanted = [
            (raydirect_system("auto"), GROUP_RAYDIRECT, "one_auto", rd_get),
            (OBJECT_STORE, GROUP_RAY, "one", ray_get),
        ]
        chosen = [(row(s), m, r) for s, g, m, r in wanted if cfg.wants(g)]
        if allocate([producer], layout, [c[0] for c in chosen]):
            for r, method, read in chosen:
                make = getattr(producer, method).remote
                measure(r, producer, functools.partial(make, "x"), read)
    if cfg.wants(GROUP_RDT) or cfg.wants(GROUP_NIXL):
        gloo = row(RDT_GLOO) if cfg.wants(GROUP_RDT) else None
        fallback = row(RDT_GLOO + ", _use_object_store=True") if gloo else None
        nixl = row(RDT_NIXL) if cfg.wants(GROUP_NIXL) else None
        family = [r for r in (gloo, fallback, nixl) if r is not None]
        actors = rdt_ready(ctx, family)
        if actors and allocate([actors[0]], layout, family):
            producer = actors[0]
            refusal = rdt_driver_refusal(producer) if gloo else None
            if gloo is None or fallback is None:
                pass
            elif refusal is None:
                measure(gloo, producer, lambda: producer.one.remote("x"), ray_get)
            elif "two-sided" in refusal:  # by design: say so, do not count it as a failure
                skip(gloo, f"RDT cannot deliver a Gloo object to the driver; Ray says {refusal}")
            else:
                gloo.error = refusal
            if fallback is not None:
                measure(
                    fallback,
                    producer,
                    lambda: producer.one.remote("x"),
                    via_object_store,
                )
            if nixl is not None and not skip(nixl, rdt_nixl_missing()):
                make = producer.one.options(tensor_transport="nixl").remote
                measure(nixl, producer, lambda: make("x"), ray_get)
    ctx.release()
    return rows


def via_object_store(ref: Any) -> Any:
    """RDT's fallback: ``ray.get`` through the object store."""
    return ray.get(ref, timeout=TRANSFER_TIMEOUT_S, _use_object_store=True)  # type: ignore[call-overload]


def rdt_driver_refusal(producer: Any) -> str | None:
    """Try ``ray.get`` of an RDT Gloo object in the driver: None if it worked,
    else the error (Ray 2.60 refuses two-sided transports there)."""
    ref = producer.one.remote("x")
    try:
        ray.get(ref, timeout=TRANSFER_TIMEOUT_S)
    except Exception as exc:
        return describe_error(exc)
    finally:
        del ref
    return None
