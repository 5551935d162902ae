"""Weight sync: a trainer broadcasts its weights to rollout workers every step,
straight into the rollouts' own parameter tensors.

Per step: the trainer trains (in place, once the last broadcast is read), hands
out its weights as one raydirect object, and ``rd.broadcast`` makes every
rollout receive it while the trainer serves a single read per node. Each
rollout receives into ``model.state_dict()`` with ``into=``: no new tensors,
no copy after the transfer.

Run: ./dev python examples/weight_sync.py
"""

import time

import ray
import torch

import raydirect as rd

ROLLOUTS = 4
STEPS = 5
HIDDEN = 1024  # ~24 MiB of float32 weights: three 1024x1024 layers and a head


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *[torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(3)], torch.nn.Linear(HIDDEN, 16)
    )


def checksum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


@ray.remote(num_cpus=0)
class Trainer:
    def __init__(self):
        self.model = make_model()

    def train_step(self) -> float:
        # The last weights may still be in flight: wait until every reader is done
        # before writing the parameters in place.
        for p in self.model.parameters():
            rd.wait_tensor_freed(p.data, timeout=60)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn_like(p), alpha=1e-3)
        return checksum(self.model)

    @rd.method  # the weights stay here; Ray carries a small descriptor
    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.data for k, v in self.model.state_dict().items()}

    def reads_served(self) -> int:
        return sum(rd.local_stats().objects_sent.values())


@ray.remote(num_cpus=0)
class Rollout:
    def __init__(self):
        self.model = make_model()

    def load(self, refs: list) -> float:
        # Lands in this model's own parameters; shapes and dtypes are checked first.
        rd.get(refs[0], into=self.model.state_dict(), timeout=60)
        return checksum(self.model)


def main() -> None:
    ray.init(include_dashboard=False, logging_level="error")
    trainer = Trainer.remote()
    rollouts = [Rollout.remote() for _ in range(ROLLOUTS)]
    all_match = True
    for step in range(STEPS):
        expected = ray.get(trainer.train_step.remote())
        served = ray.get(trainer.reads_served.remote())
        start = time.perf_counter()
        ref = trainer.weights.remote()
        refs = rd.broadcast(ref, rollouts, timeout=60)
        sums = ray.get([r.load.remote([x]) for r, x in zip(rollouts, refs, strict=True)])
        elapsed = time.perf_counter() - start
        del ref, refs  # lets the trainer write its parameters again
        reads = ray.get(trainer.reads_served.remote()) - served
        match = all(abs(s - expected) < 1e-6 * max(1.0, abs(expected)) for s in sums)
        all_match &= match
        print(
            f"step {step}: {ROLLOUTS} rollouts loaded in {elapsed * 1e3:.0f} ms, "
            f"trainer served {reads} read(s), checksums match: {match}"
        )
    print(f"all {ROLLOUTS} rollouts match the trainer at every step: {all_match}")
    ray.shutdown()


if __name__ == "__main__":
    main()
