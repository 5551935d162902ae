"""A region's memory moves onto huge pages when it is exported (``_huge_pages``):
what is written is collapsed, what was never written stays unallocated, the
bytes read stay exact, and ``huge_pages=False`` leaves the memory alone.

Real Ray, a real owner process, a real reader over ``cma``.
"""

from __future__ import annotations

import ctypes
import mmap

import pytest
import ray
import region_actors
import torch
from ray import cloudpickle
from region_actors import LargeOwner, read_whole

from raydirect import _huge_pages

cloudpickle.register_pickle_by_value(region_actors)

MIB = 32


def _kernel_collapses() -> bool:
    """Whether this kernel has MADV_COLLAPSE (6.1+, THP not ``never``)."""
    probe = torch.ones(4 << 20, dtype=torch.uint8)
    return _huge_pages.collapse(probe.data_ptr(), probe.numel()) > 0


pytestmark = pytest.mark.skipif(
    not _kernel_collapses(), reason="this kernel cannot collapse memory onto huge pages"
)


@pytest.mark.parametrize("huge_pages", [True, False])
def test_written_memory_moves_onto_huge_pages_and_unwritten_memory_stays_unallocated(
    ray_session, huge_pages
):
    owner = LargeOwner.remote(MIB, huge_pages)
    try:
        handle = ray.get(owner.handle.remote())
        grown = ray.get(owner.grown.remote())
        if huge_pages:
            assert grown["AnonHugePages"] >= (MIB - 2) << 20, grown
        else:
            assert grown["AnonHugePages"] < 2 << 20, grown
        # The never-written tensor was not filled in either case.
        assert grown["Rss"] < (MIB // 2) << 20, grown
        assert ray.get(read_whole.remote(handle, MIB << 20))
    finally:
        ray.kill(owner)


def test_only_resident_huge_pieces_are_collapsed():
    written = torch.ones(8 << 20, dtype=torch.uint8)
    assert _huge_pages.collapse(written.data_ptr(), written.numel()) >= 6 << 20
    # Fresh private memory (torch.empty may hand back memory used before):
    # its first half written, so at least one whole 2 MiB piece is resident.
    fresh = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    fresh[: 4 << 20] = b"\1" * (4 << 20)
    address = ctypes.addressof(ctypes.c_char.from_buffer(fresh))
    moved = _huge_pages.collapse(address, 8 << 20)
    assert 2 << 20 <= moved <= 4 << 20
    assert _huge_pages.collapse(written.data_ptr(), 1 << 20) == 0  # no whole piece: nothing


def test_memory_not_mapped_is_left_alone():
    page = ctypes.c_char * 64
    assert _huge_pages.collapse(ctypes.addressof(page()), 64) == 0
    assert _huge_pages.collapse(1 << 46, 8 << 20) == 0  # nothing mapped there: mincore refuses
