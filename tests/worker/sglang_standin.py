"""A small real HTTP server with the SGLang 0.5.23 behaviour the bridge depends on, and a real
``Bridge`` in front of it, driven over zmq as the router drives it.

What the stand-in copies from SGLang (each is a defect the bridge once had against it):

* ``POST /abort_request`` aborts every running request whose rid *starts with* the given rid
  (``Scheduler.abort_request``: ``req.rid.startswith(recv_req.rid)``);
* ``--api-key``: every endpoint but ``/health*`` / ``/metrics`` answers 401 without
  ``Authorization: Bearer KEY`` (``sglang/srt/utils/auth.py``);
* ``--incremental-streaming-output``: stream chunks carry only the new ``output_ids``, and
  ``/server_info`` says ``incremental_streaming_output``;
* ``/server_info`` carries whatever ``info`` adds (the plugin's state, ``sgl_fair``).

It records every call (method, path, Authorization header, JSON body). Pure aiohttp: no sglang.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from typing import Any

import zmq
from aiohttp import web

from sgl_fair.messages import Abort, Dispatch, Finished, Hello, Shutdown, Tokens
from sgl_fair.request import Request
from sgl_fair.transport import Endpoints, decode, encode
from sgl_fair.worker.sglang.bridge import Bridge, BridgeConfig


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StandInSGLang:
    def __init__(
        self,
        *,
        api_key: str | None = None,
        incremental: bool = False,
        info: dict[str, Any] | None = None,
        token_interval_s: float = 0.01,
        tail_delay_s: float = 0.0,
        record: bool = True,
    ) -> None:
        self.api_key = api_key
        self.incremental = incremental
        self.info = dict(info or {})
        self.token_interval_s = token_interval_s
        self.tail_delay_s = tail_delay_s  # between "[DONE]" and the stream's end
        self.record = record  # keep every call (False: a bench's long run)
        self.generate_ports: list[int] = []  # the client port of each /generate
        self.seen: list[tuple[str, str, str | None, Any]] = []
        self.running: set[str] = set()
        self.aborted: list[str] = []  # rids the server aborted, in order
        self._abort: set[str] = set()
        self._conns: set[Any] = set()  # the transport of every connection a call came on
        self.loop = asyncio.new_event_loop()
        self.url = ""

    # ---- the thread ------------------------------------------------------------------------

    def __enter__(self) -> StandInSGLang:
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self._start())
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _start(self) -> None:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/health", self._ok)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/model_info", self._model_info)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/abort_request", self._abort_request)
        app.router.add_post("/flush_cache", self._ok)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = _free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    # ---- SGLang's behaviour ----------------------------------------------------------------

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        body = await request.read()
        try:
            obj = json.loads(body) if body else None
        except ValueError:
            obj = body
        authz = request.headers.get("Authorization")
        if self.record:
            self._conns.add(request.transport)
            self.seen.append((request.method, request.path, authz, obj))
        free = request.path.startswith(("/health", "/metrics"))
        if self.api_key and not free and authz != f"Bearer {self.api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def _ok(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _server_info(self, request: web.Request) -> web.Response:
        info = {
            "version": "0.5.23",
            "model_path": "stand-in",
            "max_total_num_tokens": 20000,
            "incremental_streaming_output": self.incremental,
            **self.info,
        }
        return web.json_response(info)

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "stand-in", "context_length": 4096})

    async def _abort_request(self, request: web.Request) -> web.Response:
        rid = (await request.json())["rid"]
        # Scheduler.abort_request: `req.rid.startswith(recv_req.rid)`
        self._abort.update(r for r in self.running if r.startswith(rid))
        return web.Response(text="")

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.record:
            self.generate_ports.append(request.transport.get_extra_info("peername")[1])
        rid = body.get("rid") or f"standin-{id(request)}"  # SGLang's gateway sends none
        n = int(body["sampling_params"]["max_new_tokens"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.running.add(rid)
        ids: list[int] = []
        with contextlib.suppress(ConnectionResetError):  # the client hung up: the stream ends
            await self._stream(resp, rid, n, ids)
        return resp

    async def _stream(self, resp: web.StreamResponse, rid: str, n: int, ids: list[int]) -> None:
        try:
            for i in range(n):
                if rid in self._abort:
                    self.aborted.append(rid)
                    finish = {"type": "abort", "message": "Abort before prefill"}
                    await self._chunk(resp, ids, [], finish)
                    break
                ids.append(100 + i)
                finish = {"type": "length", "length": n} if i == n - 1 else None
                await self._chunk(resp, ids, ids[-1:], finish)
                await asyncio.sleep(self.token_interval_s)
            await resp.write(b"data: [DONE]\n\n")
            if self.tail_delay_s:
                await asyncio.sleep(self.tail_delay_s)  # the stream's end comes later
        finally:
            self.running.discard(rid)
            self._abort.discard(rid)

    async def _chunk(self, resp: web.StreamResponse, ids: list[int], new: list[int], finish):
        out = new if self.incremental else list(ids)
        meta = {"id": "x", "finish_reason": finish, "cached_tokens": 0,
                "completion_tokens": len(ids)}  # fmt: skip
        chunk = {"text": "", "output_ids": out, "meta_info": meta}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

    def die(self) -> None:
        """As ``kill -9`` of the server: its listener and every open call go at once."""

        async def die() -> None:
            for site in list(self.runner.sites):
                await site.stop()
            for transport in list(self._conns):
                transport.abort()  # the calls under way, and the idle keep-alive ones

        asyncio.run_coroutine_threadsafe(die(), self.loop).result(10)

    # ---- what the tests read ---------------------------------------------------------------

    def calls(self, path: str) -> list[tuple[str | None, Any]]:
        return [(authz, body) for _m, p, authz, body in list(self.seen) if p == path]


class BridgeRig:
    """A real ``Bridge`` (its own thread and event loop) in front of ``url``; the test is the
    router: it dispatches and aborts over zmq and reads what the bridge says."""

    def __init__(self, tmp_dir: str, url: str, **cfg: Any) -> None:
        self.ep = Endpoints.ipc(os.path.join(tmp_dir, f"bridge-{_free_port()}"))
        self.cfg = BridgeConfig(wid=0, endpoints=self.ep.base, url=url, **cfg)  # before sockets
        self.ctx = zmq.Context()
        self.router_in = self.ctx.socket(zmq.PULL)
        self.router_in.bind(self.ep.router_in)
        self.to_worker = self.ctx.socket(zmq.PUSH)
        self.to_worker.bind(self.ep.worker_in(0))
        self.code: int | None = None
        self.got: list[Any] = []

    def __enter__(self) -> BridgeRig:
        def run() -> None:
            async def main() -> int:
                bridge = Bridge(self.cfg)
                try:
                    return await bridge.run()
                finally:
                    bridge.close()

            self.code = asyncio.run(main())

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.thread.is_alive():
            self.send(Shutdown(0))
        self.thread.join(10)
        for sock in (self.router_in, self.to_worker):
            sock.close(linger=0)
        self.ctx.term()

    def send(self, msg: Any) -> None:
        self.to_worker.send(encode(msg))

    def dispatch(self, rid: str, max_new_tokens: int, client: str = "alice", **kw: Any) -> None:
        req = Request(rid=rid, client=client, input_ids=(5, 6, 7), output_len=max_new_tokens,
                      arrival_s=time.time(), **kw)  # fmt: skip
        self.send(Dispatch(0, req, time.time()))

    def abort(self, rid: str) -> None:
        self.send(Abort(0, rid, "test"))

    def recv_until(self, pred: Any, timeout_s: float = 10.0) -> Any:
        """Messages until one satisfies ``pred`` (returned); None on timeout or bridge exit."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.router_in.poll(50):
                msg = decode(self.router_in.recv())
                self.got.append(msg)
                if pred(msg):
                    return msg
            elif not self.thread.is_alive():
                return None
        return None

    def hello(self, timeout_s: float = 10.0) -> Hello | None:
        return self.recv_until(lambda m: isinstance(m, Hello), timeout_s)

    def finished(self, rids: set[str], timeout_s: float = 10.0) -> dict[str, Finished]:
        out: dict[str, Finished] = {
            m.rid: m for m in self.got if isinstance(m, Finished) and m.rid in rids
        }
        with contextlib.suppress(Exception):
            while set(out) != rids:
                m = self.recv_until(lambda m: isinstance(m, Finished), timeout_s)
                if m is None:
                    break
                out[m.rid] = m
        return out

    def tokens_of(self, rid: str) -> list[int]:
        return [t for m in self.got if isinstance(m, Tokens) for r, ids in m.items if r == rid
                for t in ids]  # fmt: skip
