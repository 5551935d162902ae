"""raydirect on one CUDA GPU against Ray's RDT and Ray's object store.

1. one CUDA tensor, actor -> actor on one GPU, 1 MiB ... 4 GiB, end to end from the driver
2. the same transfers, receive only (timed inside the consumer)
3. weight sync: a 256 MiB state dict of 200 CUDA tensors, one publisher, one subscriber

Rows: raydirect cuda_ipc / auto / nixl, Ray RDT over CUDA IPC and over NIXL
(``.options(tensor_transport=...)``, its ref passed as a direct task argument),
Ray's object store (the tensor returned normally, ``.cuda()`` on receipt), and the
floor: one device-to-device copy in one process. Every transfer is checked element
by element, outside the timed region. Tables (markdown, GB/s and ratios) go to
stdout, progress to stderr; ``--md``/``--json`` files are rewritten after every block.

    python benchmarks/gpu.py [--sizes 1MiB,16MiB,256MiB,1GiB,4GiB] [--repeats 5]
                             [--state-size 256MiB] [--sync-steps 10] [--no-nixl]
                             [--json PATH] [--md PATH] [--skip-if-no-gpu]

Without a CUDA GPU it says so and exits 2 (0 with ``--skip-if-no-gpu``). The code
is in benchmarks/rdbench/gpu_*.py. See docs/gpu.md and benchmarks/README.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # rdbench, also for Ray's workers

from rdbench.gpu_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
