"""A canned vLLM stand-in for proxy-bound benchmarks: ``python -m bench.null_engine``.

It answers every generation request at once with the same small completion (a prefill's
with NIXL ``kv_transfer_params``, which the proxy forwards to the decode), ``/health`` and
``/v1/models`` as vLLM does, and ``/metrics`` with vLLM's three load gauges at 0. It parses
only the request line and ``content-length`` and writes one pre-encoded answer per request
on a raw asyncio protocol: about a tenth of a sim's CPU per request, so the proxy in front of
it is what saturates the machine. For anything closer to an engine use the sim
(``engines/sim``).

A request whose body asks for ``"stream":true`` (as pdproxy serialises a decode leg: compact
JSON) is answered with ``--stream-tokens`` SSE chunks, the first at once and the others
``1 / --stream-tps`` seconds apart (timers on the loop, no task per stream): the paced
streams of ``bench.workers``' streaming phase at a few microseconds of CPU per chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import cast

import orjson

MODEL = "sim-model"


def _response(status: str, body: bytes, kind: bytes = b"application/json") -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: {kind.decode()}\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _completion(role: str) -> bytes:
    answer: dict[str, object] = {
        "id": "cmpl-null",
        "object": "text_completion",
        "created": int(time.time()),
        "model": MODEL,
        "choices": [{"index": 0, "text": " the quick brown fox", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 8, "total_tokens": 48},
    }
    if role == "prefill":
        answer["kv_transfer_params"] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [1, 2, 3],
            "remote_engine_id": "null-prefill",
            "remote_host": "127.0.0.1",
            "remote_port": 1,
            "tp_size": 1,
        }
    return orjson.dumps(answer)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _stream_chunks(tokens: int) -> tuple[bytes, bytes, bytes]:
    """The stream's head with its first token, each further token, and the last token with
    the end of the stream (chunked transfer coding, as vLLM's uvicorn sends it)."""

    def event(finish: str | None) -> bytes:
        choice = {"index": 0, "text": " fox", "logprobs": None, "finish_reason": finish}
        body = {"id": "cmpl-null", "object": "text_completion", "created": 0, "model": MODEL}
        return b"data: " + orjson.dumps({**body, "choices": [choice]}) + b"\n\n"

    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    last = event("length") if tokens > 1 else b""
    end = _chunk(last + b"data: [DONE]\n\n") + b"0\r\n\r\n"
    return head + _chunk(event(None if tokens > 1 else "length")), _chunk(event(None)), end


class _Answers:
    def __init__(self, role: str, stream_tokens: int = 16, stream_tps: float = 200.0) -> None:
        self.stream_head, self.stream_token, self.stream_end = _stream_chunks(stream_tokens)
        self.stream_tokens = stream_tokens
        self.stream_interval = 1 / stream_tps
        models = {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
        metrics = (
            b'vllm:num_requests_running{engine="0"} 0\n'
            b'vllm:num_requests_waiting{engine="0"} 0\n'
            b'vllm:kv_cache_usage_perc{engine="0"} 0\n'
        )
        self.by_path = {
            b"/health": _response("200 OK", b""),
            b"/v1/models": _response("200 OK", orjson.dumps(models)),
            b"/metrics": _response("200 OK", metrics, b"text/plain; version=0.0.4"),
        }
        self.generation = _response("200 OK", _completion(role))
        self.not_found = _response("404 Not Found", b'{"error": "not found"}')

    def answer(self, method: bytes, path: bytes) -> bytes:
        if method == b"POST":
            return self.generation
        return self.by_path.get(path.split(b"?", 1)[0], self.not_found)


class _Connection(asyncio.Protocol):
    def __init__(self, answers: _Answers) -> None:
        self._answers = answers
        self._buffer = b""
        self._transport: asyncio.WriteTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.WriteTransport, transport)  # uvloop's: no subclass

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while (end := self._buffer.find(b"\r\n\r\n")) >= 0:
            head = self._buffer[:end]
            length = 0
            for line in head.split(b"\r\n")[1:]:
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            if len(self._buffer) < end + 4 + length:
                return  # the body is still arriving
            body = self._buffer[end + 4 : end + 4 + length]
            self._buffer = self._buffer[end + 4 + length :]
            method, path = head.split(b" ", 2)[:2]
            assert self._transport is not None
            if method == b"POST" and b'"stream":true' in body:
                self._stream(self._answers.stream_tokens)
            else:
                self._transport.write(self._answers.answer(method, path))

    def _stream(self, left: int) -> None:
        """One paced stream: the head and first token now, a token per interval after."""
        transport, answers = self._transport, self._answers
        assert transport is not None
        if left == answers.stream_tokens:
            transport.write(answers.stream_head)
            if left == 1:  # a one-token stream: its only token was the first
                transport.write(answers.stream_end)
                return
        elif transport.is_closing():
            return  # the proxy went away (its client did): no more tokens
        elif left == 1:
            transport.write(answers.stream_end)
            return
        else:
            transport.write(answers.stream_token)
        asyncio.get_running_loop().call_later(answers.stream_interval, self._stream, left - 1)


async def serve(port: int, role: str, stream_tokens: int = 16, stream_tps: float = 200.0) -> None:
    answers = _Answers(role, stream_tokens, stream_tps)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Connection(answers), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--role", choices=("prefill", "decode"), required=True)
    parser.add_argument("--stream-tokens", type=int, default=16, help="tokens per stream")
    parser.add_argument("--stream-tps", type=float, default=200.0, help="tokens/s per stream")
    args = parser.parse_args()
    main = serve(args.port, args.role, args.stream_tokens, args.stream_tps)
    try:
        import uvloop

        uvloop.run(main)
    except ImportError:
        asyncio.run(main)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
