"""The standalone worker (``python -m sgl_fair.worker``) on real tcp sockets, on loopback.

Two stand-in router replicas (raw DEALER sockets, as ``router/remote_link.py`` opens them)
attach to one worker process: a request's tokens and its Finished reach only the replica that
dispatched it; Load and KV events reach both; a replica that goes away has its requests
aborted; with CURVE keys a client without the accepted key hears nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import zmq
from remote_helpers import free_port_pair, start_worker

from sgl_fair import kv_events
from sgl_fair.messages import Dispatch, Finished, Hello, Load, Tokens
from sgl_fair.remote import Attach, ClientKeys, curve_client, encode_control, make_keys
from sgl_fair.request import Request
from sgl_fair.transport import decode, encode


@pytest.fixture
def worker() -> Iterator[int]:
    port = free_port_pair()
    proc = start_worker(port, "--time-scale", "1")
    yield port
    proc.terminate()
    proc.wait(5)


class Replica:
    """A router replica's two sockets on the worker, driven by the test."""

    def __init__(self, ctx: zmq.Context, port: int, name: str, keys: ClientKeys | None = None):
        self.name = name
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"{name}-test".encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            curve_client(self.sock, keys)
            curve_client(self.sub, keys)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.sub.connect(f"tcp://127.0.0.1:{port + 1}")
        self.got: list = []
        self.kv: list = []
        self.sock.send(encode_control(Attach(name, time.time())))

    def send(self, msg) -> None:
        self.sock.send(encode(msg))

    def pump(self, seconds: float) -> None:
        end = time.time() + seconds
        while time.time() < end:
            if self.sock.poll(10):
                self.got.append(decode(self.sock.recv()))
            while self.sub.poll(0):
                self.kv.append(self.sub.recv_multipart())

    def of(self, kind: type) -> list:
        return [m for m in self.got if type(m) is kind]

    def rids(self) -> set[str]:
        out = {m.rid for m in self.of(Finished)}
        for m in self.of(Tokens):
            out |= {rid for rid, _ in m.items}
        return out


def request(rid: str, output_len: int = 8) -> Request:
    return Request(rid=rid, client="c", input_ids=tuple(range(300, 364)), output_len=output_len,
                   arrival_s=time.time())  # fmt: skip


def wait_for(replica: Replica, cond, timeout_s: float = 10.0) -> None:
    end = time.time() + timeout_s
    while not cond() and time.time() < end:
        replica.pump(0.05)
    assert cond(), f"{replica.name} got {[type(m).__name__ for m in replica.got]}"


def test_tokens_go_to_the_dispatcher_load_and_kv_to_all(worker: int) -> None:
    ctx = zmq.Context()
    a, b = Replica(ctx, worker, "a"), Replica(ctx, worker, "b")
    for r in (a, b):
        wait_for(r, lambda r=r: r.of(Hello))
    time.sleep(0.2)  # the SUBs are joined before the first KV event
    a.send(Dispatch(0, request("from-a"), time.time()))
    b.send(Dispatch(0, request("from-b", 4), time.time()))
    wait_for(a, lambda: any(m.rid == "from-a" for m in a.of(Finished)))
    wait_for(b, lambda: any(m.rid == "from-b" for m in b.of(Finished)))
    a.pump(0.3)
    b.pump(0.3)
    assert a.rids() == {"from-a"} and b.rids() == {"from-b"}
    fin = next(m for m in a.of(Finished) if m.rid == "from-a")
    assert fin.ok and len(fin.output_ids) >= 1
    assert a.of(Load) and b.of(Load)  # the heartbeat reaches both
    for r in (a, b):  # both follow the worker's cache (SGLang's KV-event format)
        batches = [kv_events.decode_batch(kv_events.parse_multipart(f)[2]) for f in r.kv]
        assert any(batch.events for batch in batches), r.name
    ctx.destroy(linger=0)


def test_a_replica_that_leaves_has_its_requests_aborted(worker: int) -> None:
    ctx = zmq.Context()
    a, b = Replica(ctx, worker, "a"), Replica(ctx, worker, "b")
    for r in (a, b):
        wait_for(r, lambda r=r: r.of(Hello))
    a.send(Dispatch(0, request("long", output_len=4000), time.time()))
    wait_for(b, lambda: any(m.num_running == 1 for m in b.of(Load)))
    a.sock.close(linger=0)  # the replica is killed: its connection closes
    a.sub.close(linger=0)
    b.got.clear()
    wait_for(b, lambda: any(m.num_running == 0 for m in b.of(Load)), timeout_s=10)
    assert not b.rids()  # nothing of a's reached b
    ctx.destroy(linger=0)


def test_a_rid_in_flight_for_another_replica_is_refused(worker: int) -> None:
    ctx = zmq.Context()
    a, b = Replica(ctx, worker, "a"), Replica(ctx, worker, "b")
    for r in (a, b):
        wait_for(r, lambda r=r: r.of(Hello))
    a.send(Dispatch(0, request("same", output_len=2000), time.time()))
    wait_for(a, lambda: a.of(Tokens))
    b.send(Dispatch(0, request("same"), time.time()))
    wait_for(b, lambda: b.of(Finished))
    assert b.of(Finished)[0].reason.value == "rejected"
    assert "already in flight" in (b.of(Finished)[0].error or "")
    assert not any(m.rid == "same" for m in a.of(Finished))  # a's request runs on
    ctx.destroy(linger=0)


def test_curve_a_client_without_the_key_hears_nothing(tmp_path) -> None:
    paths = make_keys(str(tmp_path / "keys"))
    other = make_keys(str(tmp_path / "other"))  # a router key the worker does not accept
    port = free_port_pair()
    proc = start_worker(port, "--keys", str(tmp_path / "keys"))
    ctx = zmq.Context()
    try:
        good = Replica(
            ctx, port, "good", ClientKeys(paths["router_secret"], paths["worker_public"])
        )
        bad = Replica(ctx, port, "bad", ClientKeys(other["router_secret"], paths["worker_public"]))
        plain = Replica(ctx, port, "plain")
        wait_for(good, lambda: good.of(Hello))
        time.sleep(0.3)  # its KV subscription is joined before the first event
        good.send(Dispatch(0, request("k"), time.time()))
        wait_for(good, lambda: good.of(Finished))
        for r in (bad, plain):
            r.pump(0.5)
            assert r.got == [] and r.kv == [], r.name
        assert good.kv  # its KV subscription is served (also over CURVE)
    finally:
        ctx.destroy(linger=0)
        proc.terminate()
        proc.wait(5)


def test_non_loopback_bind_without_keys_is_refused() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sgl_fair.worker", "--bind", "tcp://10.11.12.13:5555"],
        capture_output=True, text=True, timeout=30, env={**os.environ},
    )  # fmt: skip
    assert out.returncode == 2
    assert "--insecure" in out.stderr and "--keys" in out.stderr
    bad = subprocess.run([sys.executable, "-m", "sgl_fair.worker", "--bind", "127.0.0.1:80"],
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    assert bad.returncode == 2 and "--bind: expected tcp://HOST:PORT" in bad.stderr


def test_the_service_report_lists_the_interactions_under_way(worker: int) -> None:
    """A tagged call of an interaction: every replica's Load lists the interaction while the
    call runs and once after its Finished (the cluster OIT of a replica that never saw the
    interaction then lets its next call through), then no more."""
    ctx = zmq.Context()
    a, b = Replica(ctx, worker, "a"), Replica(ctx, worker, "b")
    for r in (a, b):
        wait_for(r, lambda r=r: r.of(Hello))
    req = request("agent-call", output_len=40)
    req.interaction_id = "agent-7"
    a.sock.send(encode(Dispatch(0, req, 0.0, tag=(5, 64))))

    def listed(r: Replica) -> list[bool]:
        return ["agent-7" in m.service.interactions for m in r.of(Load) if m.service is not None]

    wait_for(b, lambda: any(listed(b)))  # b never saw the call: the report tells it
    wait_for(a, lambda: any(m.rid == "agent-call" for m in a.of(Finished)))
    a.pump(1.0)
    after = listed(a)[listed(a).index(True) :]
    assert after[-1] is False and after.count(False) >= 2  # it stops being listed
    assert after == sorted(after, reverse=True)  # listed while under way, then no more
    ctx.destroy(linger=0)
