"""``RaydirectConnector`` over HTTP: a prefill (P) and a decode (D) server, each
``python -m vllm.entrypoints.openai.api_server`` with ``--kv-transfer-config
'{"kv_connector": "RaydirectConnector", "kv_role": "kv_both"}'``, and the proxy
of examples/vllm_pd_http.py in front of them, run as its users run it.

What proves the hand-off, as the servers are no Ray actors whose connector state
the test could read: raydirect's own counters (``raydirect status``, every
process that moves bytes with raydirect answers it): D's processes received the
prompt's KV, exactly, in one read over ``cma``; and D's tokens equal a single
engine's (P's, alone). P's blocks come back: its ``/reset_prefix_cache`` (dev
mode) succeeds only once every block is back in its pool."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from vllm_harness import TINY_LLAMA, prompt, save_tokenizer, words
from vllm_servers import ApiServer, api_servers, group_members

from raydirect import _status

from helpers import free_port, wait_for

PROXY = Path(__file__).resolve().parents[2] / "examples" / "vllm_pd_http.py"
BLOCK = 32  # the CPU attention's block sizes are multiples of 32
# P's lease on blocks nobody read: longer than every wait here, so blocks that
# come back before it came back on D's notice
LEASE_S = 60.0
NEW_TOKENS = 8
CALL_S = 120.0  # one request, at most (2 shared cores)
HEAD_DIM = TINY_LLAMA["hidden_size"] // TINY_LLAMA["num_attention_heads"]
# One block of the prompt's KV, every layer: K and V of each KV head, float32.
BLOCK_BYTES = (
    TINY_LLAMA["num_hidden_layers"] * TINY_LLAMA["num_key_value_heads"] * BLOCK * 2 * HEAD_DIM * 4
)


def _kv_config(**extra: Any) -> str:
    config = {"kv_connector": "RaydirectConnector", "kv_role": "kv_both"}
    if extra:
        config["kv_connector_extra_config"] = extra
    return json.dumps(config)


@pytest.fixture(scope="module")
def servers(
    ray_session: None, tiny_llama: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ApiServer]]:
    """P and D on the same weights, started together, each computing on a core of
    its own; P in dev mode (``/reset_prefix_cache``)."""
    logs = tmp_path_factory.mktemp("pd-servers")
    save_tokenizer(tiny_llama[0])  # for the chat API; token ids work as well
    common = ("--block-size", str(BLOCK))
    p = ApiServer(
        tiny_llama[0],
        logs / "prefill.log",
        *common,
        "--kv-transfer-config",
        _kv_config(kv_lease_duration=LEASE_S),
        env={"VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_SERVER_DEV_MODE": "1"},
        tokenizer=True,
    )
    d = ApiServer(
        tiny_llama[0],
        logs / "decode.log",
        *common,
        "--kv-transfer-config",
        _kv_config(),
        env={"VLLM_CPU_OMP_THREADS_BIND": "1"},
        tokenizer=True,
    )
    with api_servers(p, d):
        yield {"p": p, "d": d}


@pytest.fixture(scope="module")
def proxy(servers: dict[str, ApiServer]) -> Iterator[str]:
    """examples/vllm_pd_http.py in front of P and D, as a process of its own."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, str(PROXY), "--prefill", servers["p"].url,
               "--decode", servers["d"].url, "--port", str(port)]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: _answers(proc, url), timeout=30.0, what="the proxy")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _answers(proc: subprocess.Popen, url: str) -> bool:
    """The proxy relays D's /health."""
    assert proc.poll() is None, proc.communicate()[0]
    try:
        return requests.get(f"{url}/health", timeout=2).ok
    except requests.ConnectionError:
        return False


def _complete(url: str, ids: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {"model": _model(url), "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, **extra}  # fmt: skip
    reply = requests.post(f"{url}/v1/completions", json=body, timeout=CALL_S)
    assert reply.ok, reply.text
    return reply.json()


def _model(url: str) -> str:
    return requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def _tokens(reply: dict[str, Any]) -> list[int]:
    return list(reply["choices"][0]["token_ids"])


def _alone(servers: dict[str, ApiServer], ids: list[int]) -> list[int]:
    """A single engine's greedy tokens: P, prefilling and decoding itself."""
    return _tokens(_complete(servers["p"].url, ids, NEW_TOKENS))


def _received(server: ApiServer) -> tuple[dict[str, int], dict[str, int]]:
    """What the server's processes received through raydirect so far, by
    transport: (reads, bytes), summed over the processes of its group."""
    members = set(group_members(server.proc.pid))
    reads: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    for row in _status.collect().processes:
        if int(row["pid"]) in members and row.get("stats"):
            for name, count in row["stats"]["objects_received"].items():
                reads[name] = reads.get(name, 0) + count
            for name, count in row["stats"]["bytes_received"].items():
                nbytes[name] = nbytes.get(name, 0) + count
    return reads, nbytes


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def _all_free(server: ApiServer) -> bool:
    """Every KV block back in the server's pool (vLLM resets the prefix cache only
    then; resetting it is harmless here)."""
    reply = requests.post(f"{server.url}/reset_prefix_cache", timeout=CALL_S)
    reply.raise_for_status()
    return bool(reply.json()["success"])


@pytest.mark.parametrize("length", [20, 100])
def test_decode_through_the_proxy_equals_a_single_engine(
    servers: dict[str, ApiServer], proxy: str, length: int
) -> None:
    ids = prompt(length, seed=900 + length)
    reads, nbytes = _received(servers["d"])
    got = _tokens(_complete(proxy, ids, NEW_TOKENS))
    after_reads, after_bytes = _received(servers["d"])
    # D read the prompt's KV from P, every block of it, in one read: not recomputed
    assert _delta(after_reads, reads) == {"cma": 2}  # the blocks, then the seal word
    assert _delta(after_bytes, nbytes) == {"cma": -(-length // BLOCK) * BLOCK_BYTES + 8}
    assert got == _alone(servers, ids)
    wait_for(lambda: _all_free(servers["p"]), timeout=10.0, what="P frees the blocks")


def test_a_chat_through_the_proxy_equals_a_single_engine(
    servers: dict[str, ApiServer], proxy: str
) -> None:
    """``/v1/chat/completions``: P prefills the templated conversation and D, having
    read its KV in one ``cma`` read, answers what P alone answers."""
    messages = [{"role": "user", "content": words(prompt(60, seed=960))}]
    body = {"model": _model(proxy), "messages": messages, "max_tokens": NEW_TOKENS,
            "temperature": 0.0, "ignore_eos": True}  # fmt: skip
    reads, _ = _received(servers["d"])
    through = requests.post(f"{proxy}/v1/chat/completions", json=body, timeout=CALL_S)
    assert through.ok, through.text
    assert _delta(_received(servers["d"])[0], reads) == {"cma": 2}  # the blocks, then the seal word
    alone = requests.post(f"{servers['p'].url}/v1/chat/completions", json=body, timeout=CALL_S)
    assert alone.ok, alone.text
    said = [r.json()["choices"][0]["message"]["content"] for r in (through, alone)]
    assert said[0] == said[1] and len(said[0].split()) == NEW_TOKENS, said


def test_a_stream_through_the_proxy(servers: dict[str, ApiServer], proxy: str) -> None:
    """A client that asks for a stream gets D's, chunk by chunk."""
    ids = prompt(45, seed=950)
    body = {"model": _model(proxy), "prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "stream": True}  # fmt: skip
    tokens: list[int] = []
    events = 0
    with requests.post(f"{proxy}/v1/completions", json=body, stream=True, timeout=CALL_S) as r:
        assert r.ok and r.headers["Content-Type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                events += 1
                tokens += json.loads(line[len(b"data: ") :])["choices"][0]["token_ids"] or []
    assert events >= 2 and tokens == _alone(servers, ids)


def test_blocks_come_back_after_the_read(servers: dict[str, ApiServer]) -> None:
    """The proxy's two requests by hand: P holds the prompt's blocks until D has
    read them, and frees them on D's notice, long before its lease ends."""
    p, d = servers["p"], servers["d"]
    ids = prompt(100, seed=960)
    prefilled = _complete(p.url, ids, 1, kv_transfer_params={"do_remote_decode": True})
    params = prefilled["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and len(params["remote_block_ids"]) == 4
    assert not _all_free(p), "P freed the blocks before anyone read them"
    got = _tokens(_complete(d.url, ids, NEW_TOKENS, kv_transfer_params=params))
    wait_for(lambda: _all_free(p), timeout=10.0, what="P frees the blocks on D's notice")
    assert time.time() < params["raydirect"]["expires_at"] - 2.0, "freed by the lease, not D"
    assert got == _alone(servers, ids)


def test_a_prefill_error_reaches_the_client(proxy: str) -> None:
    """P refuses (no such model): the client gets P's error as P sent it."""
    body = {"model": "no-such-model", "prompt": [1, 2, 3], "max_tokens": 4}
    reply = requests.post(f"{proxy}/v1/completions", json=body, timeout=CALL_S)
    assert reply.status_code == 404 and "no-such-model" in reply.text


# A client's numbers, as JSON carries them to D: FastAPI reads 1e999 as infinity
# and keeps an integer of any length; vLLM 0.32 refuses those beyond 64 bits
# itself (its engine's MessagePack carries no more), so 2**64 - 1 is the largest
# that reaches the connector. (path in kv_transfer_params, literal, field)
FORGED = {
    "a layout offset of 1e999": (("raydirect", "layout", 0, 1), "1e999", "raydirect.layout"),
    "a block stride of 2**64-1": (
        ("raydirect", "layout", 0, 2),
        str(2**64 - 1),
        "raydirect.layout",
    ),
    "an expires_at of 2**64-1": (
        ("raydirect", "expires_at"),
        str(2**64 - 1),
        "raydirect.expires_at",
    ),
    "an expires_at of 1e999": (("raydirect", "expires_at"), "1e999", "raydirect.expires_at"),
}


def _forged_body(
    url: str, ids: list[int], params: dict[str, Any], path: tuple, literal: str
) -> str:
    """A completion request with ``params`` whose value at ``path`` (an int: the
    layout's n-th layer) is ``literal``, written as JSON text: Python's json
    writes no 1e999."""
    forged = json.loads(json.dumps(params))
    *outer, last = path
    place = forged
    for key in outer:
        place = place[list(place)[key]] if isinstance(key, int) else place[key]
    place[last] = "__forged__"
    body = {"model": _model(url), "prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "kv_transfer_params": forged}  # fmt: skip
    return json.dumps(body).replace('"__forged__"', literal)


def _post_raw(url: str, body: str) -> requests.Response:
    headers = {"Content-Type": "application/json"}
    return requests.post(f"{url}/v1/completions", data=body, headers=headers, timeout=CALL_S)


def _logged(server: ApiServer, since: int) -> list[str]:
    """The connector's lines in the server's log after byte ``since``."""
    text = server.log.read_bytes()[since:].decode(errors="replace")
    return [line for line in text.splitlines() if "RaydirectConnector" in line]


def test_forged_numbers_end_their_request_alone_and_d_serves_on(
    servers: dict[str, ApiServer], proxy: str
) -> None:
    """Each forged value is refused naming its field, in one line, and its request
    prefilled on D (the right tokens; nothing read from P). Before, ``int(inf)``
    raised OverflowError in D's scheduler, which killed its engine core, as did
    the same params on a request vLLM rejected (too long a prompt: its abort runs
    the connector too); a stride of 2**64-1 failed the read (numpy's int64), so
    the request ended in an error; an expiry of 1e999 or 2**64-1 read with no
    deadline. D then serves the next hand-off, read from P as before."""
    p, d = servers["p"], servers["d"]
    ids = prompt(45, seed=970)
    params = _complete(p.url, ids, 1, kv_transfer_params={"do_remote_decode": True})[
        "kv_transfer_params"
    ]
    alone = _alone(servers, ids)
    for what, (path, literal, field) in FORGED.items():
        since, (reads, _) = d.log.stat().st_size, _received(d)
        reply = _post_raw(d.url, _forged_body(d.url, ids, params, path, literal))
        assert reply.ok, f"{what}: {reply.status_code} {reply.text[:300]}"
        assert _tokens(reply.json()) == alone, what
        assert _delta(_received(d)[0], reads) == {}, f"{what}: D read P's blocks"
        wait_for(lambda: _logged(d, since), timeout=10.0, what=f"D's line on {what}")  # noqa: B023
        [line] = _logged(d, since)
        assert field in line, line
    reply = _post_raw(
        d.url, _forged_body(d.url, ids, params, ("raydirect", "expires_at"), "9" * 400)
    )
    assert reply.status_code == 400 and "2**64" in reply.text, reply.text[:300]  # vLLM's own
    since = d.log.stat().st_size
    too_long = prompt(200, seed=971)  # beyond --max-model-len: refused before it runs
    reply = _post_raw(
        d.url, _forged_body(d.url, too_long, params, *FORGED["a layout offset of 1e999"][:2])
    )
    assert reply.status_code == 400, reply.text[:300]
    wait_for(lambda: _logged(d, since), timeout=10.0, what="D's line on the rejected request")
    assert "raydirect.layout" in _logged(d, since)[0]
    # D lives: a new hand-off through the proxy is read from P, in one read
    fresh = prompt(100, seed=972)
    reads, _ = _received(d)
    assert _tokens(_complete(proxy, fresh, NEW_TOKENS)) == _alone(servers, fresh)
    assert _delta(_received(d)[0], reads) == {"cma": 2}  # the blocks, then the seal word
    # the genuine params at last: D reads what its prefix cache lacks, and P frees
    assert _tokens(_complete(d.url, ids, NEW_TOKENS, kv_transfer_params=params)) == alone
    wait_for(lambda: _all_free(p), timeout=10.0, what="P frees the blocks")
