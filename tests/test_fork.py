"""A process forked from one that used raydirect starts clean: its own identity,
no parent's objects, pools that run; and where the parent was connected to Ray
(which cannot work in a forked child) every read fails at once, saying why."""

from __future__ import annotations

import faulthandler
import importlib
import json
import os
import pkgutil
import select
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import ray

import raydirect as rd
import raydirect.transports
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
                where = stacks.read().decode(errors="replace") or (
                    "none written: it hung before its first line, in a fork handler"
                )
                raise AssertionError(f"the forked child hung; its threads after 50 s:\n{where}")
            data = pipe.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def _refused_read(ref: ray.ObjectRef) -> dict:
    """In the child: a read (refused), then what the child holds and runs."""
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


def test_a_forked_child_starts_clean_and_refuses_reads_at_once(ray_session):
    producer = Producer.remote()
    ref = producer.keep.remote("fork", 100_000)  # 400 KB: a direct object
    assert rd.get(ref, timeout=30).numel() == 100_000  # the parent's pools are started
    mine = rd.put(ray.get(producer.keep.remote("fork2", 100_000)))  # an object held here
    assert rd.local_stats().num_objects >= 1
    parent = {"pid": os.getpid(), "token": _process.PROCESS_TOKEN.hex()}

    child = _in_child(lambda: _refused_read(ref))
    assert "crashed" not in child, child
    assert child["pid"] != parent["pid"] and child["token"] != parent["token"]
    assert f"forked from pid {parent['pid']}" in child["refused"] and "spawn" in child["refused"]
    assert child["seconds"] < 2.0
    assert child["objects"] == 0  # the parent's objects are the parent's
    assert child["pool"] == 7  # not a pool whose threads stayed in the parent
    assert rd.get(ref, timeout=30).numel() == 100_000  # the parent is unaffected
    assert rd.get(mine, timeout=30).numel() == 100_000
    ray.kill(producer)


_LOCKS = (type(threading.Lock()), type(threading.RLock()))


def _raydirect_locks() -> dict[str, object]:
    """Every lock raydirect keeps for the process: module globals, and the
    attributes of its module-level objects (the store, the stream pool, ...)."""
    for package in (rd, raydirect.transports):  # the vLLM package lives in vLLM's processes
        for module in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            if not module.ispkg:
                importlib.import_module(module.name)
    found: dict[str, object] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("raydirect") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            places = [(attr, value)]
            if type(value).__module__.startswith("raydirect") and hasattr(value, "__dict__"):
                places += [(f"{attr}.{k}", v) for k, v in vars(value).items()]
            for where, lock in places:
                if isinstance(lock, threading.Condition):
                    lock = lock._lock  # type: ignore[attr-defined]  # may be another's lock
                if isinstance(lock, _LOCKS) and all(lock is not f for f in found.values()):
                    found[f"{name}.{where}"] = lock
    return found


@contextmanager
def _held_by_another_thread(locks: dict[str, object]) -> Iterator[None]:
    held, done, busy = threading.Event(), threading.Event(), []

    def hold() -> None:
        taken = []
        for where, lock in locks.items():
            if lock.acquire(timeout=5):  # type: ignore[attr-defined]
                taken.append(lock)
            else:
                busy.append(where)
        held.set()
        done.wait()
        for lock in taken:
            lock.release()  # type: ignore[attr-defined]

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    held.wait()
    try:
        assert not busy, f"could not take {busy}"
        yield
    finally:
        done.set()
        thread.join()


def test_a_child_forked_while_other_threads_hold_raydirects_locks_does_not_wait_for_them(
    ray_session,
):
    """A lock another thread holds at the fork stays held in the child for ever:
    nothing raydirect does there (its fork handlers, a refused read, its stats,
    its pools) may wait for one. The stream client's fork handler took its pool's
    lock, so a fork during a ``tcp`` read from another thread hung the child."""
    locks = _raydirect_locks()
    assert "raydirect._stream_client._pool._lock" in locks and len(locks) > 30, sorted(locks)
    ref = ray.put(0)
    with _held_by_another_thread(locks):
        child = _in_child(lambda: _refused_read(ref))
    assert "crashed" not in child, child
    assert "forked from pid" in child["refused"]
    assert child["pool"] == 7
