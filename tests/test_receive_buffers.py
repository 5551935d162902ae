"""Receive regions are reused only once nothing views them, and idle memory is capped."""

from __future__ import annotations

import torch

from raydirect._tensors import _ReceiveRegions

MiB = 1 << 20


def test_region_reused_only_after_every_view_is_gone():
    pool = _ReceiveRegions(idle_cap_bytes=256 * MiB)
    first = pool.take(8 * MiB)
    first[:4] = 7
    view = first[2:6].view(torch.int16)
    arr = first.numpy()
    del first
    second = pool.take(8 * MiB)  # the first region is still viewed: a new one
    assert second.data_ptr() != view.data_ptr() - 2
    assert pool.idle_bytes() == 0
    del view
    assert pool.idle_bytes() == 0  # the numpy array still holds it
    ptr = arr.ctypes.data
    del arr
    assert pool.idle_bytes() == 8 * MiB
    third = pool.take(7 * MiB)  # fits the freed region: reused
    assert third.data_ptr() == ptr and third.numel() == 7 * MiB
    del second, third


def test_idle_regions_are_capped():
    pool = _ReceiveRegions(idle_cap_bytes=16 * MiB)
    held = [pool.take(8 * MiB) for _ in range(4)]
    del held
    assert pool.idle_bytes() == 32 * MiB
    big = pool.take(64 * MiB)  # a new region trims idle ones down to the cap
    assert pool.idle_bytes() <= 16 * MiB
    del big
    off = _ReceiveRegions(idle_cap_bytes=0)
    t = off.take(8 * MiB)
    del t
    off.take(16 * MiB)
    assert off.idle_bytes() == 0
