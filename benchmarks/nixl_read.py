"""512 MiB actor -> actor over raydirect's nixl, cma and tcp (one Ray session, fresh
actors per transport).

Not named nixl.py: Ray puts the script's folder on every worker's sys.path, where
a nixl.py would shadow the `nixl` package (Ray's RDT imports nixl._api).
"""

import os
import statistics
import time

import ray
import torch

import raydirect as rd

SIZE = int(os.environ.get("BENCH_MIB", "512")) << 20
REPS = 5


@ray.remote(num_cpus=0)
class Producer:
    def __init__(self) -> None:
        self.t = torch.full((SIZE,), 7, dtype=torch.uint8)
        self.refs: list = []

    def export(self, transport: str) -> tuple[list, float]:
        start = time.perf_counter()
        ref = rd.put(self.t, tensor_transport=transport)
        took = time.perf_counter() - start
        self.refs.append(ref)  # keep it alive: a second export reuses the registration
        return [ref], took


@ray.remote(num_cpus=0)
class Consumer:
    def fetch(self, refs: list, transport: str, reps: int) -> list[float]:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            got = rd.get(refs[0], tensor_transport=transport)
            times.append(time.perf_counter() - start)
            assert got.numel() == SIZE and int(got[SIZE // 2]) == 7
            del got
        return times


def main() -> None:
    ray.init(num_cpus=4, include_dashboard=False, logging_level="error")
    gb = SIZE / 1e9
    print(f"{SIZE >> 20} MiB actor -> actor, {REPS} fetches of one object per transport")
    for transport in ["nixl", "cma", "tcp"]:
        p, c = Producer.remote(), Consumer.remote()
        [ref], cold_export = ray.get(p.export.remote(transport))
        [_], warm_export = ray.get(p.export.remote(transport))
        times = ray.get(c.fetch.remote([ref], transport, REPS))
        warm = [gb / t for t in times[1:]]
        print(
            f"{transport:5} export {cold_export:.3f}s then {warm_export:.3f}s; "
            f"1st fetch {times[0]:.3f}s; warm {statistics.median(warm):.2f} GB/s "
            f"median, {max(warm):.2f} best"
        )
        ray.kill(p)
        ray.kill(c)
    ray.shutdown()


if __name__ == "__main__":
    main()
