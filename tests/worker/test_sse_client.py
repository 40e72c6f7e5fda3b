"""The bridge's streaming client (``worker/sglang/sse_client.py``) against a raw TCP server
that writes exactly the bytes each case needs: events across any chunk and packet split, an
error status with its body and ``Retry-After``, connections reused after a whole response and
dropped after a hang-up, a server that closes mid-stream or answers garbage, an event the
bridge cannot read — and a connection that serves the next call before the last caller's
``hang_up`` ran."""

from __future__ import annotations

import asyncio
import json

import pytest

from sgl_fair.worker.sglang.sse_client import Pool


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def sse(*payloads: bytes) -> bytes:
    return b"".join(b"data: " + p + b"\n\n" for p in payloads)


HEAD_200 = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


class Server:
    """Answers each request on a connection with the next of ``answers`` (bytes, sent in
    ``split``-byte writes); records the requests and the connections they came on."""

    def __init__(self, answers: list[bytes], split: int = 7, close_after: bool = False):
        self.answers = list(answers)
        self.split = split
        self.close_after = close_after
        self.requests: list[tuple[int, bytes, bytes]] = []  # (connection, head, body)
        self.conns = 0
        self.closed = asyncio.Event()

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.conns += 1
        me = self.conns
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(h.split(b":")[1] for h in head.split(b"\r\n")
                                  if h.lower().startswith(b"content-length")))  # fmt: skip
                body = await reader.readexactly(length)
                self.requests.append((me, head, body))
                data = self.answers.pop(0)
                for i in range(0, len(data), self.split):
                    writer.write(data[i : i + self.split])
                    await writer.drain()
                    await asyncio.sleep(0)
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self.closed.set()


async def _post(pool: Pool, body: dict | None = None):
    got: list[bytes] = []
    call = await pool.post(json.dumps(body or {"x": 1}).encode(), got.append)
    result = call.result
    try:
        status = await asyncio.wait_for(result, 5)
    finally:
        call.hang_up(result)
    return status, got, call


def test_events_across_any_split_then_the_connection_serves_the_next_call():
    async def main():
        events = [b'{"output_ids": [1]}', b'{"output_ids": [1, 2]}', b"[DONE]"]
        answer = HEAD_200 + chunked(sse(*events[:1]), sse(*events[1:]))
        async with Server([answer, answer], split=3) as srv:
            pool = Pool(srv.url, {"Authorization": "Bearer k"})
            status, got, _ = await _post(pool, {"rid": "a"})
            await asyncio.sleep(0.05)  # the response's end: the connection goes idle
            status2, got2, _ = await _post(pool, {"rid": "b"})
            pool.close()
        assert status == status2 == 200
        assert got == got2 == events[:2]
        assert [c for c, _, _ in srv.requests] == [1, 1]  # one connection, reused
        head = srv.requests[0][1].decode()
        assert head.startswith("POST /generate HTTP/1.1\r\n")
        assert "Authorization: Bearer k" in head and "Host: 127.0.0.1:" in head
        assert json.loads(srv.requests[1][2]) == {"rid": "b"}

    asyncio.run(main())


def test_an_error_status_comes_with_its_body_and_retry_after():
    async def main():
        body = b'{"error": {"message": "queue full"}}'
        answer = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 7\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip
        async with Server([answer]) as srv:
            status, got, call = await _post(Pool(srv.url, {}))
        assert (status, got) == (503, [])
        assert bytes(call.body) == body and call.headers["retry-after"] == "7"

    asyncio.run(main())


def test_a_hang_up_mid_stream_drops_the_connection():
    async def main():
        answer = HEAD_200 + b"%x\r\n%s\r\n" % (len(sse(b"{}")), sse(b"{}"))  # never ends
        async with Server([answer]) as srv:
            pool = Pool(srv.url, {})
            got: list[bytes] = []
            call = await pool.post(b"{}", got.append)
            result = call.result
            while not got:
                await asyncio.sleep(0.01)
            call.hang_up(result)  # the caller was cancelled (an abort, the bridge stopping)
            await asyncio.wait_for(srv.closed.wait(), 5)  # SGLang sees the client go
        assert result.cancelled() and pool.idle == []

    asyncio.run(main())


@pytest.mark.parametrize(
    "answer, error",
    [
        (HEAD_200 + b"%x\r\n%s\r\n" % (len(sse(b"{}")), sse(b"{}")), ConnectionResetError),
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", ValueError),  # not HTTP
    ],
)
def test_a_server_that_closes_mid_stream_or_answers_garbage_fails_the_call(answer, error):
    async def main():
        async with Server([answer], close_after=True) as srv:
            with pytest.raises(error):
                await _post(Pool(srv.url, {}))

    asyncio.run(main())


def test_an_event_the_bridge_cannot_read_fails_the_call_and_its_connection():
    async def main():
        answer = HEAD_200 + chunked(sse(b"not json", b"[DONE]"))
        async with Server([answer]) as srv:
            pool = Pool(srv.url, {})

            def on_event(payload: bytes) -> None:
                json.loads(payload)

            call = await pool.post(b"{}", on_event)
            with pytest.raises(ValueError):
                await asyncio.wait_for(call.result, 5)
            await asyncio.wait_for(srv.closed.wait(), 5)
        assert pool.idle == []

    asyncio.run(main())


def test_a_late_hang_up_leaves_the_next_call_on_the_connection_alone():
    """The response's end releases the connection in the read callback, before the first
    caller's task runs again; a second call may take it at once. The first caller's
    ``hang_up`` then names an exchange that is over: the second one goes on."""

    async def main():
        events = [b"{}", b"[DONE]"]
        answer = HEAD_200 + chunked(sse(*events))
        async with Server([answer, answer], split=1000) as srv:
            pool = Pool(srv.url, {})
            first = await pool.post(b"{}", lambda p: None)
            old = first.result
            await asyncio.wait_for(old, 5)
            while not pool.idle:
                await asyncio.sleep(0.01)
            got: list[bytes] = []
            second = await pool.post(b"{}", got.append)
            assert second is first  # the same connection
            first.hang_up(old)
            assert await asyncio.wait_for(second.result, 5) == 200
        assert got == [b"{}"]

    asyncio.run(main())
