"""One streaming `/v1/completions` call to an OpenAI-compatible server: the seconds to its first
SSE data chunk and every chunk it sent (the benchmarks' TTFT)."""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse


def stream_completion_chunks(url: str, body: dict, timeout_s: float) -> tuple[float, list[dict]]:
    """(seconds to the first `data:` line, the decoded chunks before `[DONE]`) of a streaming
    completion with `body` (its `stream` is set here); an HTTP error or an empty stream raises."""
    address = urllib.parse.urlsplit(url)
    assert address.hostname is not None, f"not a server URL: {url}"
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=timeout_s)
    try:
        start = time.perf_counter()
        connection.request("POST", "/v1/completions", body=json.dumps(dict(body, stream=True)),
                           headers={"Content-Type": "application/json"})
        reply = connection.getresponse()
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {reply.read()[:500]!r}")
        ttft_s, chunks = None, []
        for line in reply:
            if not line.startswith(b"data:"):
                continue
            if ttft_s is None:
                ttft_s = time.perf_counter() - start
            data = line[len(b"data:"):].strip()
            if data == b"[DONE]":
                break
            chunks.append(json.loads(data))
        if ttft_s is None:
            raise RuntimeError("the stream ended without a data chunk")
        return ttft_s, chunks
    finally:
        connection.close()
