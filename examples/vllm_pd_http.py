"""Disaggregated prefill and decode over HTTP: a small proxy in front of two vLLM
OpenAI servers whose KV caches ``RaydirectConnector`` hands over.

For each ``POST /v1/completions`` or ``/v1/chat/completions`` a client sends it,
the proxy

1. sends the request to the prefill server with ``max_tokens=1``, no streaming
   and ``kv_transfer_params={"do_remote_decode": true}`` (vLLM's standard P/D
   protocol, as vLLM's own proxies send it);
2. takes the ``kv_transfer_params`` the prefill server answers with (the region
   handle and block ids of the prompt's KV, JSON) and sends the client's request
   as it came, plus those params, to the decode server, which reads the blocks
   straight from the prefill server's memory and generates;
3. answers with the decode server's reply, streamed through if the client asked
   for a stream.

Other requests (``GET /v1/models``, ``/health``) go to the decode server. Stdlib
only; one thread per request.

Run it (one machine; across machines, ``ray start`` on each and the servers'
addresses)::

    ray start --head
    KV='{"kv_connector": "RaydirectConnector", "kv_role": "kv_both"}'
    RAY_ADDRESS=auto python -m vllm.entrypoints.openai.api_server --model M \\
        --port 8100 --kv-transfer-config "$KV" &          # prefill
    RAY_ADDRESS=auto python -m vllm.entrypoints.openai.api_server --model M \\
        --port 8200 --kv-transfer-config "$KV" &          # decode
    python examples/vllm_pd_http.py --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "M", "prompt": "The capital of France is", "max_tokens": 16}'

(``python -m vllm.entrypoints.openai.api_server``: the ``vllm serve`` command
of the CPU build fails here.) See docs/kv-transfer.md, "Over HTTP".
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

GENERATING = ("/v1/completions", "/v1/chat/completions")
TIMEOUT_S = 600.0  # one request to a server, at most
# What vLLM's own P/D proxies send the prefill engine: decode happens elsewhere.
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request for the prefill server: one token, no stream, P/D params."""
    request = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}
    if "max_completion_tokens" in request:  # the chat API's other name for it
        request["max_completion_tokens"] = 1
    request.pop("stream_options", None)
    return request


def _open(url: str, body: dict[str, Any] | None = None) -> Any:
    """``url`` answered (GET, or POST of ``body`` as JSON); an HTTP error status is
    an answer too (``urllib.error.HTTPError`` is a response)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        return urllib.request.urlopen(request, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as error:
        return error


class Proxy(ThreadingHTTPServer):
    """The proxy's server: the prefill and decode servers' base URLs."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], prefill: str, decode: str) -> None:
        super().__init__(address, Handler)
        self.prefill, self.decode = prefill.rstrip("/"), decode.rstrip("/")


class Handler(BaseHTTPRequestHandler):
    server: Proxy

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._answer(lambda: self._relay(_open(self.server.decode + self.path)))

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._answer(lambda: self._forward(json.loads(body or b"{}")))

    def _answer(self, handle: Callable[[], None]) -> None:
        """``handle()``; a server that cannot be reached is the client's 502."""
        try:
            handle()
        except urllib.error.URLError as error:
            self.send_error(502, f"a server behind the proxy: {error.reason}")

    def _forward(self, body: dict[str, Any]) -> None:
        if self.path not in GENERATING:
            self._relay(_open(self.server.decode + self.path, body))
            return
        prefilled = _open(self.server.prefill + self.path, prefill_body(body))
        if prefilled.status != 200:  # the prefill server's error, to the client
            self._relay(prefilled)
            return
        params = json.loads(prefilled.read()).get("kv_transfer_params")
        self._relay(_open(self.server.decode + self.path, {**body, "kv_transfer_params": params}))

    def _relay(self, response: Any) -> None:
        """``response`` to the client as it arrives (a stream stays one)."""
        self.send_response(response.status)
        self.send_header("Content-Type", response.headers.get("Content-Type", "application/json"))
        self.end_headers()  # no length: HTTP/1.0, the body ends when the connection does
        with response:
            while chunk := response.read1(1 << 16):
                self.wfile.write(chunk)
                self.wfile.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="the prefill server's URL")
    parser.add_argument("--decode", required=True, help="the decode server's URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port")
    args = parser.parse_args()
    with Proxy((args.host, args.port), args.prefill, args.decode) as proxy:
        print(f"proxy listening on http://{args.host}:{proxy.server_port}", flush=True)
        proxy.serve_forever()


if __name__ == "__main__":
    main()
