"""Long-lived regions (issue 40, part 1): ``rd.export_region`` / ``rd.read_ranges``.

Real Ray, real processes, real transports: an owner actor exports a paged KV
cache (one tensor per layer), readers in other processes read blocks of every
layer straight into their own tensors. Every value read is compared in full.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import mmap
import os
import signal
import tempfile
import threading
import time
import warnings
from typing import Any

import numpy as np
import pytest
import ray
import region_actors
import torch
from ray import cloudpickle
from region_actors import (
    BLOCK_BYTES,
    BLOCK_ELEMS,
    BLOCKS,
    LAYERS,
    FreeingOwner,
    Owner,
    RegionReader,
    expected,
    kv_rows,
    layer_value,
)
from torch.testing._internal.two_tensor import TwoTensor

import raydirect as rd
from raydirect import _region_rows
from raydirect._consumer import fetch_ranges
from raydirect._ranges import Ranges
from raydirect._region_handle import RegionHandle, encode_meta
from raydirect.transports import cma

import plugin_transports
from helpers import wait_for
from plugin_transports import PickleShmTransport, SlowStagingTransport, plugin_files

# Workers cannot import the tests directory: ship the actors by value.
cloudpickle.register_pickle_by_value(region_actors)

TRANSPORTS = ["auto", "cma", "shm", "tcp"]
BLOCKS_READ = [5, 6, 7, 40, 2, 63, 0, 31, 32, 33]  # touching runs, gaps, out of order
DEST_BLOCKS = [0, 1, 2, 3, 10, 11, 20, 21, 22, 23]


def used(transport: str) -> str:
    return "cma" if transport == "auto" else transport


def forced(transport: str) -> str | None:
    return None if transport == "auto" else transport


@pytest.fixture(scope="module")
def reader(ray_session):
    r = RegionReader.remote()
    yield r
    ray.kill(r)


@pytest.fixture
def owner(ray_session):
    o = Owner.remote()
    yield o
    ray.kill(o)


def assert_read(got: list[torch.Tensor], blocks=BLOCKS_READ, dests=DEST_BLOCKS, fill=None):
    for layer, (g, want) in enumerate(zip(got, expected(blocks, dests, fill), strict=True)):
        assert torch.equal(g, want), f"layer {layer} differs"


# ------------------------------------------------------------ the handle


def test_the_handle_is_small_json_and_keeps_its_capability_out_of_repr(owner):
    handle = ray.get(owner.handle.remote())
    text = handle.to_json()
    assert len(text) < 2048
    assert rd.RegionHandle.from_json(text) == handle
    # Inside another JSON document, as vLLM's kv_transfer_params carry it.
    carried = json.loads(json.dumps({"params": {"region": handle.to_dict()}}))
    assert rd.RegionHandle.of(carried["params"]["region"]) == handle
    assert handle.capability not in repr(handle)
    assert handle.names == tuple(f"layer{i}" for i in range(LAYERS))
    assert handle.index("layer2") == 2
    assert handle.nbytes == (BLOCKS * BLOCK_BYTES,) * LAYERS
    with pytest.raises(ValueError, match="format"):
        rd.RegionHandle.of({"v": 99})
    with pytest.raises(ValueError, match="malformed"):
        rd.RegionHandle.of({**handle.to_dict(), "nbytes": [-1, 2, 3]})


# ------------------------------------------------------------ reads


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_many_rows_read_exactly(owner, reader, transport):
    handle = ray.get(owner.handle.remote())
    before = ray.get(reader.stats.remote()).bytes_received.get(used(transport), 0)
    got = ray.get(reader.read.remote(handle, BLOCKS_READ, DEST_BLOCKS, forced(transport)))
    assert_read(got)
    after = ray.get(reader.stats.remote()).bytes_received.get(used(transport), 0)
    assert after - before == LAYERS * len(BLOCKS_READ) * BLOCK_BYTES


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_handle_as_json_reads_the_same(owner, reader, transport):
    text = ray.get(owner.handle.remote()).to_json()
    got = ray.get(reader.read.remote(text, BLOCKS_READ, DEST_BLOCKS, forced(transport)))
    assert_read(got)


def test_every_block_of_every_layer(owner, reader):
    everything = list(range(BLOCKS))
    handle = ray.get(owner.handle.remote())
    got = ray.get(reader.read.remote(handle, everything, everything[::-1]))
    assert_read(got, everything, everything[::-1])


def test_rows_that_touch_on_both_sides_merge():
    rows = kv_rows([4, 5, 6, 9, 10, 3], [0, 1, 2, 4, 5, 7])
    apart_in_memory = [i << 21 for i in range(LAYERS)]
    merged = _region_rows.checked_rows(
        rows, [BLOCKS * BLOCK_BYTES] * LAYERS, [1 << 20] * LAYERS, apart_in_memory
    )
    # Per layer: blocks 4-6 -> 0-2 (one row), 9-10 -> 4-5 (one), 3 -> 7 (one).
    assert len(merged) == 3 * LAYERS
    first = merged[merged[:, 0] == 0].tolist()
    assert first == [
        [0, 3 * BLOCK_BYTES, BLOCK_BYTES, 0, 7 * BLOCK_BYTES],
        [0, 4 * BLOCK_BYTES, 3 * BLOCK_BYTES, 0, 0],
        [0, 9 * BLOCK_BYTES, 2 * BLOCK_BYTES, 0, 4 * BLOCK_BYTES],
    ]
    # Touching in the source only (5 -> 1, 6 -> 3): not merged.
    apart = _region_rows.checked_rows(
        kv_rows([5, 6], [1, 3]), [1 << 20] * 3, [1 << 20] * 3, apart_in_memory
    )
    assert len(apart) == 2 * LAYERS
    # Empty rows are dropped.
    assert len(_region_rows.checked_rows([[0, 0, 0, 0, 0]], [8], [8], [0])) == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_owners_writes_are_seen_by_the_next_read(owner, reader, transport):
    handle = ray.get(owner.handle.remote())
    assert_read(ray.get(reader.read.remote(handle, BLOCKS_READ, DEST_BLOCKS, forced(transport))))
    ray.get(owner.fill.remote(3.0))
    got = ray.get(reader.read.remote(handle, BLOCKS_READ, DEST_BLOCKS, forced(transport)))
    assert_read(got, fill=3.0)


def test_a_read_in_the_owners_own_process(ray_session):
    kv = [layer_value(i) for i in range(LAYERS)]
    with rd.export_region(kv) as region:
        dests = [torch.zeros(BLOCKS, BLOCK_ELEMS) for _ in range(LAYERS)]
        n = rd.read_ranges(region.handle(), kv_rows(BLOCKS_READ, DEST_BLOCKS), into=dests)
        assert n == LAYERS * len(BLOCKS_READ) * BLOCK_BYTES
        assert_read(dests)
        assert rd.local_stats().num_regions >= 1
        forged = dataclasses.replace(region.handle(), capability="00" * 16)
        with pytest.raises(rd.ProducerLostError):
            rd.read_ranges(forged, kv_rows([0], [0]), into=dests)
    assert region.closed
    with pytest.raises(rd.ProducerLostError, match="region"):
        rd.read_ranges(region.handle(), kv_rows([0], [0]), into=dests)


def test_destinations_may_be_numpy_arrays_and_buffers(owner, reader, ray_session):
    handle = ray.get(owner.handle.remote())
    array = np.zeros(BLOCK_ELEMS, dtype=np.float32)
    buffer = bytearray(BLOCK_BYTES)
    rows = [[1, 7 * BLOCK_BYTES, BLOCK_BYTES, 0, 0], [2, 8 * BLOCK_BYTES, BLOCK_BYTES, 1, 0]]
    assert rd.read_ranges(handle, rows, into=[array, buffer], timeout=30) == 2 * BLOCK_BYTES
    assert np.array_equal(array, layer_value(1)[7].numpy())
    assert np.array_equal(np.frombuffer(buffer, dtype=np.float32), layer_value(2)[8].numpy())


# ------------------------------------------------------------ lifetime


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_read_after_close_is_producer_lost(owner, reader, transport):
    handle = ray.get(owner.handle.remote())
    assert_read(ray.get(reader.read.remote(handle, BLOCKS_READ, DEST_BLOCKS, forced(transport))))
    ray.get(owner.close.remote())
    ray.get(owner.close.remote())  # twice: a no-op
    error = ray.get(reader.read_error.remote(handle, forced(transport)))
    kind, untouched, message = error.split("|", 2)
    assert kind == "ProducerLostError" and "region 'kv'" in message
    assert untouched == "True"  # nothing read from memory the owner may reuse
    assert ray.get(owner.stats.remote()).num_regions == 0
    with pytest.raises(rd.ProducerLostError, match="region 'kv'"):
        ray.get(reader.notify.remote(handle, {"request": 1}))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_no_read_returns_memory_reused_after_close(owner, transport):
    """Reads race a close after which the owner writes poison into the memory at
    once: every read that returned must hold the region's bytes, never poison."""
    reader = RegionReader.remote()
    try:
        handle = ray.get(owner.handle.remote())
        outcome = reader.read_until_lost.remote(handle, forced(transport))
        wait_for(lambda: ray.get(reader.reads_done.remote()) >= 5, 60, "the reads to start")
        ray.get(owner.close_and_poison.remote())
        result = ray.get(outcome, timeout=120)
        assert result["lost"] and result["ok"] >= 5
        assert result["poisoned"] == 0
    finally:
        ray.kill(reader)


@pytest.mark.parametrize("transport", ["auto", "shm", "tcp"])
def test_a_read_after_the_owner_died_is_producer_lost(reader, transport, ray_session):
    owner = Owner.remote()
    handle = ray.get(owner.handle.remote())
    assert_read(ray.get(reader.read.remote(handle, BLOCKS_READ, DEST_BLOCKS, forced(transport))))
    pid = ray.get(owner.pid.remote())
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not _running(pid), 30, f"pid {pid} to exit")
    error = ray.get(reader.read_error.remote(handle, forced(transport), 20.0))
    assert error.startswith("ProducerLostError|True|"), error
    assert "region 'kv'" in error


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


# ------------------------------------------------------------ auth


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("forgery", ["capability", "region"])
def test_a_forged_handle_reads_nothing(owner, reader, transport, forgery):
    handle = ray.get(owner.handle.remote())
    field = {"capability": "capability", "region": "region"}[forgery]
    forged = dataclasses.replace(handle, **{field: "ab" * 16})
    error = ray.get(reader.read_error.remote(forged, forced(transport)))
    assert error.startswith("ProducerLostError|True|"), error
    with pytest.raises(rd.ProducerLostError):
        ray.get(reader.notify.remote(forged, "free"))
    assert ray.get(owner.notices.remote(0)) == []
    # The real handle still reads.
    assert_read(ray.get(reader.read.remote(handle, BLOCKS_READ, DEST_BLOCKS, forced(transport))))


def _with_cma_meta(handle: RegionHandle, edit: Any) -> RegionHandle:
    """``handle`` with its metadata re-encoded after ``edit(cma_meta)`` (in place)."""
    meta = handle.payload().transport_meta  # its cma meta carries the real extent
    edit(meta["cma"])
    encoded, frames = encode_meta(meta)
    return dataclasses.replace(handle, meta=encoded, frames=frames)


def _shift_first_address(cma_meta: dict[str, Any]) -> None:
    addresses = cma._addresses(cma_meta["ptrs"]).copy()
    addresses[0] += BLOCK_BYTES  # block 0 read from block 1's bytes, and so on
    cma_meta["ptrs"] = cma._pack_addresses(addresses)


@pytest.mark.parametrize("transport", ["auto", "cma"])
@pytest.mark.parametrize("edit", ["nbytes", "ptrs"])
def test_a_handle_with_edited_addresses_or_sizes_reads_nothing(owner, reader, transport, edit):
    # A cma read copies from the addresses and within the sizes the handle names,
    # with no agent to check them: the seal covers them, so an edit reads nothing
    # (before, a larger size read past the tensor's end, an address anywhere).
    handle = ray.get(owner.handle.remote())
    if edit == "nbytes":
        forged = dataclasses.replace(handle, nbytes=tuple(2 * n for n in handle.nbytes))
        blocks = (BLOCKS, BLOCKS + 1)  # past the tensor's real end, inside the forged size
    else:  # the forged handle keeps the real extent: the reader makes its own
        forged, blocks = _with_cma_meta(handle, _shift_first_address), (0, 1)
    error = ray.get(reader.read_error.remote(forged, forced(transport), blocks=blocks))
    assert error.startswith("ProducerLostError|True|"), error
    # The real handle still reads.
    assert_read(ray.get(reader.read.remote(handle, BLOCKS_READ, DEST_BLOCKS, forced(transport))))


@pytest.mark.parametrize("lost", ["seal", "ptrs"])
def test_a_handle_whose_cma_meta_lost_its_seal_or_addresses_is_refused(owner, reader, lost):
    # Without a seal no check would run; without addresses there is no extent.
    handle = ray.get(owner.handle.remote())
    forged = _with_cma_meta(handle, lambda cma_meta: cma_meta.pop(lost))
    with pytest.raises(ValueError, match="a malformed region handle"):
        RegionHandle.from_json(forged.to_json()).payload()
    for transport in TRANSPORTS:  # refused before a transport is chosen
        error = ray.get(reader.read_error.remote(forged.to_dict(), forced(transport)))
        assert error.startswith("ValueError|True|a malformed region handle"), error
    assert_read(ray.get(reader.read.remote(handle, BLOCKS_READ, DEST_BLOCKS)))


# ------------------------------------------------------------ notices


def test_a_notice_reaches_the_owners_callback(reader, ray_session):
    owner = Owner.remote(on_notice=True)
    try:
        handle = ray.get(owner.handle.remote())
        message = {"request_id": "req-7", "blocks": [5, 6]}
        ray.get(reader.read.remote(handle, BLOCKS_READ, DEST_BLOCKS, notify=message))
        assert ray.get(owner.wait_heard.remote(30)) == [message]
        ray.get(reader.notify.remote(handle, "done"))
        assert wait_for(lambda: len(ray.get(owner.wait_heard.remote(30))) == 2, 30)
        assert ray.get(owner.wait_heard.remote(0)) == [message, "done"]
    finally:
        ray.kill(owner)


def test_notices_wait_for_the_owner_without_polling(owner, reader):
    handle = ray.get(owner.handle.remote())
    waiting = owner.notices.remote(60)  # blocks in the owner until a notice comes
    ready, _ = ray.wait([waiting], timeout=0.2)
    assert not ready
    ray.get(reader.read.remote(handle, [1], [1], notify=["free", 1]))
    assert ray.get(waiting, timeout=60) == [["free", 1]]
    ray.get(reader.notify.remote(handle, 2))
    ray.get(reader.notify.remote(handle, 3))
    assert ray.get(owner.notices.remote(0)) == [2, 3]
    assert ray.get(owner.notices.remote(0)) == []


def test_a_notice_must_be_json(owner, ray_session):
    handle = ray.get(owner.handle.remote())
    dest = torch.zeros(BLOCK_ELEMS)
    with pytest.raises(TypeError, match="JSON"):
        rd.read_ranges(handle, kv_rows([1], [0])[:1], into=dest, notify={1, 2})
    with pytest.raises(ValueError, match="64 KiB|over"):
        rd.notify_region(handle, "x" * (70 << 10))
    assert bool((dest == 0).all())
    assert ray.get(owner.notices.remote(0)) == []


# ------------------------------------------------------------ deadlines, async


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_read_past_its_deadline_times_out(owner, transport, ray_session):
    handle = ray.get(owner.handle.remote())
    dest = torch.zeros(BLOCKS, BLOCK_ELEMS)
    rows = kv_rows([1, 2], [1, 2])[:2]
    pid = ray.get(owner.pid.remote())
    os.kill(pid, signal.SIGSTOP)  # its agent answers nobody
    try:
        with pytest.raises(rd.FetchTimeoutError, match="region 'kv'"):
            rd.read_ranges(handle, rows, into=dest, timeout=1.0, tensor_transport=transport)
    finally:
        os.kill(pid, signal.SIGCONT)
    rd.read_ranges(handle, rows, into=dest, timeout=30, tensor_transport=transport)
    assert torch.equal(dest[1:3], layer_value(0)[1:3])


def test_the_async_form_keeps_the_event_loop_running(owner, ray_session):
    handle = ray.get(owner.handle.remote())
    pid = ray.get(owner.pid.remote())

    async def main() -> tuple[int, int, str]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        dests = [torch.zeros(BLOCKS, BLOCK_ELEMS) for _ in range(LAYERS)]
        rows = kv_rows(BLOCKS_READ, DEST_BLOCKS)
        n = await rd.read_ranges_async(handle, rows, into=dests, timeout=30)
        assert_read(dests)
        os.kill(pid, signal.SIGSTOP)
        try:
            before = ticks
            await rd.read_ranges_async(
                handle, rows, into=dests, timeout=1.0, tensor_transport="tcp"
            )
        except rd.FetchTimeoutError as exc:
            outcome = type(exc).__name__
        finally:
            os.kill(pid, signal.SIGCONT)
        ticker.cancel()
        return n, ticks - before, outcome

    n, ticks, outcome = asyncio.run(main())
    assert n == LAYERS * len(BLOCKS_READ) * BLOCK_BYTES
    assert outcome == "FetchTimeoutError"
    assert ticks > 0  # other coroutines ran while the read waited


# ------------------------------------------------------------ bad input


def _read_only_mapping(nbytes: int) -> torch.Tensor:
    """A tensor over a file mapped read-only: a store into it kills the process."""
    with tempfile.TemporaryFile(dir="/dev/shm") as f:
        f.truncate(nbytes)
        mapped = mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():  # torch warns of a buffer it cannot write
        warnings.simplefilter("ignore")
        return torch.frombuffer(mapped, dtype=torch.uint8)


def _bad_cases() -> list:
    good = [1, 0, BLOCK_BYTES, 0, 0]
    end = BLOCKS * BLOCK_BYTES
    return [
        pytest.param([[3, 0, 8, 0, 0]], None, ValueError, "has 3 tensors", id="no-such-tensor"),
        pytest.param(
            [[0, end - 4, 8, 0, 0]],
            None,
            ValueError,
            "past the end of the region",
            id="past-source",
        ),
        pytest.param(
            [[0, 0, 8, 0, end]], None, ValueError, "past the end of its destination", id="past-dest"
        ),
        pytest.param([[0, -8, 8, 0, 0]], None, ValueError, "negative", id="negative"),
        pytest.param([[0, 0, 8, 1, 0]], None, ValueError, "1 destinations", id="no-such-dest"),
        pytest.param([[0, 0, 8.0, 0, 0]], None, TypeError, "whole numbers", id="floats"),
        pytest.param([[0, 0, 8, 0]], None, ValueError, "n, 5", id="four-columns"),
        pytest.param([good, [2, 0, 8, 0, 16]], None, ValueError, "same bytes", id="overlap"),
        pytest.param(
            [good], torch.zeros(4, 4).t(), ValueError, "not contiguous", id="strided-dest"
        ),
        pytest.param([good], torch.empty(end, device="meta"), ValueError, "meta", id="meta-dest"),
        pytest.param([good], "a string", TypeError, "str", id="not-a-dest"),
        pytest.param(
            [good], np.zeros(8, np.float32)[::2], ValueError, "C-contiguous", id="np-strided"
        ),
        pytest.param([good], bytes(end), TypeError, "bytes", id="read-only"),
        pytest.param(
            [good], _read_only_mapping(end), ValueError, "cannot write", id="read-only-mapping"
        ),
        # a lazily conjugated view: its bytes are not its values (it returned them conjugated)
        pytest.param(
            [good],
            torch.zeros(end // 8, dtype=torch.complex64).conj(),
            ValueError,
            "resolve_conj",
            id="conj-dest",
        ),
        pytest.param(
            [good], torch.zeros(end // 4)._neg_view(), ValueError, "resolve_neg", id="neg-dest"
        ),
        pytest.param(
            [good],
            torch.nested.nested_tensor([torch.zeros(end // 8)] * 2),
            ValueError,
            "is a nested tensor",
            id="nested-dest",
        ),
        pytest.param(
            [good], torch.zeros(end // 4).to_sparse(), ValueError, "sparse_coo", id="sparse-dest"
        ),
        # data_ptr() 0: cma's read failed "Bad address", shm's copy killed the reader (SIGSEGV)
        pytest.param(
            [good],
            TwoTensor(torch.zeros(end // 4), torch.zeros(end // 4)),
            ValueError,
            "is a TwoTensor",
            id="wrapper-dest",
        ),
    ]


def _aliased_cases() -> list:
    """Two destinations over one memory, and rows writing one byte through both."""
    one = torch.zeros(BLOCKS * BLOCK_ELEMS)
    rows = [[1, 0, BLOCK_BYTES, 0, 0], [2, 0, 8, 1, BLOCK_BYTES - 8]]
    return [
        pytest.param(rows, [one, one], id="one-tensor-twice"),
        pytest.param(
            [rows[0], [2, 0, 8, 1, 0]], [one, one[BLOCK_ELEMS - 2 :]], id="overlapping-views"
        ),
        pytest.param(rows, [one.numpy(), one], id="numpy-and-tensor"),
    ]


@pytest.mark.parametrize(("rows", "dests"), _aliased_cases())
def test_rows_writing_one_byte_through_two_destinations_are_refused(
    owner, rows, dests, ray_session
):
    """Checked by destination alone, two rows writing the same bytes through two
    destinations over one memory were read concurrently, the last to land unknown."""
    handle = ray.get(owner.handle.remote())
    received = rd.local_stats().bytes_received
    with pytest.raises(ValueError, match="rows 0 and 1 write the same bytes.*share memory"):
        rd.read_ranges(handle, rows, into=dests, timeout=30)
    assert rd.local_stats().bytes_received == received
    assert not any(torch.as_tensor(d).any() for d in dests)


def test_one_memory_given_as_two_destinations_takes_rows_that_do_not_overlap(owner, ray_session):
    handle = ray.get(owner.handle.remote())
    one = torch.zeros(2 * BLOCK_ELEMS)
    rows = [
        [1, 3 * BLOCK_BYTES, BLOCK_BYTES, 0, 0],
        [2, 5 * BLOCK_BYTES, BLOCK_BYTES, 1, BLOCK_BYTES],
    ]
    assert rd.read_ranges(handle, rows, into=[one, one], timeout=30) == 2 * BLOCK_BYTES
    assert torch.equal(one[:BLOCK_ELEMS], layer_value(1)[3])
    assert torch.equal(one[BLOCK_ELEMS:], layer_value(2)[5])


@pytest.mark.parametrize(("rows", "dest", "error", "match"), _bad_cases())
def test_bad_input_is_refused_before_a_byte_moves(owner, rows, dest, error, match, ray_session):
    handle = ray.get(owner.handle.remote())
    target = torch.zeros(BLOCKS * BLOCK_ELEMS) if dest is None else dest
    received = rd.local_stats().bytes_received
    with pytest.raises(error, match=match):
        rd.read_ranges(handle, rows, into=target, timeout=30)
    if dest is None:
        assert bool((target == 0).all())
    assert rd.local_stats().bytes_received == received


def test_a_handle_with_a_size_beyond_64_bits_is_refused_as_malformed(owner, ray_session):
    """It raised OverflowError deep in the row checks; a malformed handle is a ValueError."""
    handle = ray.get(owner.handle.remote()).to_dict()
    for size in (1 << 63, 1 << 70):
        with pytest.raises(ValueError, match="below 2\\*\\*63"):
            rd.read_ranges(
                {**handle, "nbytes": [size] * LAYERS}, [[0, 0, 4, 0, 0]], into=torch.zeros(4)
            )


def test_bad_transports_are_refused(owner, ray_session):
    handle = ray.get(owner.handle.remote())
    dest = torch.zeros(BLOCK_ELEMS)
    rows = [[0, 0, BLOCK_BYTES, 0, 0]]
    with pytest.raises(rd.UnknownTransportError):
        rd.read_ranges(handle, rows, into=dest, tensor_transport="carrier-pigeon")
    with pytest.raises(ValueError, match="one-sided"):
        rd.read_ranges(handle, rows, into=dest, tensor_transport="gloo")
    assert bool((dest == 0).all())


def test_export_refuses_what_it_cannot_expose(ray_session):
    with pytest.raises(ValueError, match="not contiguous"):
        rd.export_region([torch.zeros(4, 4).t()])
    # Each was exported: a reader got the conjugate's raw bytes, the wrapper's address 0.
    with pytest.raises(ValueError, match="conjugated or negated view"):
        rd.export_region({"c": torch.zeros(4, dtype=torch.complex64).conj()})
    with pytest.raises(ValueError, match="is a TwoTensor"):
        rd.export_region([TwoTensor(torch.zeros(4), torch.zeros(4))])
    with pytest.raises(ValueError, match="is a sparse_coo tensor"):  # it said "not contiguous"
        rd.export_region([torch.zeros(4).to_sparse()])
    with pytest.raises(ValueError, match="meta"):
        rd.export_region({"k": torch.empty(8, device="meta")})
    with pytest.raises(ValueError, match="at least one"):
        rd.export_region([])
    with pytest.raises(TypeError, match="torch tensor"):
        rd.export_region(["not a tensor"])
    with pytest.raises(ValueError, match="one-sided"):
        rd.export_region([torch.zeros(4)], tensor_transport="gloo")
    with pytest.raises(TypeError, match="on_notice"):
        rd.export_region([torch.zeros(4)], on_notice="print")
    with pytest.raises(TypeError, match="huge_pages must be True or False, got 'no'"):
        rd.export_region([torch.zeros(4)], huge_pages="no")  # it was truthy
    assert rd.local_stats().num_regions == 0


# ------------------------------------------------------------ counters


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_reads_are_counted_on_both_sides(owner, reader, transport):
    handle = ray.get(owner.handle.remote())
    owner_stats = ray.get(owner.stats.remote())
    assert (owner_stats.num_regions, owner_stats.region_bytes) == (1, LAYERS * BLOCKS * BLOCK_BYTES)
    assert owner_stats.num_objects == 0  # a region is not an object
    name = used(transport)
    sent = owner_stats.bytes_sent.get(name, 0)
    received = ray.get(reader.stats.remote()).bytes_received.get(name, 0)
    ray.get(reader.read.remote(handle, BLOCKS_READ, DEST_BLOCKS, forced(transport)))
    assert ray.get(reader.settle.remote())  # cma's reads reach the owner by notice
    nbytes = LAYERS * len(BLOCKS_READ) * BLOCK_BYTES
    assert ray.get(reader.stats.remote()).bytes_received.get(name, 0) - received == nbytes
    assert ray.get(owner.stats.remote()).bytes_sent.get(name, 0) - sent == nbytes


# ------------------------------------------------------------ plug-ins


def _staged_since(others: set[str]) -> set[str]:
    """The plug-in files staged since ``others`` were: other modules' plug-ins
    leave their own marker files (rdplug-gc-*) behind while their workers exit."""
    return {f for f in plugin_files() - others if not f.startswith("rdplug-gc-")}


def test_a_one_sided_plugin_reads_the_bytes_as_they_are(reader, ray_session):
    """A plug-in moves whole tensors (its interface has no ranges): the owner's
    agent extracts them for each read from the tensors as they are then, and
    releases them (``garbage_collect``) when the read ends or the region closes."""
    cloudpickle.register_pickle_by_value(plugin_transports)
    rd.register_tensor_transport("pickle_shm", ["cpu"], PickleShmTransport, replace=True)
    others = plugin_files()
    owner = Owner.remote("pickle_shm")
    try:
        handle = ray.get(owner.handle.remote())
        assert handle.transport == "pickle_shm"
        before = ray.get(reader.stats.remote()).objects_received.get("pickle_shm", 0)
        assert_read(ray.get(reader.read.remote(handle, BLOCKS_READ, DEST_BLOCKS)))
        after = ray.get(reader.stats.remote()).objects_received.get("pickle_shm", 0)
        assert after == before + 1
        assert _staged_since(others) == set()  # released when the read ended
        ray.get(owner.fill.remote(5.0))
        assert_read(ray.get(reader.read.remote(handle, BLOCKS_READ, DEST_BLOCKS)), fill=5.0)
        ray.get(owner.close.remote())
        error = ray.get(reader.read_error.remote(handle, None))
        assert error.startswith("ProducerLostError|True|"), error
        assert _staged_since(others) == set()
    finally:
        ray.kill(owner)


def test_a_plugin_read_whose_reader_gave_up_is_released(ray_session):
    """Readers time out while the owner's agent still stages their copies (a slow
    plug-in): they never learn the read's id, so they cannot release it, and each
    staged copy stayed until the region closed. The agent now releases a prepared
    read once its reader's deadline is past by ``ABANDONED_AFTER_S``."""
    cloudpickle.register_pickle_by_value(plugin_transports)
    rd.register_tensor_transport("slow_staging", ["cpu"], SlowStagingTransport, replace=True)
    others = plugin_files()
    owner = Owner.remote("slow_staging")
    try:
        handle = ray.get(owner.handle.remote())
        ray.get(owner.prepared_reads.remote(0.5))
        dests = [torch.zeros(BLOCKS, BLOCK_ELEMS) for _ in range(LAYERS)]
        rows = kv_rows(BLOCKS_READ, DEST_BLOCKS)
        for _ in range(3):
            with pytest.raises(rd.FetchTimeoutError):
                rd.read_ranges(handle, rows, into=dests, timeout=0.3)
        wait_for(lambda: ray.get(owner.prepared_reads.remote()) == 3, 30, "staged")
        assert len(_staged_since(others)) == 3

        def a_read_releases_them() -> bool:
            rd.read_ranges(handle, rows, into=dests, timeout=30)
            return ray.get(owner.prepared_reads.remote()) == 0 and not _staged_since(others)

        wait_for(a_read_releases_them, 30, "the abandoned reads released")
        assert dests[0][DEST_BLOCKS[0]].equal(layer_value(0)[BLOCKS_READ[0]])
    finally:
        ray.kill(owner)


def _own_read_racing_close(size: int, rows_n: int) -> dict[str, Any]:
    """Read a region of this process on a thread; close it as soon as the copy
    has begun, and write the memory at once."""
    run = size // rows_n
    rows = [[0, i * run, run, 0, i * (run + 1)] for i in range(rows_n)]  # nothing merges
    src = torch.full((size,), 1, dtype=torch.uint8)
    region = rd.export_region(src, huge_pages=False)
    dest = torch.zeros(size + rows_n, dtype=torch.uint8)
    outcome: dict[str, Any] = {}

    def read() -> None:
        try:
            outcome["ok"] = rd.read_ranges(region.handle(), rows, into=dest, timeout=60)
        except rd.ProducerLostError as exc:
            outcome["lost"] = exc

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 30
    while dest[0] != 1 and time.monotonic() < deadline:  # polled closely: the copy is short
        pass
    region.close()
    src.fill_(0xEE)
    reader.join(60)
    outcome["poisoned"] = int((dest == 0xEE).sum())
    return outcome


def test_a_read_in_the_owners_process_ends_before_close_returns(ray_session):
    """The owner reads its own region on one thread and closes it on another, then
    writes the memory at once (as close's contract allows): the read returns the
    region's bytes or ProducerLostError, never the new bytes. The copy ran outside
    the region's guard: close returned while it still copied, and the read
    returned the poison."""
    for _ in range(3):
        outcome = _own_read_racing_close(64 << 20, 256)
        assert "ok" in outcome or "lost" in outcome, "the read did not end"
        assert outcome["poisoned"] == 0, "the read returned bytes written after close"


def _read_until_it_fails(handle: Any, nbytes: int, reads: list[int]) -> BaseException:
    dest = torch.zeros(nbytes, dtype=torch.uint8)
    while True:
        try:
            rd.read_ranges(handle, [[0, 0, nbytes, 0, 0]], into=dest, tensor_transport="cma")
        except Exception as exc:  # noqa: BLE001 (the test looks at which)
            return exc
        reads.append(1)


def test_a_cma_read_of_memory_freed_after_close_is_producer_lost(ray_session):
    """The owner closes its region and frees the memory while a cma read copies
    from it: the read fails on unmapped memory, and must say the region was
    closed (ProducerLostError), not "Bad address" (a TransferError: about half
    of such races did)."""
    owner = FreeingOwner.remote()
    nbytes = 64 << 20
    try:
        for _ in range(6):
            handle = ray.get(owner.export.remote(nbytes))
            reads: list[int] = []
            outcome: list[BaseException] = []
            reader = threading.Thread(
                target=lambda: outcome.append(_read_until_it_fails(handle, nbytes, reads))  # noqa: B023
            )
            reader.start()
            wait_for(lambda: len(reads) >= 2, 60, "reads to run")  # noqa: B023
            ray.get(owner.close_and_free.remote())
            reader.join(60)
            [error] = outcome
            assert isinstance(error, rd.ProducerLostError), repr(error)
    finally:
        ray.kill(owner)


def _hostile_ranges(count: int, stride: int, length: int = 8) -> Ranges:
    dest = torch.zeros(length, dtype=torch.uint8)
    return Ranges(
        np.array([0]),
        np.array([0]),
        np.array([length]),
        np.array([count]),
        np.array([stride], dtype=np.int64),
        [dest],
    )


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_ranges_whose_arithmetic_wraps_are_refused_and_the_owner_serves_on(transport):
    """A peer holding the handle sends its own ranges (rd.read_ranges sends one run
    per row): runs whose end, computed in int64, wrapped around passed the agent's
    check, and serving them read far outside the tensor: the owner died of SIGSEGV.
    Overlapping runs (a stride below the length, or 0) could make a tiny request
    send the tensor over and over; refused too."""
    owner, reader = Owner.remote(), RegionReader.remote()
    try:
        handle = ray.get(owner.handle.remote())
        payload = RegionHandle.of(handle).payload()
        for count, stride in [(3, (1 << 62) + 8), (2, 1 << 62), ((1 << 40), 0), (4, 4)]:
            with pytest.raises(rd.TransferError, match="reaches past|overlap"):
                fetch_ranges(
                    payload, _hostile_ranges(count, stride), time.monotonic() + 30, transport
                )
        assert_read(ray.get(reader.read.remote(handle, BLOCKS_READ, DEST_BLOCKS)))
    finally:
        ray.kill(owner)
        ray.kill(reader)
