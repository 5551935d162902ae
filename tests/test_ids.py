"""Object ids: unique, made without the kernel's random source on the hot path
(``os.urandom`` stalled 42 ms once in 20,000 calls on these VMs), and another
process's in a forked child."""

from __future__ import annotations

import os

import torch

from raydirect import _process, _producer


def test_object_ids_are_unique_and_draw_no_randomness(monkeypatch):
    def refuse(n: int) -> bytes:
        raise AssertionError("os.urandom called on the hot path")

    _producer.export(torch.ones(4), "auto")  # first use: whatever starts once, started
    monkeypatch.setattr(os, "urandom", refuse)
    ids = {_process.new_id() for _ in range(100_000)}
    assert len(ids) == 100_000 and {len(i) for i in ids} == {16}
    inline = _producer.export(torch.ones(4), "auto")  # an inline value's id, too
    assert len(inline.obj_id) == 16 and inline.obj_id not in ids


def test_a_forked_child_makes_other_ids():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        os.write(write, b"".join(_process.new_id() for _ in range(64)))
        os._exit(0)
    os.close(write)
    theirs = os.read(read, 64 * 16)
    os.waitpid(pid, 0)
    ours = b"".join(_process.new_id() for _ in range(64))
    theirs_set = {theirs[i : i + 16] for i in range(0, len(theirs), 16)}
    assert len(theirs_set) == 64 and not theirs_set & {ours[i : i + 16] for i in range(0, 1024, 16)}
