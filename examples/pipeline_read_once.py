"""A two-stage pipeline whose activations are read once: no lease behind them.

Each stage's output is read by exactly one next stage, so the method says so:
``@rd.method(reads=1, ttl=30)``. The producer frees each output after its one
read (or 30 s, if the reader never comes), with no Ray object or pubsub per
transfer. A read after that raises ``rd.ProducerLostError`` naming the lifetime.
On a machine with a GPU the stages run on it (half a GPU each) and hand their
activations over with CUDA IPC, under the same lifetime.

Run: ./dev python examples/pipeline_read_once.py
"""

import time

import ray
import torch

import raydirect as rd

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@ray.remote(num_cpus=0)
class Stage:
    def __init__(self, seed: int):
        torch.manual_seed(seed)
        self.layer = torch.nn.Linear(512, 512).to(DEVICE)

    @rd.method(reads=1, ttl=30)  # read once by the next stage, then freed
    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.layer(x))

    def held(self) -> int:
        return rd.local_stats().num_objects


def wait_until_empty(stage, timeout: float = 30.0) -> int:
    # The read's notice reaches the producer a few ms after the read returns.
    deadline = time.monotonic() + timeout
    while (held := ray.get(stage.held.remote())) and time.monotonic() < deadline:
        time.sleep(0.01)
    return held


if __name__ == "__main__":
    ray.init(include_dashboard=False)
    gpus = 0.5 if DEVICE == "cuda" else 0
    first, second = (Stage.options(num_gpus=gpus).remote(seed) for seed in (0, 1))
    batch = torch.randn(64, 512, device=DEVICE)
    hidden = first.forward.remote(batch)  # stays in `first`
    out = second.forward.remote(hidden)  # `second` reads it straight from `first`
    result = rd.get(out, timeout=30)  # the driver is the one reader of `out`
    print("output", tuple(result.shape), "on", result.device.type)
    print("first stage holds after the read:", wait_until_empty(first))
    try:
        rd.get(hidden, timeout=30)  # a second read of a read-once object
    except rd.ProducerLostError as exc:
        print("a second read:", type(exc).__name__, "naming", "reads=1, ttl=30" in str(exc))
