"""A region's owner killed in the middle of a large read (issue 40): the reader
gets ``rd.ProducerLostError`` naming the region, within a bound, and nothing is
left behind in it (descriptors, shared-memory segments).

As in test_process_loss, the fault lands mid-read deterministically: the driver
watches a process's resident memory grow as the read's bytes land, freezes it
(SIGSTOP), checks that the read is unfinished, kills the owner, and lets it go
on. Over ``cma`` and ``tcp`` the bytes land in the reader's (untouched)
destination, so the reader is watched; over ``shm`` the owner's agent first
copies the rows into a segment of the reader's, faulting its pages in the
owner, so the owner is watched (and killed while frozen).
"""

from __future__ import annotations

import time

import pytest
import ray
from probes import (
    DETECT_BOUND_S,
    RegionOwner,
    RegionReader,
    fd_baseline,
    fd_targets,
    fds_back,
    kill,
    rss,
    segments_of,
    settle,
    shm_back,
    stopped,
    wait_for_bytes,
)

MIB = 1 << 20
BIG = 1 << 30
STEP = 128 * MIB  # each new attempt reads a larger region: a segment of a new size class
STARTED = 96 * MIB
ATTEMPTS = 4


def steady_fds(pid: int, quiet_s: float = 2.0, timeout: float = 60.0) -> None:
    """Poll until ``pid``'s open fds stop changing for ``quiet_s`` (a fresh worker
    still opens what it makes once, Ray's metrics export among them)."""
    deadline = time.monotonic() + timeout
    last, since = fd_targets(pid), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, f"pid {pid}'s open fds kept changing"
        time.sleep(0.05)
        now = fd_targets(pid)
        if now != last:
            last, since = now, time.monotonic()


def report(case: str, seconds: float) -> None:
    print(f"FAULT {case} {seconds:.3f}")


def _frozen_mid_read(owner, reader, watched: int, transport: str):
    """Start reading a region of 1 GiB or more and freeze ``watched`` (the reader
    or the owner) mid-read. Returns the pending read and the freeze."""
    for attempt in range(ATTEMPTS):
        size = BIG + attempt * STEP
        handle = ray.get(owner.export.remote(size, 7))
        base = rss(watched)
        pending = reader.read.remote(handle, transport, 300)
        assert wait_for_bytes(watched, base, STARTED), "the read never started"
        stop = stopped(watched)
        stop.__enter__()
        if rss(watched) - base < size - 2 * STARTED:  # well short of the end: mid-read
            return pending, stop
        stop.__exit__(None, None, None)
        assert ray.get(pending, timeout=300)["ok"]
    raise AssertionError(f"the read outran the freeze {ATTEMPTS} times: no fault landed in it")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["cma", "shm", "tcp"])
def test_region_owner_killed_during_a_large_read(ray_session, transport):
    owner, reader = RegionOwner.remote(), RegionReader.remote()
    try:
        o_pid, r_pid = ray.get([owner.pid.remote(), reader.pid.remote()])
        small = ray.get(owner.export.remote(MIB, 1))
        assert ray.get(reader.warm.remote(small, transport))  # what is made once exists
        steady_fds(r_pid)
        baseline = fd_baseline(r_pid)
        shm_before = segments_of(r_pid)

        watched = o_pid if transport == "shm" else r_pid
        pending, stop = _frozen_mid_read(owner, reader, watched, transport)
        try:
            t0 = kill(o_pid)
        finally:
            stop.__exit__(None, None, None)
        result = ray.get(pending, timeout=300)
        seconds = time.monotonic() - t0
        report(f"region_owner_killed_during_{transport}", seconds)

        assert not result["ok"] and result["type"] == "ProducerLostError", result
        assert "region 'big'" in result["message"], result
        assert seconds < DETECT_BOUND_S
        settle(fds_back(baseline))
        settle(shm_back(shm_before, o_pid, r_pid))
    finally:
        ray.kill(reader)
        ray.kill(owner)
