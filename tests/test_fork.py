"""A process forked from one that used raydirect starts clean: its own identity,
no parent's objects, pools that run; and where the parent was connected to Ray
(which cannot work in a forked child) every read fails at once, saying why."""

from __future__ import annotations

import faulthandler
import json
import os
import select
import signal
import tempfile
import time

import ray

import raydirect as rd
from raydirect import _consumer, _process

from actors import Producer


def _in_child(work) -> dict:
    """Run ``work()`` in a forked child; its JSON-able result. A child that hangs
    writes where its threads stand (faulthandler) into a file the parent reads."""
    read, write = os.pipe()
    with tempfile.TemporaryFile() as stacks:
        pid = os.fork()
        if pid == 0:  # the child: report, then leave without running the parent's exit hooks
            faulthandler.dump_traceback_later(50, file=stacks)
            try:
                result = work()
            except BaseException as exc:
                result = {"crashed": f"{type(exc).__name__}: {exc}"}
            os.write(write, json.dumps(result).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            ready, _, _ = select.select([pipe], [], [], 60)
            if not ready:  # what used to happen: the child hung in its read
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                stacks.seek(0)
                where = stacks.read().decode(errors="replace")
                raise AssertionError(f"the forked child hung; its threads after 50 s:\n{where}")
            data = pipe.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def test_a_forked_child_starts_clean_and_refuses_reads_at_once(ray_session):
    producer = Producer.remote()
    ref = producer.keep.remote("fork", 100_000)  # 400 KB: a direct object
    assert rd.get(ref, timeout=30).numel() == 100_000  # the parent's pools are started
    mine = rd.put(ray.get(producer.keep.remote("fork2", 100_000)))  # an object held here
    assert rd.local_stats().num_objects >= 1
    parent = {"pid": os.getpid(), "token": _process.PROCESS_TOKEN.hex()}

    def work() -> dict:
        started = time.monotonic()
        try:
            rd.get(ref, timeout=5)
            refused = "no error"
        except rd.RaydirectError as exc:
            refused = str(exc)
        return {
            "seconds": time.monotonic() - started,
            "refused": refused,
            "pid": _process.PID,
            "token": _process.PROCESS_TOKEN.hex(),
            "objects": rd.local_stats().num_objects,
            "pool": _consumer.fetch_pool().submit(lambda: 7).result(timeout=5),
        }

    child = _in_child(work)
    assert "crashed" not in child, child
    assert child["pid"] != parent["pid"] and child["token"] != parent["token"]
    assert f"forked from pid {parent['pid']}" in child["refused"] and "spawn" in child["refused"]
    assert child["seconds"] < 2.0
    assert child["objects"] == 0  # the parent's objects are the parent's
    assert child["pool"] == 7  # not a pool whose threads stayed in the parent
    assert rd.get(ref, timeout=30).numel() == 100_000  # the parent is unaffected
    assert rd.get(mine, timeout=30).numel() == 100_000
    ray.kill(producer)
