"""A 256 MiB tensor arrives intact over every transport."""

from __future__ import annotations

import pytest
import ray

import raydirect as rd

SIZE = 256 << 20


@pytest.mark.parametrize("transport", ["auto", "cma", "shm", "tcp"])
def test_256_mib_intact(pair, transport):
    p, c = pair
    fill = {"auto": 1, "cma": 2, "shm": 3, "tcp": 4}[transport]
    ref = p.big.remote(SIZE, fill)
    got = rd.get(ref, timeout=120, tensor_transport=transport)
    assert got.numel() == SIZE
    marks = got[::4096]
    assert marks.tolist() == [i % 251 for i in range(marks.numel())]
    rest = got.view(-1, 4096)[:, 1:]
    assert bool((rest == fill).all())
    del got
    numel, second, first_marks = ray.get(c.summarize.remote(ref))
    assert (numel, second, first_marks) == (SIZE, fill, list(range(8)))
