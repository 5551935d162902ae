"""What two idle Ray drivers cost when they seeded Python's ``random`` alike.

Ray 2.60 draws a driver's GCS subscriber ids from ``random``; vLLM seeds it alike
in every worker. Two drivers join one cluster and sleep; over 5 s, each driver's
CPU and the GCS's, as a share of one core, for three ways of joining:
unseeded ``ray.init``, ``ray.init`` after ``random.seed(0)``, and
``rd.init_ray`` after ``random.seed(0)``.

    ./dev python benchmarks/seeded_drivers.py

Measured here: docs/vllm.md (*Whom the engine trusts*) and the issue-39 note.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import ray

DRIVER = """
import random, sys, time
import ray
import raydirect as rd
how, address = sys.argv[1], sys.argv[2]
if how != "unseeded":
    random.seed(0)
join = rd.init_ray if how == "rd.init_ray, seeded" else ray.init
join(address=address, log_to_driver=False, logging_level="error")
time.sleep(120)
"""
WAYS = ("unseeded", "ray.init, seeded", "rd.init_ray, seeded")
SETTLE_S, SAMPLE_S = 10.0, 5.0


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ray.init(num_cpus=1, include_dashboard=False, logging_level="warning")
    address = ray.get_runtime_context().gcs_address
    found = subprocess.run(["pgrep", "-n", "gcs_server"], capture_output=True, text=True)
    gcs = int(found.stdout.split()[0])
    for how in WAYS:
        drivers = [subprocess.Popen([sys.executable, "-c", DRIVER, how, address]) for _ in "ab"]
        time.sleep(SETTLE_S)  # both joined and idle
        pids = [d.pid for d in drivers] + [gcs]
        before = [_cpu_seconds(p) for p in pids]
        time.sleep(SAMPLE_S)
        share = [(_cpu_seconds(p) - b) / SAMPLE_S for p, b in zip(pids, before, strict=True)]
        print(f"{how:>20}: drivers {share[0]:.2f} and {share[1]:.2f} of a core, GCS {share[2]:.2f}")
        for d in drivers:
            d.kill()
            d.wait()
    ray.shutdown()


if __name__ == "__main__":
    main()
