"""A driver with a Ray cluster of its own, whose GCS tests/test_exit.py kills.

    python exit_driver.py MARKS_DIR

Starts a local cluster (never the test session's), makes an actor export two
objects and exports one itself, so both processes announce their agents, and
prints one ``@@RD {json}`` line: the pids of the driver, the actor and the GCS,
and the actor's start time. Then it waits for a line on stdin and exits by
returning, as a script does.

In both processes two atexit hooks bracket raydirect's own: Python runs exit
hooks last registered first, so ``before`` (registered after the first export)
runs just before raydirect's hooks and ``after`` (registered before it) just
after them. Each appends its name and the time to ``MARKS_DIR/<pid>``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import time
from typing import Any

import ray
import torch
from ray import cloudpickle
from ray._private import ray_constants

import raydirect as rd
from raydirect import _process, _ray

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def mark(marks_dir: str, name: str) -> None:
    with open(os.path.join(marks_dir, str(os.getpid())), "a") as f:
        f.write(f"{name} {time.time()}\n")


@ray.remote(num_cpus=0)
class Holder:
    def export(self, marks_dir: str) -> tuple[list[Any], int, int]:
        atexit.register(mark, marks_dir, "after")
        refs = [
            rd.put(torch.ones(100_000), tensor_transport="tcp"),  # starts and announces the agent
            rd.put(torch.ones(100_000), tensor_transport="shm"),  # shm's exit hook too
        ]
        atexit.register(mark, marks_dir, "before")
        return refs, os.getpid(), _process.START_TIME


def _wait_announced(pids: set[int], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        announced = {json.loads(v)["pid"] for v in _ray.published_agents().values()}
        if pids <= announced:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"agents of {pids} not announced; announced: {announced}")
        time.sleep(0.05)


def start_cluster(attempts: int = 3) -> None:
    """A local cluster of this driver's own. Ray gives a starting raylet a fixed
    30 s to register (``ray._private.node``); beside the test session's own
    cluster on a loaded 2-core machine it can take longer, so try again."""
    for attempt in range(attempts):
        try:
            ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="error")
            return
        except Exception as exc:
            if "timed out during startup" not in str(exc) or attempt == attempts - 1:
                raise
            print(f"ray.init: {exc}; trying again", file=sys.stderr, flush=True)
            ray.shutdown()
            _end_children()  # the failed try's GCS and raylet: Ray does not stop them


def _end_children() -> None:
    """SIGKILL this process's children and wait (bounded) until they are gone."""
    import psutil  # Ray's own copy, on sys.path once ray is imported

    children = psutil.Process().children()
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(children, timeout=30)


def main() -> None:
    marks_dir = sys.argv[1]
    start_cluster()
    atexit.register(mark, marks_dir, "after")
    mine = rd.put(torch.ones(100_000), tensor_transport="tcp")
    atexit.register(mark, marks_dir, "before")
    holder = Holder.remote()
    refs, actor_pid, actor_start = ray.get(holder.export.remote(marks_dir), timeout=300)
    _wait_announced({os.getpid(), actor_pid})
    node = ray._private.worker._global_node
    gcs = node.all_processes[ray_constants.PROCESS_TYPE_GCS_SERVER][0].process.pid
    info = {"driver": os.getpid(), "actor": actor_pid, "actor_start": actor_start, "gcs": gcs}
    print("@@RD " + json.dumps(info), flush=True)
    sys.stdin.readline()
    del mine, refs


if __name__ == "__main__":
    main()
