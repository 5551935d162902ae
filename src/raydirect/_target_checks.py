"""What every receive checks of the memory it is told to write (``rd.get``'s
``into=``, a region read's destinations, a weight load's targets) before a byte
moves: that this process can write it, and that the bytes written there are the
values the tensor shows. Whether it is dense is ``_split.not_dense``,
which asks the same of what a producer sends."""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from raydirect._process import process_vm_readv

_PROBES_PER_CALL = 1024  # IOV_MAX

# What a refusal of a target with torch's conjugate or negative bit says after
# naming it (every target check: rd.get into=, regions, weight loads).
LAZY_VIEW = (
    "is a lazily conjugated or negated view (x.conj(), x.conj().imag): its bytes are not the "
    "values it shows, so the bytes written into it would read back conjugated or negated; "
    "pass a tensor of its own (t.resolve_conj().resolve_neg()) and copy it back"
)


# What a refusal of an ``unwritable`` tensor says after naming it.
UNWRITABLE = (
    "is memory this process cannot write (a read-only mapping: torch.frombuffer over a file "
    "or mmap opened read-only), and a write into it would crash the process: pass a tensor "
    "in writable memory (torch.empty_like, or .clone() it), or map the file copy-on-write "
    "(mmap.ACCESS_COPY)"
)


def unwritable(tensors: Sequence[Any]) -> int | None:
    """The position of the first tensor in ``tensors`` over host memory this
    process cannot write (``torch.frombuffer`` over a file mapped read-only), or None.

    A store into such memory kills the process with SIGSEGV, a kernel copy fails
    with "Bad address". Only tensors whose memory torch did not allocate (storage
    not resizable: from a buffer, numpy, a file) are probed: asking costs ~0.1 µs
    a tensor. The kernel copies a probed tensor's first and last byte onto
    themselves (``process_vm_readv`` of this process, ~0.5 µs a tensor), and
    stops short where they cannot be written. None also where that call is not
    permitted here (a seccomp profile): nothing is known then.
    """
    foreign = [
        k
        for k, t in enumerate(tensors)
        if isinstance(t, torch.Tensor) and not t.untyped_storage().resizable() and t.is_cpu
    ]
    spans = [k for k in foreign if tensors[k].nbytes]
    if not spans:
        return None
    starts = np.array([tensors[k].data_ptr() for k in spans], np.uint64)
    probes = np.empty((2 * len(spans), 2), np.uint64)  # iovecs: (address, 1 byte)
    probes[0::2, 0] = starts
    probes[1::2, 0] = starts + np.array([tensors[k].nbytes - 1 for k in spans], np.uint64)
    probes[:, 1] = 1
    pid = os.getpid()
    for first in range(0, len(probes), _PROBES_PER_CALL):
        part = probes[first : first + _PROBES_PER_CALL]
        n = len(part)
        done = process_vm_readv(pid, part.ctypes.data, n, part.ctypes.data, n, 0)
        if done == n:
            continue
        if done < 0 and ctypes.get_errno() != errno.EFAULT:
            return None
        return spans[(first + max(done, 0)) // 2]
    return None
