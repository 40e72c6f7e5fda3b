"""The HTTP front's intake (bounded queue, bounded work per loop pass) and the
operators' guard, as ASGI units: a stand-in app, real asyncio."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from sgl_fair.config import parse_tenants
from sgl_fair.router.guard import AdminGuard
from sgl_fair.router.intake import IntakeMiddleware, StartGate


def test_the_gate_lets_per_pass_through_each_pass_in_arrival_order():
    async def main() -> list[tuple[int, int]]:
        gate = StartGate(per_pass=3)
        passes = [0]
        order: list[tuple[int, int]] = []

        async def counter() -> None:  # counts loop passes
            while True:
                passes[0] += 1
                await asyncio.sleep(0)

        async def caller(i: int) -> None:
            await gate.turn()
            order.append((i, passes[0]))

        ticker = asyncio.get_running_loop().create_task(counter())
        await asyncio.gather(*(caller(i) for i in range(10)))
        ticker.cancel()
        return order

    order = asyncio.run(main())
    assert [i for i, _ in order] == list(range(10))  # FIFO
    by_pass: dict[int, int] = {}
    for _, p in order:
        by_pass[p] = by_pass.get(p, 0) + 1
    assert max(by_pass.values()) <= 3 and len(by_pass) >= 4


def test_a_burst_through_the_gate_keeps_every_pass_short():
    """2,000 requests of 1 ms synchronous work each: with the gate no pass of the loop takes
    more than a few dozen ms; without it, one pass takes the whole 2 s."""

    async def worst_pass(per_pass: int | None) -> float:
        gate = StartGate(per_pass) if per_pass else None
        worst = 0.0
        stop = False

        async def probe() -> None:
            nonlocal worst
            while not stop:
                t0 = time.perf_counter()
                await asyncio.sleep(0.005)
                worst = max(worst, time.perf_counter() - t0 - 0.005)

        async def handler() -> None:
            await asyncio.sleep(0)  # the body arrives
            if gate is not None:
                await gate.turn()
            end = time.perf_counter() + 0.001  # parse + tokenize + dispatch
            while time.perf_counter() < end:
                pass

        task = asyncio.get_running_loop().create_task(probe())
        await asyncio.sleep(0.02)
        await asyncio.gather(*(handler() for _ in range(2000)))
        stop = True
        await task
        return worst

    gated = asyncio.run(worst_pass(16))
    ungated = asyncio.run(worst_pass(None))
    assert ungated > 1.0  # the failure mode is real
    # A ratio, not a time: on a loaded machine both stretch (a pass of 16 requests takes
    # ~16 ms alone; descheduled, 0.2 s and more), but ungated stays the whole burst.
    assert gated < ungated / 8, (gated, ungated)


class Recorder:
    """A stand-in app: holds every generation request until released."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        self.bodies.append(body)
        await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def call(app, path: str, body: bytes = b"{}", headers=(), client=("10.0.0.9", 5555)):
    sent: list[dict] = []
    chunks = [body[:3], body[3:]]

    async def receive():
        if chunks:
            part = chunks.pop(0)
            return {"type": "http.request", "body": part, "more_body": bool(chunks)}
        await asyncio.sleep(3600)

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "path": path, "method": "POST", "headers": list(headers),
             "client": client}  # fmt: skip
    await app(scope, receive, send)
    return (
        sent[0]["status"],
        dict(sent[0].get("headers", [])),
        b"".join(m.get("body", b"") for m in sent[1:]),
    )


def test_the_queue_is_bounded_and_refusals_are_429_with_retry_after():
    async def main() -> None:
        inner = Recorder()
        app = IntakeMiddleware(inner, max_queued=5, per_pass=2)
        held = [
            asyncio.create_task(call(app, "/generate", b'{"text": "abcdef"}')) for _ in range(5)
        ]
        await asyncio.sleep(0.05)
        assert app.num_active == 5
        status, headers, body = await call(app, "/v1/completions")
        assert status == 429 and headers[b"retry-after"] == b"1"
        assert "max-queued-requests" in json.loads(body)["error"]["message"]
        inner.release.set()
        results = await asyncio.gather(*held)
        assert [s for s, _, _ in results] == [200] * 5
        assert inner.bodies.count(b'{"text": "abcdef"}') == 5  # the body is replayed whole
        assert app.num_active == 0 and app.num_rejected == 1

    asyncio.run(main())


TENANTS = parse_tenants(
    {"tenant": [{"name": "ops", "api_keys": ["sk-ops"], "admin": True},
                {"name": "acme", "api_keys": ["sk-acme"]}]}
)  # fmt: skip


@pytest.mark.parametrize(
    ("headers", "client", "loopback_ok", "expected"),
    [
        ((), ("10.0.0.9", 1), True, 401),
        (((b"authorization", b"Bearer sk-acme"),), ("10.0.0.9", 1), True, 403),
        (((b"authorization", b"Bearer sk-ops"),), ("10.0.0.9", 1), True, 200),
        (((b"authorization", b"Bearer opkey"),), ("10.0.0.9", 1), True, 200),
        ((), ("127.0.0.1", 1), True, 200),
        ((), ("127.0.0.1", 1), False, 401),
    ],
)
def test_operator_endpoints_need_an_admin(headers, client, loopback_ok, expected):
    async def ok_app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guard = AdminGuard(ok_app, admin_key="opkey", tenants=TENANTS, allow_loopback=loopback_ok)
    for path in ("/metrics", "/server_info", "/get_server_info", "/flush_cache"):
        status, _, _ = asyncio.run(call(guard, path, headers=headers, client=client))
        assert status == expected, path
    status, _, _ = asyncio.run(call(guard, "/generate", client=client))
    assert status == 200  # the guard leaves the API to its own auth
