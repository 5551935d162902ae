"""raydirect inside vLLM: the weight-transfer backend ``"raydirect"``.

Turn it on with ``LLM(..., weight_transfer_config={"backend": "raydirect"})`` (or
``--weight-transfer-config '{"backend": "raydirect"}'``); on the trainer,
``WeightTransferTrainerFactory.trainer_init(RaydirectTrainerInitInfo(rank=r),
client=..., source=...)`` then ``send_weights()`` once per step. vLLM finds the
backend through the ``vllm.general_plugins`` entry point in every process it
starts; importing this package registers it too. See docs/vllm.md.

A client of raydirect's public API only (an import-linter contract says so).
"""

from raydirect.vllm.plugin import register
from raydirect.vllm.sources import ShardedModuleSource
from raydirect.vllm.trainer import RaydirectTrainerInitInfo, RaydirectTrainerWeightTransferEngine
from raydirect.vllm.worker import RaydirectWeightTransferEngine

__all__ = [
    "RaydirectTrainerInitInfo",
    "RaydirectTrainerWeightTransferEngine",
    "RaydirectWeightTransferEngine",
    "ShardedModuleSource",
    "register",
]

register()
