"""Read notices (issue 32, item 6): a one-sided read's count reaches its producer
off the reader's path, and is never lost while the producer lives: not when
thousands of objects were freed before it arrived, not when the producer's
agent was too busy to take it. ``raydirect.testing.wait_read_counts`` waits for
them."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import ray
import torch

from raydirect import _admission, _channel, _process, _producer, _runtime
from raydirect._notices import notices
from raydirect._store import store
from raydirect.testing import wait_read_counts

import actors
from helpers import thread_cpu_s, wait_for

NBYTES = 200_000


def _sent() -> tuple[int, int]:
    now = store.stats()
    return now.objects_sent.get("cma", 0), now.bytes_sent.get("cma", 0)


def _report(payload, capability: bytes, nbytes: int = NBYTES) -> None:
    """What a consumer's read posts (here the driver reads its own agent's object)."""
    read = [payload.obj_id.hex(), capability.hex(), "cma", nbytes, payload.nbytes]
    notices.post(payload.producer.agent_address, _process.PID, _process.START_TIME, read)


def test_a_read_reported_after_thousands_of_frees_counts(ray_session):
    # The store remembered the last 1,024 freed objects: a read reported after
    # more frees than that was dropped. A capability now vouches for its object
    # (a keyed hash of its id and size), however long ago it was freed.
    payload = _producer.export([torch.ones(NBYTES // 4)], "cma", inline=False)
    store.free(payload.obj_id)  # what Ray's free does, here ahead of the report
    for _ in range(1100):
        other = _producer.export([torch.ones(4)], "cma", inline=False)
        store.free(other.obj_id)
    before = _sent()
    _report(payload, b"\0" * 16)  # not its capability: never counts
    _report(payload, payload.capability, nbytes=NBYTES // 2)  # a ranged read: its own bytes
    _report(payload, payload.capability, nbytes=10 * NBYTES)  # never more than the object
    assert wait_read_counts(timeout=30)
    got = _sent()
    assert (got[0] - before[0], got[1] - before[1]) == (2, NBYTES // 2 + NBYTES)


def test_a_busy_agent_gets_the_notice_again(ray_session, monkeypatch):
    # Admission refused the notice as busy and it was dropped; now the notice
    # thread sends it again (with a growing pause) until it is counted.
    payload = _producer.export([torch.ones(NBYTES // 4)], "cma", inline=False)
    before = _sent()
    with monkeypatch.context() as busy:
        busy.setattr(_admission, "PEER_IN_FLIGHT", 0)  # every request refused: busy
        _report(payload, payload.capability)
        assert not wait_read_counts(timeout=0.5)
        assert _sent() == before
    assert wait_read_counts(timeout=30)
    got = _sent()
    assert (got[0] - before[0], got[1] - before[1]) == (1, NBYTES)
    store.free(payload.obj_id)


def test_counts_settle_for_a_reader_that_waits(ray_session):
    p, c = actors.Producer.remote(), actors.Consumer.remote()
    try:
        refs = [p.big.remote(1 << 20, 3) for _ in range(3)]  # cma: one-sided
        before = ray.get(p.stats.remote())
        assert ray.get(c.read_counted.remote(refs)) is True
        after = ray.get(p.stats.remote())  # no polling: settled before the call returned
        sent = after.objects_sent.get("cma", 0) - before.objects_sent.get("cma", 0)
        nbytes = after.bytes_sent.get("cma", 0) - before.bytes_sent.get("cma", 0)
        assert (sent, nbytes) == (3, 3 << 20)
    finally:
        ray.kill(p)
        ray.kill(c)


def test_reads_back_to_back_are_reported_in_one_message(ray_session):
    # The notice thread waits for reads to pause (2 ms, at most 20 ms) before it
    # sends: sent while the reader still worked, a notice cost it 0.3-0.4 ms of
    # the GIL per medium transfer here. A burst of reads is one message.
    payload = _producer.export([torch.ones(NBYTES // 4)], "cma", inline=False)
    server = _runtime.agent()
    before, admitted = _sent(), server.admission.admitted
    for _ in range(100):
        _report(payload, payload.capability)
    assert wait_read_counts(timeout=30)
    got = _sent()
    assert (got[0] - before[0], got[1] - before[1]) == (100, 100 * NBYTES)
    assert server.admission.admitted - admitted <= 2  # one batch (two if the machine paused)
    store.free(payload.obj_id)


def test_the_notice_thread_waits_without_spinning_while_reads_come(ray_session):
    # Reads a millisecond apart never pause for 2 ms: the thread waits out each
    # 20 ms window, then sends. It once computed a wait of 0 while reads of a
    # producer never refused were queued, and spun through the window: 0.2 ms
    # of CPU per 1 MiB transfer, and the reader's GIL.
    payload = _producer.export([torch.ones(NBYTES // 4)], "cma", inline=False)
    before = _sent()
    _report(payload, payload.capability)
    assert wait_read_counts(timeout=30)  # the thread is up
    thread = next(t for t in threading.enumerate() if t.name == "raydirect-notices")
    cpu, start = thread_cpu_s(os.getpid(), thread.native_id), time.monotonic()
    posted = 0
    while time.monotonic() - start < 1.0:
        _report(payload, payload.capability)
        posted += 1
        time.sleep(0.001)  # paces the reads; nothing waits on it
    used = thread_cpu_s(os.getpid(), thread.native_id) - cpu
    assert wait_read_counts(timeout=30)
    assert _sent()[0] - before[0] == posted + 1
    assert used < 0.25, f"the notice thread used {used:.2f} s of CPU in 1 s of reads"
    store.free(payload.obj_id)


def test_the_notice_thread_closes_its_channels_outside_its_lock(ray_session, monkeypatch):
    # Idle, the thread closes its channels to producers, which lets the GIL go.
    # It did so holding the lock every read's post takes: a read posting then
    # waited, and beside a thread running Python lost the GIL for a switch interval.
    held: list[bool] = []
    close = _channel.close_cached

    def watched_close() -> None:
        held.append(notices._cond._is_owned())  # type: ignore[attr-defined]
        close()

    monkeypatch.setattr(_channel, "close_cached", watched_close)
    payload = _producer.export([torch.ones(NBYTES // 4)], "cma", inline=False)
    _report(payload, payload.capability)
    assert wait_read_counts(timeout=30)
    wait_for(lambda: held, timeout=30, what="the idle notice thread closing its channels")
    assert held and not any(held), held
    store.free(payload.obj_id)


_READ_AND_EXIT = """
import sys, ray, raydirect as rd
from raydirect import _notices
_notices._QUIET_S = _notices._LINGER_S = 60.0  # the notice would wait well past the exit
ray.init(address=sys.argv[1], namespace="notices", logging_level="error")
p = ray.get_actor("notices-producer")
assert rd.get(p.big.remote(1 << 20, 3), timeout=60).numel() == 1 << 20
"""  # returns at once: its read's notice is still waiting when the process exits


def test_an_exiting_reader_reports_its_reads_first(ray_session, tmp_path):
    # A notice waits for reads to pause before it is sent; a process that exits
    # right after its read waits (up to 0.5 s) until its notices are counted.
    p = actors.Producer.options(name="notices-producer", namespace="notices").remote()
    try:
        before = ray.get(p.stats.remote()).objects_sent.get("cma", 0)
        script = tmp_path / "read_and_exit.py"
        script.write_text(_READ_AND_EXIT)
        address = ray.get_runtime_context().gcs_address
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
        done = subprocess.run(
            [sys.executable, str(script), address], capture_output=True, text=True,
            timeout=120, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        after = ray.get(p.stats.remote()).objects_sent.get("cma", 0)  # no polling
        assert after - before == 1
    finally:
        ray.kill(p)
