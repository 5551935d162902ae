"""Registration of the backend with vLLM's two factories."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.weight_transfer.factory import (
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)

from raydirect.vllm.cluster import export_ray_context

BACKEND = "raydirect"
CONNECTOR = "RaydirectConnector"


def register() -> None:
    """Registers ``"raydirect"`` on the worker and trainer factories, and the KV
    connector ``"RaydirectConnector"`` on vLLM's connector factory; idempotent
    (vLLM calls general plug-ins once per process, importing this package calls it
    again). Lazy: the engines' modules load only when vLLM creates one. In a
    process connected to Ray (an engine inside a Ray actor) it also passes that
    Ray context on to the processes vLLM starts (see ``cluster``)."""
    export_ray_context()
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "raydirect.vllm.worker", "RaydirectWeightTransferEngine"
        )
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(
            BACKEND, "raydirect.vllm.trainer", "RaydirectTrainerWeightTransferEngine"
        )
    if CONNECTOR not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            CONNECTOR, "raydirect.vllm.kv_connector", "RaydirectConnector"
        )
