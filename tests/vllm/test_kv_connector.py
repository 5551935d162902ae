"""``RaydirectConnector`` between real vLLM engines: a prefill engine (P) and a
decode engine (D) in two processes (Ray actors), driven by vLLM's standard P/D
protocol (``kv_transfer_params``), as a proxy would.

Three engines, shared by the module: P and D hold the same weights, Q other
weights (a prefill engine whose KV, read by D, must change D's tokens; killed
in the last test that uses it). The reference is P alone: a single engine on
D's weights. Each test uses prompts of its own (D keeps a prefix cache)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import ray
import torch
from ray import cloudpickle
from vllm_harness import ENGINE_START_TIMEOUT_S, Engine, prompt, save_llama

import raydirect as rd
from raydirect.vllm.cluster import NODE_IP, export_ray_context

from helpers import wait_for

# The functions run in the engines (collective_rpc) travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

BLOCK = 32  # the CPU attention's block sizes are multiples of 32
LEASE_S = 8.0  # P's lease on blocks nobody read (kv_lease_duration)
NEW_TOKENS = 8
CALL_S = 120.0  # one generate call, at most (2 shared cores)


def _connector(
    lease: float | None = None, policy: str | None = None, **extra: Any
) -> dict[str, Any]:
    config: dict[str, Any] = {"kv_connector": "RaydirectConnector", "kv_role": "kv_both"}
    if lease is not None:
        extra["kv_lease_duration"] = lease
    if extra:
        config["kv_connector_extra_config"] = extra
    if policy is not None:  # vLLM 0.32's default is "fail"
        config["kv_load_failure_policy"] = policy
    return config


@pytest.fixture(scope="module")
def engines(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """P (weights A, a short lease), D (weights A, failed loads recomputed) and Q
    (weights B, its cache left off huge pages), started together; each engine
    computes on a core of its own where it can. D runs its engine core in its
    own process (vLLM's in-process mode), so a test reads its scheduler's state
    as it reads its worker's."""
    paths = {}
    for name, seed in (("a", 0), ("b", 7)):
        paths[name] = Path(tmp_path_factory.mktemp(f"llama-{name}"))
        save_llama(paths[name], seed=seed)
    specs = {
        "p": (paths["a"], "0", _connector(LEASE_S)),
        "d": (paths["a"], "1", _connector(policy="recompute")),
        # Q names its checkpoint A's (kv_model_id): the fingerprints match, and
        # D decodes from Q's KV of other weights (test_the_kv_came_from_...).
        "q": (paths["b"], "0", _connector(LEASE_S, huge_pages=False, kv_model_id=str(paths["a"]))),
    }
    in_process = {"d": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}
    actors = {
        name: Engine.remote(  # type: ignore[attr-defined]
            str(path),
            env={"VLLM_CPU_OMP_THREADS_BIND": core, **in_process.get(name, {})},
            kv_transfer_config=config,
            block_size=BLOCK,
        )
        for name, (path, core, config) in specs.items()
    }
    with _running(actors):
        yield actors


@contextlib.contextmanager
def _running(actors: dict[str, Any]) -> Iterator[None]:
    """The engines started and ready; then each engine core shut down (or its
    processes are orphaned) and its actor killed."""
    try:
        ray.get([a.__ray_ready__.remote() for a in actors.values()], timeout=ENGINE_START_TIMEOUT_S)
        yield
    finally:
        for actor in actors.values():
            # a killed engine (Q) has no core left to stop
            with contextlib.suppress(Exception):
                ray.get(actor.shutdown.remote(), timeout=60)
            ray.kill(actor)


def _prefill(engine: Any, ids: list[int]) -> dict[str, Any]:
    """P's half: prefill ``ids``, return its kv_transfer_params as a proxy would
    forward them (through JSON)."""
    tokens, params, _ = ray.get(
        engine.generate_kv.remote(ids, 1, {"do_remote_decode": True}), timeout=CALL_S
    )
    assert len(tokens) == 1 and params is not None
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]
    return json.loads(json.dumps(params))


def _decode(engine: Any, ids: list[int], params: dict[str, Any] | None) -> list[int]:
    tokens, _, _ = ray.get(engine.generate_kv.remote(ids, NEW_TOKENS, params), timeout=CALL_S)
    return tokens


def _alone(engine: Any, ids: list[int]) -> list[int]:
    return _decode(engine, ids, None)


def _workers(engine: Any) -> list[dict[str, Any]]:
    """Each worker's connector (``kv_worker.status()`` in each worker process), by rank."""

    def read(_worker: Any) -> list[dict[str, Any]]:
        from raydirect.vllm import kv_worker

        return kv_worker.status()

    ranks = ray.get(engine.collective_rpc.remote(read), timeout=CALL_S)
    return sorted((w for rank in ranks for w in rank), key=lambda w: w["rank"])


def _reads(engine: Any, request: str) -> list[dict[str, Any]]:
    """D's reads of P's request ``request`` (at TP 1)."""
    [worker] = _workers(engine)
    return [r for r in worker["reads"] if r["remote"] == request]


def _leases(engine: Any) -> set[str]:
    """The requests whose blocks P's workers hold for a reader."""
    return {r for w in _workers(engine) for r in w["leases"]}


def _all_free(engine: Any) -> bool:
    return bool(ray.get(engine.all_blocks_free.remote(), timeout=CALL_S))


@pytest.mark.parametrize("length", [20, 45, 100])
def test_decode_tokens_equal_a_single_engine(engines: dict, length: int) -> None:
    p, d = engines["p"], engines["d"]
    ids = prompt(length, seed=100 + length)
    params = _prefill(p, ids)
    assert len(params["remote_block_ids"]) == -(-length // BLOCK)
    assert len(params["raydirect"]["regions"]) == 1
    got = _decode(d, ids, params)
    assert got == _alone(p, ids)
    # the KV was read, every block of it, not recomputed
    [read] = _reads(d, params["remote_request_id"])
    assert read["blocks"] == len(params["remote_block_ids"]) and read["bytes"] > 0


def test_the_kv_came_from_the_prefill_engine(engines: dict) -> None:
    """Q holds other weights than D: D decoding from Q's KV answers otherwise
    than D alone (which answers as P)."""
    d, q = engines["d"], engines["q"]
    ids = prompt(45, seed=200)
    params = _prefill(q, ids)
    mixed = _decode(d, ids, params)
    assert _reads(d, params["remote_request_id"]), "D read nothing from Q"
    assert mixed != _alone(engines["p"], ids)


def test_blocks_come_back_after_the_read(engines: dict) -> None:
    p, d = engines["p"], engines["d"]
    [before] = _workers(p)
    ids = prompt(100, seed=300)
    params = _prefill(p, ids)
    request = params["remote_request_id"]
    wait_for(lambda: request in _leases(p), timeout=5.0, what="P's worker holds the lease")
    assert not _all_free(p), "P freed the blocks before anyone read them"
    _decode(d, ids, params)
    wait_for(
        lambda: request not in _leases(p) and _all_free(p),
        timeout=5.0,
        what="P frees them on D's notice",
    )
    assert time.time() < params["raydirect"]["expires_at"] - 2.0, "freed by the lease, not D"
    [after] = _workers(p)
    assert after["expired"] == before["expired"]


def test_blocks_come_back_at_the_deadline(engines: dict) -> None:
    """Nobody reads: P frees the blocks when the lease ends, and a decode engine
    that comes after that prefills the prompt itself (never reads freed blocks)."""
    p, d = engines["p"], engines["d"]
    [before] = _workers(p)
    ids = prompt(45, seed=400)
    params = _prefill(p, ids)
    request, expires_at = params["remote_request_id"], params["raydirect"]["expires_at"]
    wait_for(lambda: request in _leases(p), timeout=5.0, what="P's worker holds the lease")
    assert not _all_free(p)
    wait_for(
        lambda: request not in _leases(p) and _all_free(p),
        timeout=LEASE_S + 10.0,
        what="P frees the blocks at the deadline",
    )
    assert time.time() >= expires_at
    [after] = _workers(p)
    assert after["expired"] == before["expired"] + 1
    assert _decode(d, ids, params) == _alone(p, ids)
    assert not _reads(d, request), "D read blocks after their lease ended"


def test_partial_prefix_hit_reads_only_the_tail(engines: dict) -> None:
    p, d = engines["p"], engines["d"]
    first = prompt(100, seed=500)
    params = _prefill(p, first)
    _decode(d, first, params)
    [whole] = _reads(d, params["remote_request_id"])
    assert whole["blocks"] == 4
    # the same first two blocks, then another tail: D's prefix cache has 64 tokens
    second = first[: 2 * BLOCK] + prompt(36, seed=501)
    params = _prefill(p, second)
    assert len(params["remote_block_ids"]) == 4
    got = _decode(d, second, params)
    [tail] = _reads(d, params["remote_request_id"])
    assert tail["blocks"] == 2 and tail["bytes"] * 2 == whole["bytes"]
    assert got == _alone(p, second)


@pytest.mark.parametrize(("length", "generated"), [(20, 40), (40, 30)])
def test_a_prefill_that_generated_more_tokens_hands_off_its_prompt_alone(
    engines: dict, length: int, generated: int
) -> None:
    """A prefill run past its first token holds those tokens' KV in blocks after
    the prompt's. It handed them all over, and D, mapping from the tail, read a
    generated-token block into a prompt block: other tokens, no error."""
    p, d = engines["p"], engines["d"]
    ids = prompt(length, seed=700 + length)
    tokens, params, _ = ray.get(
        p.generate_kv.remote(ids, generated, {"do_remote_decode": True}), timeout=CALL_S
    )
    assert len(tokens) == generated and params is not None
    params = json.loads(json.dumps(params))
    assert params["remote_num_tokens"] == length
    assert len(params["remote_block_ids"]) == -(-length // BLOCK)
    assert _decode(d, ids, params) == _alone(p, ids)
    [read] = _reads(d, params["remote_request_id"])
    assert read["blocks"] == len(params["remote_block_ids"])


BAD_PARAMS = {
    "block ids not integers": {"remote_block_ids": ["x", "y"]},
    "block id a bool": {"remote_block_ids": [True, 1]},
    "token count not an integer": {"remote_num_tokens": "abc"},
    "more tokens than blocks": {"remote_num_tokens": 10_000},
}


def test_malformed_params_are_prefilled_here_and_the_engine_lives(engines: dict) -> None:
    """kv_transfer_params come from a client: vLLM's standard fields, malformed,
    raised in D's scheduler (``int("x")``) and killed the engine (EngineDeadError
    for every request after). Now the request is prefilled here, and logged."""
    p, d = engines["p"], engines["d"]
    ids = prompt(45, seed=800)
    params = _prefill(p, ids)
    alone = _alone(p, ids)
    for what, change in BAD_PARAMS.items():
        tokens, _, reason = ray.get(
            d.generate_kv.remote(ids, NEW_TOKENS, {**params, **change}), timeout=CALL_S
        )
        assert (tokens, reason) == (alone, "length"), what
        assert not _reads(d, params["remote_request_id"]), what
    # the good params: D's prefix cache holds the prompt now, so it reads nothing
    # and tells P to free the blocks
    assert _decode(d, ids, params) == alone
    request = params["remote_request_id"]
    wait_for(lambda: request not in _leases(p), timeout=10.0, what="P frees on D's notice")


def test_a_hand_off_sent_twice_is_read_once(engines: dict) -> None:
    """The same kv_transfer_params twice (a client's retry): P freed the blocks on
    the first read's notice and may have reused them, so the second request must
    not read them; it was read again (D's prefix cache reset in between, as an
    eviction would)."""
    p, d = engines["p"], engines["d"]
    ids = prompt(45, seed=1000)
    params = _prefill(p, ids)
    alone = _alone(p, ids)
    assert _decode(d, ids, params) == alone
    request = params["remote_request_id"]
    wait_for(lambda: request not in _leases(p), timeout=10.0, what="P frees on D's notice")
    wait_for(lambda: _all_free(d), timeout=10.0, what="D's prefix cache reset")
    assert _decode(d, ids, params) == alone
    assert len(_reads(d, request)) == 1, "D read the hand-off twice"


def _claims(engine: Any) -> set[str]:
    """The prefill requests whose hand-off the engine's scheduler has claimed (D:
    its engine core runs in the actor's process, where ``collective_rpc`` runs)."""

    def read(_worker: Any) -> list[dict[str, Any]]:
        from raydirect.vllm import kv_connector

        return kv_connector.status()

    [[scheduler]] = ray.get(engine.collective_rpc.remote(read), timeout=CALL_S)
    return set(scheduler["claims"])


def test_each_claim_goes_when_its_own_lease_ends(engines: dict) -> None:
    """D keeps, per hand-off, the request that read it (a second would read
    blocks P freed), until the hand-off's lease ends. Claims were dropped from the
    oldest only, so one with a far expiry (a prefill engine with a long lease)
    kept every later one for ever, ~300 B a request."""
    p, d = engines["p"], engines["d"]
    far_ids = prompt(45, seed=1100)
    far = _resigned(_prefill(p, far_ids), expires_at=time.time() + 3000.0)
    assert _decode(d, far_ids, far) == _alone(p, far_ids)
    later = []
    for i in range(3):
        ids = prompt(45, seed=1101 + i)
        later.append(_prefill(p, ids))
        _decode(d, ids, later[-1])
    ids = {h["remote_request_id"] for h in later}
    assert ids <= _claims(d)
    ends = max(h["raydirect"]["expires_at"] for h in later)
    wait_for(lambda: time.time() > ends, timeout=LEASE_S + 10.0, what="their leases end")
    last_ids = prompt(45, seed=1104)
    last = _prefill(p, last_ids)
    _decode(d, last_ids, last)  # a claim: the ones whose lease ended go
    claims = _claims(d)
    assert {far["remote_request_id"], last["remote_request_id"]} <= claims
    assert not ids & claims, "claims past their lease were kept"


def _resigned(params: dict[str, Any], **section: Any) -> dict[str, Any]:
    """``params`` with ``section``'s values in their raydirect section, signed
    again with the cluster's key, as a prefill engine of this cluster would sign
    them (the driver is a member): a hand-off that is genuine but for what a
    test makes differ (another engine's fingerprint, another clock)."""
    from raydirect.vllm import kv_handoff

    changed = json.loads(json.dumps(params))
    changed["raydirect"].update(section)
    key = rd.cluster_secret(kv_handoff.KEY_PURPOSE)
    changed["raydirect"]["mac"] = kv_handoff._mac(changed, key)
    return changed


def _region(params: dict[str, Any]) -> rd.RegionHandle:
    return rd.RegionHandle.from_dict(params["raydirect"]["regions"][0])


def test_a_hand_off_steered_at_another_requests_blocks_is_not_read(engines: dict) -> None:
    """A client that edits one hand-off's block ids to another live one's made D
    read that other prompt's KV (its tokens, another tenant's) and cache it
    under this prompt's hashes. P signs what D reads by: the edit is refused,
    D computes the prompt, and the other hand-off still reads as it should."""
    p, d = engines["p"], engines["d"]
    mine, theirs = prompt(45, seed=1200), prompt(45, seed=1201)
    params, other = _prefill(p, mine), _prefill(p, theirs)
    steered = {**params, "remote_block_ids": other["remote_block_ids"]}
    assert _decode(d, mine, steered) == _alone(p, mine)
    assert not _reads(d, params["remote_request_id"]), "D read blocks a client picked"
    edited = json.loads(json.dumps(params))
    edited["raydirect"]["regions"][0]["nbytes"][0] *= 2  # a handle's extent, edited
    edited_ids = prompt(45, seed=1202)
    assert _decode(d, edited_ids, edited) == _alone(p, edited_ids)
    assert _decode(d, theirs, other) == _alone(p, theirs)
    assert _reads(d, other["remote_request_id"])


def test_a_forged_notice_frees_nothing(engines: dict) -> None:
    """Any notice naming a live request freed its blocks: its real decode then
    read reused blocks. Now a notice must carry the hand-off's secret (given only
    in its params): one without it, or with another, is counted and ignored."""
    p, d = engines["p"], engines["d"]
    ids = prompt(45, seed=1300)
    params = _prefill(p, ids)
    request = params["remote_request_id"]
    wait_for(lambda: request in _leases(p), timeout=5.0, what="P's worker holds the lease")
    [before] = _workers(p)
    rd.notify_region(_region(params), {"request": request}, timeout=10.0)
    rd.notify_region(_region(params), {"request": request, "seal": "0" * 32}, timeout=10.0)
    wait_for(lambda: _workers(p)[0]["forged"] > before["forged"], timeout=10.0, what="P sees it")
    assert request in _leases(p), "a forged notice freed the blocks"
    assert _decode(d, ids, params) == _alone(p, ids)
    [read] = _reads(d, request)
    assert read["blocks"] == len(params["remote_block_ids"])


def test_another_engines_kv_is_not_decoded(engines: dict) -> None:
    """Another dtype (or cache dtype, checkpoint, backend, vLLM) lays blocks out
    byte for byte alike: D decoded its KV as garbage. A hand-off, signed by an
    engine of the cluster, whose fingerprint differs from D's is computed here."""
    p, d = engines["p"], engines["d"]
    ids = prompt(45, seed=1400)
    params = _prefill(p, ids)
    fingerprint = {**params["raydirect"]["fingerprint"], "dtype": "torch.bfloat16"}
    other = _resigned(params, fingerprint=fingerprint)
    assert _decode(d, ids, other) == _alone(p, ids)
    assert not _reads(d, params["remote_request_id"]), "D read another engine's KV"


def test_a_read_of_blocks_p_freed_is_a_load_error(engines: dict) -> None:
    """P's clock ahead of D's: the hand-off's expiry, on D's clock, is later than
    P's own. D started reads of blocks P had freed and read them as good KV.
    Now P clears the hand-off's seal before vLLM frees the blocks, and D checks it
    after its read: the read is a load error (D recomputes here), never KV."""
    p, d = engines["p"], engines["d"]
    ids = prompt(45, seed=1500)
    params = _prefill(p, ids)
    request = params["remote_request_id"]
    skewed = _resigned(params, expires_at=params["raydirect"]["expires_at"] + 60.0)
    wait_for(
        lambda: request not in _leases(p) and _all_free(p),
        timeout=LEASE_S + 10.0,
        what="P frees the blocks at its lease's end",
    )
    assert _decode(d, ids, skewed) == _alone(p, ids)
    [worker] = _workers(d)
    assert request in worker["failed"], "D read freed blocks as good KV"
    assert not _reads(d, request)


def test_a_waiting_request_renews_its_lease(engines: dict) -> None:
    """A request queued on D past P's lease was prefilled on D though P held its
    KV. D renews the lease while its request waits (at once, then every third of
    it): renewed with the hand-off's secret, P holds the blocks past the lease."""
    p, d = engines["p"], engines["d"]
    ids = prompt(45, seed=1600)
    params = _prefill(p, ids)
    request, secret = params["remote_request_id"], params["raydirect"]["seal"][1]
    wait_for(lambda: request in _leases(p), timeout=5.0, what="P's worker holds the lease")
    [before] = _workers(p)
    ends = time.monotonic() + LEASE_S + 4.0
    while time.monotonic() < ends:
        rd.notify_region(_region(params), {"renew": [[request, secret]]}, timeout=10.0)
        assert request in _leases(p), "P freed blocks whose lease was renewed"
        time.sleep(LEASE_S / 3)  # pacing, as D's worker renews: nothing is waited for
    [after] = _workers(p)
    assert after["renewed"] >= before["renewed"] + 4 and request in after["leases"]
    assert time.time() > params["raydirect"]["expires_at"], "past the first expiry"
    # D's clock now says what the renewals did (they came from here, not from D)
    renewed = _resigned(params, expires_at=time.time() + LEASE_S)
    assert _decode(d, ids, renewed) == _alone(p, ids)
    [read] = _reads(d, request)
    assert read["blocks"] == len(params["remote_block_ids"])


def _kv_huge_bytes(_worker: Any) -> int:
    """Bytes of the worker's KV cache on transparent huge pages (its smaps)."""
    from raydirect.vllm import kv_worker

    [worker] = kv_worker._workers
    assert worker.layout is not None
    spans = [(t.data_ptr(), t.data_ptr() + t.numel()) for t in worker.layout.storages]
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if "-" in line.split(" ", 1)[0]:
                start, end = (int(x, 16) for x in line.split(" ", 1)[0].split("-"))
                inside = any(start < e and s < end for s, e in spans)
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1]) << 10
    return total


def test_huge_pages_false_leaves_the_cache_as_vllm_allocated_it(engines: dict) -> None:
    """``huge_pages`` in kv_connector_extra_config reaches the region's export:
    Q's cache (``false``) stays on 4 KiB pages, P's (the default) moved. Before,
    there was no knob, and an engine with a large CPU cache spent seconds in
    ``register_kv_caches`` collapsing it."""
    from raydirect import _huge_pages

    probe = torch.ones(4 << 20, dtype=torch.uint8)
    if not _huge_pages.collapse(probe.data_ptr(), probe.numel()):
        pytest.skip("this kernel cannot collapse memory onto huge pages")
    [moved] = ray.get(engines["p"].collective_rpc.remote(_kv_huge_bytes), timeout=CALL_S)
    [left] = ray.get(engines["q"].collective_rpc.remote(_kv_huge_bytes), timeout=CALL_S)
    assert moved >= 64 << 20, moved
    assert left < moved // 16, (left, moved)


def test_a_stopped_prefill_engine_holds_up_no_other_engines_reads(engines: dict) -> None:
    """Q is stopped (SIGSTOP) after its prefills; D reads Q's hand-offs (its memory
    stays readable) and P's in one batch. D's notices to Q wait out their timeout:
    sent from the read threads, they held them, and P's reads, queued behind,
    started after P's lease was over (and were recomputed)."""
    p, d, q = engines["p"], engines["d"], engines["q"]
    q_ids = [prompt(45, seed=900 + i) for i in range(4)]
    p_ids = [prompt(45, seed=950 + i) for i in range(2)]
    ask = {"do_remote_decode": True}
    q_params = ray.get(q.generate_kv_batch.remote([(i, 1, ask) for i in q_ids]), timeout=CALL_S)
    p_params = ray.get(p.generate_kv_batch.remote([(i, 1, ask) for i in p_ids]), timeout=CALL_S)
    handed = [json.loads(json.dumps(o[1])) for o in q_params + p_params]
    [pid] = ray.get(q.collective_rpc.remote(_pid), timeout=CALL_S)
    os.kill(pid, signal.SIGSTOP)
    try:
        batch = [(i, NEW_TOKENS, h) for i, h in zip(q_ids + p_ids, handed, strict=True)]
        outs = ray.get(d.generate_kv_batch.remote(batch), timeout=CALL_S)
    finally:
        os.kill(pid, signal.SIGCONT)
    [worker] = _workers(d)
    read = {r["remote"] for r in worker["reads"]}
    for h in handed:
        assert h["remote_request_id"] in read, "a hand-off was recomputed, not read"
        assert h["remote_request_id"] not in worker["failed"]
    assert [o[0] for o in outs[4:]] == [_alone(p, i) for i in p_ids]


def test_prefill_engine_killed_before_the_read(engines: dict) -> None:
    """Q's worker (which holds its region) dies after the prefill: D's read fails
    at once, and D (``kv_load_failure_policy="recompute"``) recomputes the prompt
    and answers as a single engine on its own weights, within a deadline."""
    d, q = engines["d"], engines["q"]
    ids = prompt(45, seed=600)
    params = _prefill(q, ids)
    [pid] = ray.get(q.collective_rpc.remote(_pid), timeout=CALL_S)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not _alive(pid), timeout=30.0, what="Q's engine core exits")
    started = time.monotonic()
    got = _decode(d, ids, params)
    assert time.monotonic() - started < 60.0
    assert got == _alone(engines["p"], ids)
    [worker] = _workers(d)
    assert params["remote_request_id"] in worker["failed"]


def _pid(_worker: Any) -> int:
    return os.getpid()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_workers_join_ray_on_their_engines_node(engines: dict) -> None:
    """The engine (an ``LLM`` in a Ray actor) names its node to the processes vLLM
    starts, and its worker joins Ray as a process of that node (where several Ray
    nodes share one process table Ray alone picks the head's raylet:
    test_kv_multinode.py runs that case)."""
    [(named, joined)] = ray.get(engines["p"].collective_rpc.remote(_node), timeout=CALL_S)
    assert named == joined == ray.util.get_node_ip_address()


def test_an_inherited_node_is_replaced_by_the_processs_own(ray_session: None) -> None:
    """A process that inherited another node's address (CI: the test process had
    exported its own, and a multi-node driver started from it passed it on to
    engines on other nodes, whose workers then failed to join) exports its own."""
    before = os.environ.get(NODE_IP)
    os.environ[NODE_IP] = "192.0.2.250"  # TEST-NET-1: no node of this cluster
    try:
        export_ray_context()
        assert os.environ[NODE_IP] == ray.util.get_node_ip_address()
    finally:
        if before is None:
            os.environ.pop(NODE_IP, None)
        else:
            os.environ[NODE_IP] = before


def _node(_worker: Any) -> tuple[str | None, str]:
    return os.environ.get(NODE_IP), ray.util.get_node_ip_address()


def test_the_plugin_registers_the_connector() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    import raydirect.vllm  # noqa: F401 - registers, as the entry point does
    from raydirect.vllm.kv_connector import RaydirectConnector

    assert (
        KVConnectorFactory.get_connector_class_by_name("RaydirectConnector") is RaydirectConnector
    )
    raydirect.vllm.register()  # idempotent


@pytest.fixture(scope="module")
def tp2_engines(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A prefill and a decode engine at tensor parallel 2 (two workers each, one
    core per worker), on the same weights."""
    path = Path(tmp_path_factory.mktemp("llama-tp2"))
    save_llama(path, seed=0)
    actors = {
        name: Engine.remote(  # type: ignore[attr-defined]
            str(path),
            kv_transfer_config=_connector(),  # the default lease: 2 shared cores, 4 workers
            block_size=BLOCK,
            tensor_parallel_size=2,
        )
        for name in ("p", "d")
    }
    with _running(actors):
        yield actors


def test_tensor_parallel_2_on_both_sides(tp2_engines: dict) -> None:
    """Each of D's ranks reads its own heads from P's rank of the same number;
    P's ranks each free on their own notice."""
    p, d = tp2_engines["p"], tp2_engines["d"]
    ids = prompt(100, seed=700)
    params = _prefill(p, ids)
    assert len(params["raydirect"]["regions"]) == 2 and params["tp_size"] == 2
    request = params["remote_request_id"]
    wait_for(
        lambda: all(request in w["leases"] for w in _workers(p)),
        timeout=20.0,
        what="P's ranks hold the lease",
    )
    got = _decode(d, ids, params)
    reads = [[r for r in w["reads"] if r["remote"] == request] for w in _workers(d)]
    assert [len(r) for r in reads] == [1, 1], reads
    assert all(r[0]["blocks"] == 4 and r[0]["bytes"] > 0 for r in reads)
    assert reads[0][0]["bytes"] == reads[1][0]["bytes"]
    wait_for(
        lambda: all(not w["leases"] for w in _workers(p)),
        timeout=20.0,
        what="P's ranks free on the notices",
    )
    assert [w["expired"] for w in _workers(p)] == [0, 0]
    assert got == _alone(p, ids)


def test_tensor_parallel_2_prefill_killed_fails_clearly(tp2_engines: dict) -> None:
    """P's workers die after the prefill: D's ranks fail their reads at once, and
    D (vLLM's default ``kv_load_failure_policy="fail"``) ends the request with an
    error, within a deadline, with no token. The last test of P: it kills it."""
    p, d = tp2_engines["p"], tp2_engines["d"]
    ids = prompt(45, seed=800)
    params = _prefill(p, ids)
    pids = ray.get(p.collective_rpc.remote(_pid), timeout=CALL_S)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not any(_alive(pid) for pid in pids), timeout=30.0, what="P's workers exit")
    started = time.monotonic()
    tokens, _, reason = ray.get(d.generate_kv.remote(ids, NEW_TOKENS, params), timeout=CALL_S)
    assert time.monotonic() - started < 60.0
    assert (tokens, reason) == ([], "error")
    assert all(params["remote_request_id"] in w["failed"] for w in _workers(d))


def _scheduler_config(extra: dict[str, Any]) -> Any:
    """What ``KVScheduler`` reads of an engine's config, with vLLM's own
    ``KVTransferConfig`` built from JSON text, as ``--kv-transfer-config`` is."""
    from vllm.config import KVTransferConfig

    text = json.dumps({"kv_connector": "RaydirectConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": extra})  # fmt: skip
    return SimpleNamespace(
        kv_transfer_config=KVTransferConfig(**json.loads(text)),
        cache_config=SimpleNamespace(block_size=BLOCK),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )


@pytest.mark.parametrize(
    "lease",
    [
        1.0,
        0.8,
        0,
        -5,
        "30",
        True,
        None,
        float("nan"),
        float("inf"),
        -float("inf"),
        3601,
        pytest.param(10**400, id="400-digits"),
    ],  # fmt: skip
)
def test_a_lease_too_short_to_read_is_refused_at_start(lease: Any) -> None:
    """A lease no longer than the decode side's read margin ended before any
    decode engine could read: every hand-off was silently prefilled again. A NaN
    (JSON's ``NaN``) or infinite one passed, and P never freed unread blocks; a
    400-digit one raised OverflowError; none longer than an hour is taken."""
    from raydirect.vllm.kv_connector import KVScheduler

    with pytest.raises(ValueError, match=r"kv_lease_duration=.*above 1\.0 and at most 3600"):
        KVScheduler(_scheduler_config({"kv_lease_duration": lease}))
    assert KVScheduler(_scheduler_config({"kv_lease_duration": 1.5})).lease_s == 1.5
    assert KVScheduler(_scheduler_config({"kv_lease_duration": 3600})).lease_s == 3600


@pytest.mark.parametrize("value", ["false", 0, 1, None, "yes"])
def test_huge_pages_other_than_true_or_false_is_refused_at_start(value: Any) -> None:
    from raydirect.vllm.kv_connector import KVScheduler

    with pytest.raises(ValueError, match=r"huge_pages=.*write true .* or false"):
        KVScheduler(_scheduler_config({"huge_pages": value}))
    KVScheduler(_scheduler_config({"huge_pages": False}))


def test_notices_for_leases_not_held_are_counted_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Any holder of P's region handle may send notices: ones naming leases the
    worker does not hold (late, or forged) were kept silently, without bound
    while they came faster than they aged out. Now at most ``MAX_NOTICES`` wait,
    the oldest go first, counted, and the first is logged."""
    from raydirect.vllm import kv_worker

    worker = kv_worker.KVWorker(num_blocks=4, rank=0, tp_size=1)
    try:
        with caplog.at_level("WARNING", logger=kv_worker.__name__):
            for i in range(kv_worker.MAX_NOTICES + 10):
                worker._on_notice({"request": f"forged-{i}", "seal": "0" * 32})
            worker._on_notice({"request": "x" * 100_000})  # not a request id: ignored
            worker._on_notice({"request": 7})
        assert worker.status()["strays"] == 10
        lines = [r for r in caplog.records if "does not hold" in r.getMessage()]
        assert len(lines) == 1 and "forged-0" in lines[0].getMessage()
        assert worker.results() == (set(), set())
    finally:
        worker.shutdown()
