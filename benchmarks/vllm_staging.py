"""What keeping a worker's staging between updates saves (docs/vllm.md, What an
update costs in memory): interleaved updates of one engine from two trainers,
one with ``keep_staging=True`` (the default) and one with ``False`` (staging freed
once the update has loaded), each timed on its second update in a row, on the ~320 MiB
float32 Llama of ``raydirect bench``'s workload 9. Prints the median seconds of
``send_weights()`` and of the workers' receive, and their ratio.

    bash scripts/setup-vllm-venv.sh
    .venv-vllm/bin/python benchmarks/vllm_staging.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))

import vllm_harness  # noqa: E402
from ray import cloudpickle  # noqa: E402
from vllm.distributed.weight_transfer.base import ModuleSource  # noqa: E402
from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient  # noqa: E402
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory  # noqa: E402

from raydirect.vllm import RaydirectTrainerInitInfo  # noqa: E402

MODEL = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 6,
         "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 8192}  # fmt: skip


def _receive_s(engine: Any) -> float:
    def read(worker: Any) -> float:
        return float(worker.weight_transfer_engine.last_update["receive_s"])

    return float(max(ray.get(engine.collective_rpc.remote(read), timeout=60)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    cloudpickle.register_pickle_by_value(vllm_harness)
    ray.init(num_cpus=8, include_dashboard=False, logging_level="warning")
    with tempfile.TemporaryDirectory() as tmp:
        vllm_harness.save_llama(Path(tmp), **MODEL)
        engine = vllm_harness.start_engine(
            Path(tmp), weight_transfer_config={"backend": "raydirect"}
        )
        model = vllm_harness.random_llama(seed=1, **MODEL)
        size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for r in range(rounds + 1):  # the first round of each warms up
            for keep in (True, False):
                trainer = WeightTransferTrainerFactory.trainer_init(
                    RaydirectTrainerInitInfo(
                        rank=0, timeout=300, keep_staging=keep, name=f"k{keep}"
                    ),
                    client=RayVLLMWeightSyncClient([engine]),
                    source=ModuleSource(model),
                )
                # the first update leaves the staging as this policy does; the second is timed
                for _ in range(2):
                    with torch.no_grad():
                        for p in model.parameters():
                            p.mul_(1.001)
                    started = time.perf_counter()
                    trainer.send_weights()
                    took = time.perf_counter() - started
                if r:
                    times[keep].append((took, _receive_s(engine)))
                trainer.shutdown()
    print(f"model {size / 2**20:.0f} MiB, {rounds} interleaved rounds, medians")
    print("| staging | send_weights() s | workers' receive s |")
    print("|---|---|---|")
    med = {k: [statistics.median(x) for x in zip(*v, strict=True)] for k, v in times.items()}
    for keep in (True, False):
        print(
            f"| {'kept (default)' if keep else 'freed'} | {med[keep][0]:.3f} | {med[keep][1]:.3f} |"
        )
    send, receive = (med[False][i] / med[True][i] for i in (0, 1))
    print(f"freed / kept: send {send:.2f}x, receive {receive:.2f}x")
    ray.shutdown()


if __name__ == "__main__":
    main()
