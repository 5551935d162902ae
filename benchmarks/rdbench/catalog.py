"""Every workload of ``raydirect bench``, by number: what ``--workloads`` picks from."""

from __future__ import annotations

from rdbench.busy_reads import busy_reads, busy_summary
from rdbench.common import OBJECT_STORE, PLAIN_CALL, RDT_GLOO, Workload
from rdbench.driver import to_driver
from rdbench.kv_handoff import NIXL_HANDOFF, NIXL_TRANSFER, kv_handoff, kv_targets
from rdbench.leases import BARE, lease_targets, leases
from rdbench.medium import TWO_CALLS, medium, medium_targets
from rdbench.multinode import BASELINES_15, BASELINES_16, fan_out, node_targets, two_nodes
from rdbench.plan_moe import plan_moe, plan_targets
from rdbench.regions import FLOOR_GATHER, NIXL_READ, region_reads
from rdbench.reshard import GATHER_PUBLISH, reshard, reshard_targets
from rdbench.timeline import timeline, timeline_table
from rdbench.vllm_update import FLOOR, NAIVE, vllm_targets, vllm_update
from rdbench.weights import weight_api, weight_targets
from rdbench.workloads import (
    VIA_DRIVER,
    actor_to_actor,
    many_refs,
    small_objects,
    weight_sync,
)

WORKLOADS = {
    w.number: w
    for w in [
        Workload(
            1,
            "actor -> actor, one tensor",
            "size",
            "GB/s",
            (OBJECT_STORE, RDT_GLOO),
            actor_to_actor,
        ),
        Workload(
            2,
            "weight sync: one state dict to N consumers",
            "consumers",
            "GB/s",
            (OBJECT_STORE, RDT_GLOO),
            weight_sync,
        ),
        Workload(
            3,
            "small objects: 4 KiB round trips",
            "size",
            "us",
            (PLAIN_CALL, PLAIN_CALL + VIA_DRIVER),
            small_objects,
        ),
        Workload(
            4,
            "8 refs from 4 producers, read with one call",
            "refs",
            "GB/s",
            (OBJECT_STORE,),
            many_refs,
        ),
        Workload(
            5, "the driver reads one large tensor", "size", "GB/s", (OBJECT_STORE,), to_driver
        ),
        Workload(
            6,
            "weight sync through the weight API, 200 and 5,000 tensors",
            "tensors, consumers",
            "GB/s",
            (OBJECT_STORE, RDT_GLOO),
            weight_api,
            weight_targets,
        ),
        Workload(
            7,
            "weight sync from a sharded trainer: rows on N ranks to columns on N workers",
            "ranks -> workers",
            "GB/s",
            (GATHER_PUBLISH,),
            reshard,
            reshard_targets,
        ),
        Workload(
            8,
            "medium transfers, 4 KiB to 16 MiB, against the two calls they ride on",
            "size",
            "us",
            (TWO_CALLS, OBJECT_STORE, RDT_GLOO),
            medium,
            medium_targets,
        ),
        Workload(
            9,
            "one whole weight update of a vLLM engine, a float32 Llama of ~320 MiB",
            "engine",
            "GB/s",
            (NAIVE, FLOOR),
            vllm_update,
            vllm_targets,
        ),
        Workload(
            10,
            "ranged reads of a long-lived region (KV blocks), against one copy and NIXL",
            "read",
            "us",
            (FLOOR_GATHER, NIXL_READ),
            region_reads,
        ),
        Workload(
            11,
            "KV hand-off between two vLLM engines (prefill -> decode), Llama-3.2-1B's KV",
            "prompt",
            "us",
            (NIXL_HANDOFF, NIXL_TRANSFER),
            kv_handoff,
            kv_targets,
        ),
        Workload(
            12,
            "planning a reshard of a 1T-parameter MoE: 256 trainer ranks to 128 workers",
            "ranks -> workers",
            "us",
            (),
            plan_moe,
            plan_targets,
        ),
        Workload(
            13,
            "what a lifetime costs consecutive 1 MiB transfers, in time and CPU",
            "size",
            "us",
            (BARE,),
            leases,
            lease_targets,
        ),
        Workload(
            14,
            "where one transfer's time goes, step by step, in both processes",
            "point",
            "us",
            (),
            timeline,
            timeline_table,
        ),
        Workload(
            15,
            "one tensor across two real nodes (network namespaces; root)",
            "size",
            "GB/s",
            BASELINES_15,
            two_nodes,
        ),
        Workload(
            16,
            "one tensor from node B to four consumers on two other nodes (root)",
            "size",
            "GB/s",
            BASELINES_16,
            fan_out,
            node_targets,
        ),
        Workload(
            17,
            "reads beside a thread that runs Python, against the same reads alone",
            "object, thread",
            "us",
            (OBJECT_STORE,),
            busy_reads,
            busy_summary,
        ),
    ]
}
