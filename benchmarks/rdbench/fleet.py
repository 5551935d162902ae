"""The actors the workloads share, started together in the one Ray session, and
the helpers that mark rows failed or skipped."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

import raydirect as rd
from raydirect._tls import ENCRYPT_ENV, RECORDS_ENV
from rdbench.actors import Consumer, Producer, RdtConsumer, RdtProducer
from rdbench.common import (
    GROUP_NIXL,
    GROUP_RAY,
    GROUP_RAYDIRECT,
    GROUP_RDT,
    SETUP_TIMEOUT_S,
    Layout,
    Row,
    describe_error,
    log,
    seeds,
)

RAYDIRECT_GROUP = "bench-raydirect"
PRODUCERS_W4 = 4  # workload 4 reads from this many producers


@dataclass
class Config:
    """What to run (from the command line)."""

    workloads: list[int]
    groups: list[str]
    sizes: list[int]  # workload 1
    repeats: Callable[[int], int]  # timed repeats after the cold one, by bytes moved
    state_bytes: int  # workload 2
    consumers: list[int]  # workload 2
    sync_steps: int  # workload 2: timed syncs after the cold one
    round_trips: int  # workload 3
    part_bytes: int  # workload 4, per ref
    driver_bytes: int  # workload 5
    medium_sizes: list[int] = field(default_factory=list)  # workload 8
    medium_rounds: int = 40  # workloads 8 and 10: interleaved rounds after the cold one
    quick: bool = False  # workload 9: a small model instead of ~320 MiB
    kv_rounds: int = 10  # workload 11: interleaved rounds after the cold one
    plan_workers: int = 128  # workload 12: workers whose plans are summed
    lease_blocks: int = 8  # workload 13: blocks per system
    timeline_sizes: list[int] = field(default_factory=list)  # workload 14: transfers
    timeline_tensors: list[int] = field(default_factory=list)  # workload 14: state dicts
    node_sizes: list[int] = field(default_factory=list)  # workload 15

    def wants(self, group: str) -> bool:
        return group in self.groups


def raydirect_nixl_missing() -> str | None:
    """Why raydirect's ``nixl`` transport cannot run here, or None."""
    from raydirect.transports import nixl_agent

    return None if nixl_agent.available() else f"NIXL not installed: {nixl_agent.INSTALL_HINT}"


def rdt_nixl_missing() -> str | None:
    """Why Ray's RDT over NIXL cannot run here, or None: Ray imports ``nixl._api``."""
    if importlib.util.find_spec("nixl") is None:
        return (
            "Ray's RDT nixl needs the `nixl` python package (it imports nixl._api), "
            "not installed: pip install nixl"
        )
    return None


@dataclass
class Context:
    """The configuration, the run's seeds, and the actors shared by the workloads:
    all started at once by ``start`` in the one Ray session, killed by ``close``."""

    config: Config
    seed_iter: Iterator[int] = field(default_factory=seeds)
    _producers: list[Any] = field(default_factory=list)
    _consumers: list[Any] = field(default_factory=list)
    _rdt_actors: list[Any] = field(default_factory=list)  # producer, then consumers
    _encrypted: dict[str, Any] = field(default_factory=dict)  # RAYDIRECT_ENCRYPT=1, by records
    _rdt_group: Any = None
    _rd_group: bool = False

    def start(self) -> None:
        """Start every actor the chosen workloads need at once: each takes seconds
        to import torch, and in parallel those seconds overlap."""
        cfg = self.config
        consumers = max(cfg.consumers) if set(cfg.workloads) & {2, 6} else 1
        rdt_workloads = {1, 2, 3, 5, 6, 8}
        if (cfg.wants(GROUP_RDT) or cfg.wants(GROUP_NIXL)) and set(cfg.workloads) & rdt_workloads:
            log(f"starting RDT's producer and {consumers} consumer(s)")
            self._rdt_actors = [RdtProducer.remote()]
            self._rdt_actors += [RdtConsumer.remote() for _ in range(consumers)]
        # These start their own processes, or none (12: the planner alone).
        shared = set(cfg.workloads) - {7, 9, 10, 11, 12, 14, 15, 16, 17}
        if shared and (cfg.wants(GROUP_RAYDIRECT) or cfg.wants(GROUP_RAY) or cfg.wants(GROUP_NIXL)):
            producers = PRODUCERS_W4 if 4 in cfg.workloads else 1
            self.producers(producers, wait=False)
            self.consumers(consumers, wait=False)
        actors = [*self._producers, *self._consumers, *self._rdt_actors]
        ray.get([a.__ray_ready__.remote() for a in actors], timeout=SETUP_TIMEOUT_S)

    def _grow(self, actors: list[Any], cls: Any, n: int, what: str, wait: bool) -> list[Any]:
        if len(actors) < n:
            log(f"starting {n - len(actors)} {what}")
            new = [cls.remote() for _ in range(n - len(actors))]
            actors += new
            if wait:
                ray.get([a.__ray_ready__.remote() for a in new], timeout=SETUP_TIMEOUT_S)
        return actors[:n]

    def producers(self, n: int, wait: bool = True) -> list[Any]:
        """raydirect + plain-Ray producers (``actors.Producer``)."""
        return self._grow(self._producers, Producer, n, "producer(s)", wait)

    def consumers(self, n: int, wait: bool = True) -> list[Any]:
        return self._grow(self._consumers, Consumer, n, "consumer(s)", wait)

    def encrypted_producer(self, records: str = "frames") -> Any:
        """A producer whose agent encrypts its stream port (``RAYDIRECT_ENCRYPT=1``:
        TLS 1.3 with a certificate it makes, then ``records``, the record layer of
        ``RAYDIRECT_TLS_RECORDS``; the consumer needs nothing)."""
        if records not in self._encrypted:
            log(f"starting an encrypting producer (RAYDIRECT_ENCRYPT=1, {records})")
            env = {"env_vars": {ENCRYPT_ENV: "1", RECORDS_ENV: records}}
            producer = Producer.options(runtime_env=env).remote()
            ray.get(producer.__ray_ready__.remote(), timeout=SETUP_TIMEOUT_S)
            self._encrypted[records] = producer
        return self._encrypted[records]

    def raydirect_pair(self) -> tuple[Any, Any]:
        """Producer 0 and consumer 0, in one raydirect Gloo group (for ``gloo``)."""
        producer, consumer = self.producers(1)[0], self.consumers(1)[0]
        if not self._rd_group:
            rd.create_collective_group([producer, consumer], backend="gloo", name=RAYDIRECT_GROUP)
            self._rd_group = True
        return producer, consumer

    def rdt(self) -> tuple[Any, list[Any]]:
        """RDT's producer and consumers, all in one Ray collective group (torch_gloo):
        as many consumers as weight sync needs, or one."""
        if not self._rdt_actors:
            raise RuntimeError("RDT actors were not started (Context.start)")
        if self._rdt_group is None:
            from ray.experimental.collective import create_collective_group

            log(f"RDT: creating the collective group of {len(self._rdt_actors)} actors")
            ray.get([a.__ray_ready__.remote() for a in self._rdt_actors], timeout=SETUP_TIMEOUT_S)
            self._rdt_group = create_collective_group(self._rdt_actors, backend="torch_gloo")
        return self._rdt_actors[0], self._rdt_actors[1:]

    def release(self) -> None:
        """Drop every producer's tensors (between workloads)."""
        producers = [
            *self._producers,
            *self._rdt_actors[:1],
            *self._encrypted.values(),
        ]
        try:
            ray.get([p.release.remote() for p in producers], timeout=SETUP_TIMEOUT_S)
        except Exception as exc:
            log(f"releasing producers' tensors failed: {describe_error(exc)}")

    def close(self) -> None:
        if self._producers:
            try:
                log(f"raydirect producer 0 stats: {ray.get(self._producers[0].stats.remote())}")
            except Exception as exc:
                log(f"raydirect stats unavailable: {describe_error(exc)}")
        if self._rd_group:
            rd.destroy_collective_group(RAYDIRECT_GROUP)
        if self._rdt_group is not None:
            from ray.experimental.collective import destroy_collective_group

            try:
                destroy_collective_group(self._rdt_group)
            except Exception as exc:  # e.g. RDT already tore it down after a failure
                log(f"RDT: destroy_collective_group: {describe_error(exc)}")
        for actor in [
            *self._producers,
            *self._consumers,
            *self._rdt_actors,
            *self._encrypted.values(),
        ]:
            ray.kill(actor)


def rdt_ready(ctx: Context, rows: Sequence[Row]) -> tuple[Any, list[Any]] | None:
    """RDT's actors, or None after marking ``rows`` failed with the reason."""
    try:
        return ctx.rdt()
    except Exception as exc:
        _fail(rows, f"RDT setup failed: {describe_error(exc)}")
        return None


def allocate(producers: Sequence[Any], layout: Layout, rows: Sequence[Row]) -> bool:
    try:
        ray.get([p.allocate.remote(layout) for p in producers], timeout=SETUP_TIMEOUT_S)
        return True
    except Exception as exc:
        _fail(rows, f"producer setup failed: {describe_error(exc)}")
        return False


def _fail(rows: Sequence[Row], reason: str) -> None:
    """Mark every row of a family failed, once, with the setup step's reason."""
    log(reason)
    for row in rows:
        row.error = reason


def skip(row: Row, reason: str | None) -> bool:
    if reason:
        row.skipped = reason
        log(f"w{row.workload} {row.system} @ {row.param}: skipped: {reason}")
    return bool(reason)
