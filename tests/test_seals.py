"""Seals in shared memory (``_region_seals``) between real processes: a reader
sees the producer take, release and reuse a seal with no system call of its own,
the slab files go with their process (at exit, or swept once it was killed),
a forked child's exit leaves its parent's, and a slot no seal can have is refused.
How reads use seals: test_caller_leases.py, test_regions.py, test_lifetime.py
(cma) and test_cuda_ipc.py (cuda_ipc, on the CPU)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from raydirect import _process, _region_seals
from raydirect._payload import ProducerInfo
from raydirect._region_seals import Seal, Seals, seal_value, seals, slab_path
from raydirect.errors import ProducerLostError, TransferError, TransportUnavailableError
from raydirect.transports.base import PeerMetadata, ReadSeal
from raydirect.transports.nixl import _seal_of as nixl_seal_of
from raydirect.transports.shm import sweep_dead_segments

# A producer process: takes and releases seals as told on stdin, one command a line.
_PRODUCER = textwrap.dedent(
    """
    import os, sys
    from raydirect import _process, _region_seals
    from raydirect._region_seals import seals
    print(os.getpid(), _process.START_TIME, flush=True)
    for line in sys.stdin:
        op, *args = line.split()
        if op == "take":
            print(seals.take(int(args[0])), flush=True)
        elif op == "release":
            seals.release(int(args[0]))
            print("ok", flush=True)
        elif op == "fork":  # a child takes a seal of its own, then exits as Python does
            pid = os.fork()
            if pid == 0:
                slot = seals.take(5)
                mine = os.path.exists(
                    f"/dev/shm/rd-{os.getpid()}-{_process.START_TIME}-seals-0"
                )
                sys.exit(0 if mine and slot == 0 else 3)
            print(os.waitpid(pid, 0)[1], flush=True)
    """
)


class _Producer:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PRODUCER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        pid, start = self._line().split()
        self.pid, self.start_time = int(pid), int(start)

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the producer process exited ({self.proc.poll()})"
        return line.strip()

    def ask(self, *words: object) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()
        return self._line()

    def seal(self, slot: int, want: int) -> Seal:
        return Seal(slot, self.pid, self.start_time, want)

    def slab(self, n: int = 0) -> str:
        return slab_path(self.pid, self.start_time, n)


@pytest.fixture
def producer():
    p = _Producer()
    yield p
    p.proc.kill()
    p.proc.wait()
    sweep_dead_segments(p.pid)


def test_a_reader_sees_the_producers_seal_taken_released_and_reused(producer):
    slot = int(producer.ask("take", 1234))
    seal = producer.seal(slot, 1234)
    assert seal.holds()
    assert not producer.seal(slot, 999).holds()  # another object's id or capability
    assert producer.ask("release", slot) == "ok"
    assert not seal.holds()  # freed: zero
    assert int(producer.ask("take", 4321)) == slot  # the slot goes to the next object
    assert not seal.holds() and producer.seal(slot, 4321).holds()


def test_a_seal_in_a_slab_the_producer_never_made_does_not_hold(producer):
    producer.ask("take", 7)
    assert not producer.seal(8192 * 3, 7).holds()  # its slab 3: no such file
    assert not Seal(0, producer.pid, producer.start_time + 1, 7).holds()  # another process


def _own_link() -> PeerMetadata:
    """A read's link to an object of this very process, "P.v"."""
    me = ProducerInfo("tcp://127.0.0.1:1", "node", os.getpid(), _process.START_TIME, b"t", "P.v")
    return PeerMetadata(me, b"cap", same_node=True)


@pytest.mark.parametrize("slot", ["0", -1, True, 1.0, 1 << 40, None])
def test_a_slot_no_seal_can_have_is_refused(slot):
    with pytest.raises(ValueError, match="slot"):
        Seal(slot, os.getpid(), _process.START_TIME, 1)


def test_a_read_whose_metadata_names_a_bad_slot_fails_saying_so():
    link = _own_link()
    with pytest.raises(TransferError, match="corrupt transport metadata from P.v"):
        ReadSeal(b"obj", {"seal": "0"}, link)
    assert ReadSeal.of(b"obj", {}, link) is None  # no seal named: nothing to check


@pytest.mark.parametrize(
    "seal_at",
    [None, [1], [1, 2, 3], ["1", 7], [0, 7], [-8, 7], [True, 7], [4096, 8], "4096,7"],
)
def test_a_nixl_read_whose_metadata_places_the_seal_badly_fails_saying_so(seal_at):
    """``nixl`` READs the seal where the metadata says: a word in a registration
    the metadata carries (here serial 7), nothing else, checked before any READ."""
    extra = {"regions": {"7": [4096, 65536, "section"]}, "seal_at": seal_at}
    with pytest.raises(TransferError, match="corrupt transport metadata from P.v"):
        nixl_seal_of(b"obj", extra, _own_link())
    assert nixl_seal_of(b"obj", {**extra, "seal_at": [4096, 7]}, _own_link()) == (
        (4096, 8, 0),
        seal_value(b"obj", b"cap"),
    )


def test_a_failed_check_says_what_the_producer_did():
    link = _own_link()
    slot = seals.take(seal_value(b"obj", b"cap"))
    try:
        cases = {
            "freed the object: Ray counted no ref": {},
            r"its lifetime \(rd.method\(reads=1\)\) ended": {"lifetime": "reads=1"},
            "holds no such region": {"region": True},
        }
        for said, extra in cases.items():
            check = ReadSeal(b"obj", {"seal": slot, **extra}, link)
            check.check()  # it holds
            ReadSeal(b"other", {"seal": slot}, link)  # made, not checked: no error yet
            with pytest.raises(ProducerLostError, match="P.v"):
                ReadSeal(b"other", {"seal": slot}, link).check()
            seals.release(slot)
            with pytest.raises(ProducerLostError, match=said):
                check.check()
            slot = seals.take(seal_value(b"obj", b"cap"))
    finally:
        seals.release(slot)


def test_slabs_are_unlinked_at_exit(producer):
    producer.ask("take", 1)
    slab = producer.slab()
    assert os.path.exists(slab)
    assert producer.proc.stdin is not None
    producer.proc.stdin.close()  # its loop ends: the process exits as Python does
    assert producer.proc.wait(timeout=30) == 0
    assert not os.path.exists(slab)


def test_a_killed_processs_slabs_are_swept(producer):
    for _ in range(8193):  # two slabs
        producer.ask("take", 1)
    slabs = [producer.slab(0), producer.slab(1)]
    assert all(os.path.exists(s) for s in slabs)
    os.kill(producer.pid, signal.SIGKILL)
    producer.proc.wait()  # reaped: not running, for the sweep
    assert sweep_dead_segments(producer.pid) == 2
    assert not any(map(os.path.exists, slabs))


def test_a_forked_childs_seals_are_its_own_and_its_exit_leaves_its_parents(producer):
    slot = int(producer.ask("take", 77))
    assert producer.ask("fork") == "0"  # the child's seal was in a slab of its own
    assert os.path.exists(producer.slab())  # the child's exit hooks left it
    assert producer.seal(slot, 77).holds()


def test_a_process_without_a_writable_dev_shm_is_told_so(monkeypatch, tmp_path):
    missing = tmp_path / "no-shm"
    monkeypatch.setattr(_region_seals, "SHM_DIR", str(missing))
    with pytest.raises(OSError, match=f"could not make {missing}/rd-.* there: .* Give"):
        Seals().take(1)
    assert not missing.exists()


def test_a_reader_that_cannot_see_a_live_producers_seals_is_told_why_and_what_to_do():
    """As where the two processes do not share /dev/shm: ``auto`` then reads elsewhere."""
    with pytest.raises(TransportUnavailableError, match=r"cannot see the seals of P.v .*'tcp'"):
        ReadSeal(b"obj", {"seal": 8192 * 5}, _own_link())  # a slab this process never made


def test_a_reader_of_an_exited_producers_seal_is_told_it_exited(producer):
    slot = int(producer.ask("take", 1))
    me = ProducerInfo("tcp://127.0.0.1:1", "node", producer.pid, producer.start_time, b"t", "P.v")
    link = PeerMetadata(me, b"cap", same_node=True)
    assert producer.proc.stdin is not None
    producer.proc.stdin.close()
    assert producer.proc.wait(timeout=30) == 0  # its slabs unlinked at exit
    with pytest.raises(ProducerLostError, match="P.v .* is no longer running"):
        ReadSeal(b"obj", {"seal": slot}, link)


def test_a_regions_seal_holds_only_for_its_extent():
    """A region's seal covers its extent (``region_extent``: its addresses and
    sizes), which its reader makes from what it reads by: any other extent, or
    none, fails the check; bytes cannot move between the parts of the digest."""
    link, extent = _own_link(), _region_seals.region_extent(b"ptrs", [1024, 2048])
    slot = seals.take(seal_value(b"obj", b"cap", extent))
    try:
        ReadSeal(b"obj", {"seal": slot, "extent": extent}, link).check()  # it holds
        others = [
            b"",
            _region_seals.region_extent(b"ptrs", [1024, 4096]),
            _region_seals.region_extent(b"ptrz", [1024, 2048]),
            _region_seals.region_extent(b"ptrs", [1024]),
        ]
        for other in others:
            with pytest.raises(ProducerLostError, match="P.v"):
                ReadSeal(b"obj", {"seal": slot, "extent": other}, link).check()
        assert seal_value(b"obj", b"cap", extent) != seal_value(b"obj", b"ca", b"p" + extent)
        with pytest.raises(TransferError, match="extent"):
            ReadSeal(b"obj", {"seal": slot, "extent": "ab"}, link)
    finally:
        seals.release(slot)
