"""Workers joining and leaving a running router: remote endpoints added and removed, draining.

``Membership`` sits beside a ``RouterService`` (``router/service.py``) and owns its remote
links (``router/remote_link.py``). A worker is, as ``/server_info`` and ``GET /workers``
show it::

    starting   linked, has not said Hello yet (health checks back off while it is silent)
    ready      takes requests
    draining   takes no new requests; the ones on it finish; then it is removed
    dead       was up, is not now (silent, or its connection gone); checked with backoff,
               ready again once it answers

``add(endpoint)`` links a new worker (the next free id); over SGLang servers
``add_server(url, kv_endpoint)`` does (the launcher's ``server_link`` builds the bridge and
checks the server runs our plugin); ``remove(wid)`` drains it first
(rolling restarts: drain, restart, add) unless ``drain=False``, which removes it at once —
its requests move to other workers as a dead worker's do (re-dispatched when none of their
tokens reached the client yet, else failed). A drain that outlasts ``drain_timeout_s`` ends
the same way. The launcher's own workers can be drained but not removed (their processes are
the launcher's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sgl_fair.remote import ClientKeys, is_loopback, parse_tcp
from sgl_fair.router.remote_link import RemoteLink

log = logging.getLogger("sgl_fair.router")


class MembershipError(ValueError):
    """A membership change that cannot be made; ``status`` is its HTTP status."""

    def __init__(self, message: str, status: int = 400, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.field = field  # the request body's field it names, if one


@dataclass
class Member:
    wid: int
    endpoint: str | None  # None: the launcher's own worker; an SGLang server's URL
    link: Any = None  # RemoteLink, or the launcher's link to an SGLang server (async close)
    draining_since: float | None = None


# ``server_link(wid, url, kv_endpoint, kv_replay_endpoint)``: a started link to an SGLang
# server as worker ``wid`` (raises MembershipError when the server cannot be one)
ServerLinkFactory = Callable[[int, str, str | None, str | None], Awaitable[Any]]


class Membership:
    def __init__(
        self,
        service: Any,
        *,
        name: str = "router",
        keys: ClientKeys | None = None,
        drain_timeout_s: float = 300.0,
        period_s: float = 0.2,
        server_link: ServerLinkFactory | None = None,
        insecure: bool = False,
    ) -> None:
        self.service = service
        self.insecure = insecure  # non-loopback workers without keys (plain text) allowed
        self.discovery: Any = None  # a KubeDiscovery, when the workers are discovered
        self.server_link = server_link  # set: the workers are SGLang servers (add_server)
        self.name = name
        self.keys = keys
        self.drain_timeout_s = drain_timeout_s
        self.period_s = period_s
        self.members: dict[int, Member] = {w: Member(w, None) for w in service.workers}
        self.num_added = 0
        self.num_removed = 0
        self._task: asyncio.Task | None = None
        self._from_file: set[str] = set()  # endpoints the watched file added
        self._file_mtime: int | None = None
        self._reserved: dict[int, str] = {}  # id -> url of an add_server still starting

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="membership")
        self.service._tasks.append(self._task)

    # ---- changes ----------------------------------------------------------------------------

    def add(self, endpoint: str) -> int:
        """Link the worker at ``endpoint`` (``tcp://HOST:PORT``); returns its id."""
        if self.server_link is not None:
            raise MembershipError(
                "endpoint: this router's workers are SGLang servers; give url (and kv_endpoint)",
                field="endpoint",
            )
        try:
            parse_tcp(endpoint, "endpoint")
        except ValueError as e:
            raise MembershipError(str(e), field="endpoint") from None
        self._unique("endpoint", endpoint)
        wid = self._next_id()
        link = RemoteLink(self.service, wid, endpoint, name=self.name, keys=self.keys)
        link.start()
        self.members[wid] = Member(wid, endpoint, link)
        self.num_added += 1
        log.info("worker %d added: %s", wid, endpoint)
        return wid

    async def add_server(
        self, url: str, kv_endpoint: str | None = None, kv_replay_endpoint: str | None = None
    ) -> int:
        """Bridge the SGLang server at ``url`` (its KV events at ``kv_endpoint``, if given);
        returns its id once the server is checked (it runs our plugin with our policy)."""
        if self.server_link is None:
            raise MembershipError(
                "url: this router's workers are standalone workers; give endpoint (tcp://…)",
                field="url",
            )
        url = url.rstrip("/")
        self._unique("url", url)
        wid = self._next_id()
        self._reserved[wid] = url  # an add of the same url meanwhile is refused
        try:
            link = await self.server_link(wid, url, kv_endpoint, kv_replay_endpoint)
        finally:
            del self._reserved[wid]
        self.members[wid] = Member(wid, url, link)
        self.num_added += 1
        log.info("worker %d added: SGLang server %s", wid, url)
        return wid

    def _unique(self, field: str, where: str) -> None:
        taken = {m.endpoint: m.wid for m in self.members.values()}
        taken |= {url: wid for wid, url in self._reserved.items()}
        if where in taken:
            raise MembershipError(
                f"{field}: {where} is worker {taken[where]} already", 409, field=field
            )

    def _next_id(self) -> int:
        return max([*self.service.workers, *self.members, *self._reserved, -1]) + 1

    def drain(self, wid: int) -> None:
        """No new requests for ``wid``; the ones on it finish."""
        m = self._member(wid)
        if m.draining_since is None:
            m.draining_since = self.service.clock()
            if wid in self.service.router.workers:  # else it takes nothing anyway
                self.service.router.drain_worker(wid)
            log.warning("worker %d draining (%d in flight)", wid, self.in_flight(wid))

    async def remove(self, wid: int, *, drain: bool = True) -> None:
        """Drain then remove ``wid`` (returns at once; ``_loop`` finishes it), or remove it
        now (``drain=False``)."""
        m = self._member(wid)
        if m.link is None:
            raise MembershipError(
                f"worker {wid} is the launcher's own: it can be drained, not removed", 409
            )
        if drain:
            self.drain(wid)
        else:
            await self._finish(m, "removed without draining")

    def _member(self, wid: int) -> Member:
        m = self.members.get(wid)
        if m is None:
            raise MembershipError(f"no worker {wid}", 404)
        return m

    def in_flight(self, wid: int) -> int:
        return sum(1 for c in self.service.calls.values() if c.worker == wid)

    async def _finish(self, m: Member, why: str) -> None:
        svc = self.service
        if m.wid in svc.workers and svc.workers[m.wid].alive:
            svc.worker_dead(m.wid, why)  # what is still on it moves on, or fails
        if m.link is not None:
            await m.link.close()
        svc.router.remove_worker(m.wid)
        svc.workers.pop(m.wid, None)
        self.members.pop(m.wid, None)
        self.num_removed += 1
        log.warning("worker %d removed (%s)", m.wid, why)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            now = self.service.clock()
            for m in list(self.members.values()):
                if m.draining_since is None:
                    continue
                if m.wid in self.service.router.workers:  # came back (Hello) while draining
                    self.service.router.drain_worker(m.wid)
                if m.link is None:
                    continue
                if self.in_flight(m.wid) == 0:
                    await self._finish(m, "drained")
                elif now - m.draining_since > self.drain_timeout_s:
                    await self._finish(m, f"drain timed out after {self.drain_timeout_s:.0f}s")

    # ---- a watched file of endpoints -----------------------------------------------------------

    def watch(self, path: str, period_s: float = 2.0) -> None:
        """Follow ``path`` (one ``tcp://HOST:PORT`` a line; ``#`` comments): an endpoint that
        appears is added, one that leaves is drained and removed. Only the file's own
        endpoints are managed by it (``POST /workers`` ones stay)."""
        self.sync_file(path)
        task = asyncio.get_running_loop().create_task(self._watch(path, period_s), name="watch")
        self.service._tasks.append(task)

    async def _watch(self, path: str, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                self.sync_file(path)
            except Exception:  # a file half written or gone: try again next period
                log.exception("could not read the endpoints file %s", path)

    def sync_file(self, path: str) -> None:
        try:
            mtime = os.stat(path).st_mtime_ns
        except FileNotFoundError:
            log.error("endpoints file %s is gone; keeping the workers as they are", path)
            return
        if mtime == self._file_mtime:
            return
        self._file_mtime = mtime
        with open(path) as f:
            lines = [ln.split("#", 1)[0].strip() for ln in f]
        if not self.sync([ln for ln in lines if ln], self._from_file, f"endpoints file {path}"):
            self._file_mtime = None  # one could not be added yet: read it again next period

    def sync(self, wanted: list[str], managed: set[str], source: str) -> bool:
        """Make the endpoints ``source`` manages (``managed``, updated) the ``wanted`` ones:
        one that appears is added, one that leaves is drained (then removed). Members added
        otherwise (flags, ``POST /workers``) are left alone. False when one could not be
        added (still draining, or a bad line): call again later."""
        ok = True
        for endpoint in wanted:
            member = next((m for m in self.members.values() if m.endpoint == endpoint), None)
            if member is not None and member.draining_since is None:
                continue  # a member already (from this source, or added by an operator)
            try:
                self.add(endpoint)
            except MembershipError as e:  # still draining (or a bad line): look again later
                log.error("%s: %s", source, e)
                ok = False
                continue
            managed.add(endpoint)
        for m in list(self.members.values()):
            if m.endpoint in managed and m.endpoint not in wanted:
                managed.discard(m.endpoint)
                self.drain(m.wid)
        return ok

    def discover(
        self, discovery: Any, *, port: str = "dispatch", kv_port: str = "kv-events"
    ) -> None:
        """Follow a discovery (``router/discovery_k8s.py``'s ``KubeDiscovery``): the ready
        pods it reads become the members it manages. Standalone workers at
        ``tcp://POD:<port>`` (``sync``; one that is not loopback needs CURVE keys or
        ``insecure``, else it is left out, said once); over SGLang servers
        ``http://POD:<port>`` with its KV events at ``tcp://POD:<kv_port>`` if the pod names
        that port (``sync_servers``)."""
        managed: set[str] = set()
        warned: set[str] = set()  # endpoints (or URLs) whose refusal was said already
        pending: list[asyncio.Task] = []

        def on_change(pods: list[tuple[str, dict[str, int]]]) -> None:
            if self.server_link is not None:
                servers = {f"http://{host}:{ports[port]}": (
                    f"tcp://{host}:{ports[kv_port]}" if kv_port in ports else None)
                    for host, ports in pods if port in ports}  # fmt: skip
                if not pending or pending[-1].done():  # one sync at a time
                    pending[:] = [asyncio.get_running_loop().create_task(
                        self.sync_servers(servers, managed, warned))]  # fmt: skip
                return
            wanted = []
            for host, ports in pods:
                if port not in ports:
                    continue
                endpoint = f"tcp://{host}:{ports[port]}"
                if self.keys is None and not self.insecure and not is_loopback(host.strip("[]")):
                    if endpoint not in warned:
                        warned.add(endpoint)
                        log.error("discovered worker %s left out: not loopback, and the router "
                                  "has no --worker-keys (or --insecure)", endpoint)  # fmt: skip
                    continue
                wanted.append(endpoint)
            self.sync(wanted, managed, "Kubernetes discovery")

        discovery.on_change = on_change
        self.discovery = discovery
        task = asyncio.get_running_loop().create_task(discovery.run(), name="discovery")
        self.service._tasks.append(task)

    async def sync_servers(
        self, wanted: dict[str, str | None], managed: set[str], warned: set[str] | None = None
    ) -> None:
        """``sync`` for SGLang servers: ``wanted`` maps each URL to its KV endpoint (or None);
        a server that cannot be added now (its plugin, not up yet) is tried next time, its
        refusal said once (``warned``) until it is added."""
        warned = set() if warned is None else warned
        for url, kv in wanted.items():
            member = next((m for m in self.members.values() if m.endpoint == url), None)
            if member is not None and member.draining_since is None:
                continue
            try:
                await self.add_server(url, kv)
            except MembershipError as e:
                if url not in warned:
                    warned.add(url)
                    log.error("Kubernetes discovery: %s (tried again every period)", e)
                continue
            warned.discard(url)
            managed.add(url)
        for m in list(self.members.values()):
            if m.endpoint in managed and m.endpoint not in wanted:
                managed.discard(m.endpoint)
                self.drain(m.wid)

    async def close(self) -> None:
        for m in list(self.members.values()):
            if m.link is not None:
                with contextlib.suppress(Exception):
                    await m.link.close()

    # ---- views ------------------------------------------------------------------------------

    def state(self, wid: int) -> str:
        m = self.members.get(wid)
        w = self.service.workers.get(wid)
        if m is not None and m.draining_since is not None:
            return "draining"
        if w is None or not w.ever_ready:
            return "starting"
        return "ready" if w.alive else "dead"

    def describe(self) -> list[dict[str, Any]]:
        out = []
        now = self.service.clock()
        for wid in sorted(self.members):
            m, w = self.members[wid], self.service.workers.get(wid)
            row: dict[str, Any] = {
                "id": wid,
                "endpoint": m.endpoint or "local",
                "state": self.state(wid),
                "in_flight": self.in_flight(wid),
            }
            if w is not None:
                seen = round(now - w.last_seen, 3) if w.last_seen else None
                row.update(pid=w.pid, engine=w.engine, death=w.death, seen_s_ago=seen)
            if isinstance(m.link, RemoteLink):
                row["health_check_period_s"] = m.link.backoff_s
            out.append(row)
        return out


__all__ = ["Member", "Membership", "MembershipError"]
