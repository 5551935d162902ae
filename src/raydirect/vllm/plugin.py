"""Registration of the backend with vLLM's two weight-transfer factories and
of the KV connector with vLLM's connector factory."""

from __future__ import annotations

import logging
from collections.abc import Callable

from raydirect.vllm.cluster import export_ray_context
from raydirect.vllm.versions import SUPPORTED, report_range

log = logging.getLogger(__name__)

BACKEND = "raydirect"
CONNECTOR = "RaydirectConnector"


def _weight_backend() -> None:
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "raydirect.vllm.worker", "RaydirectWeightTransferEngine"
        )
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(
            BACKEND, "raydirect.vllm.trainer", "RaydirectTrainerWeightTransferEngine"
        )


def _kv_connector() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            CONNECTOR, "raydirect.vllm.kv_connector", "RaydirectConnector"
        )


# Each on its own: a vLLM whose weight-transfer API moved still gets the KV
# connector, and the other way round.
_PARTS: tuple[tuple[str, Callable[[], None]], ...] = (
    (f"weight-transfer backend {BACKEND!r}", _weight_backend),
    (f"KV connector {CONNECTOR!r}", _kv_connector),
)


def register() -> list[str]:
    """Registers ``"raydirect"`` on the worker and trainer factories, and the KV
    connector ``"RaydirectConnector"`` on vLLM's connector factory; idempotent
    (vLLM calls general plug-ins once per process, importing this package calls it
    again). Lazy: the engines' modules load only when vLLM creates one. In a
    process connected to Ray (an engine inside a Ray actor) it also passes that
    Ray context on to the processes vLLM starts (see ``cluster``).

    A part vLLM's factories refuse is logged, one line naming the supported vLLM
    range, and the other part is registered all the same; returns what failed."""
    export_ray_context()
    report_range()
    failed = []
    for what, step in _PARTS:
        try:
            step()
        except Exception as exc:  # this vLLM's factory moved or refuses it
            failed.append(f"{what}: {type(exc).__name__}: {exc}")
            log.error(
                "raydirect: the %s is not registered (%s: %s); raydirect supports vLLM %s",
                what,
                type(exc).__name__,
                exc,
                SUPPORTED,
            )
    return failed
