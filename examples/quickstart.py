"""Quick start: a trainer's weights go straight to a rollout worker.

Run: ./dev python examples/quickstart.py
"""

import ray
import torch

import raydirect as rd


@ray.remote(num_cpus=0)
class Trainer:
    def __init__(self):
        self.model = torch.nn.Linear(1024, 1024)

    @rd.method  # the returned tensors stay here; only a small descriptor goes through Ray
    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}


@ray.remote(num_cpus=0)
class Rollout:
    def __init__(self):
        self.model = torch.nn.Linear(1024, 1024)

    def load(self, weights: dict[str, torch.Tensor]) -> float:  # no decorator needed
        self.model.load_state_dict(weights)
        return float(self.model.weight.detach().sum())


if __name__ == "__main__":
    ray.init(include_dashboard=False)
    trainer, rollout = Trainer.remote(), Rollout.remote()
    ref = trainer.weights.remote()
    print("rollout loaded weights, checksum", ray.get(rollout.load.remote(ref)))
    local = rd.get(ref, timeout=30)  # the driver can read it too, fetched directly
    print("driver sees", {k: tuple(v.shape) for k, v in local.items()})
    print("trainer holds", ray.get(trainer.__ray_call__.remote(lambda self: rd.local_stats())))
