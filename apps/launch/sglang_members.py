"""SGLang servers joining a running router: ``POST /workers {"url", "kv_endpoint"}``.

``router/membership.py`` owns membership; over SGLang servers it calls the factory
:func:`server_links` builds, which checks the server and links it as one of the launch's
own are linked (``apps/launch/sglang.py``): a bridge on the router's loop in front of it, its
KV events followed on a SUB socket, its process watched through the bridge. The checks are
the launcher's for ``--worker-url`` and ``--worker-kv-endpoint``, answered as a 400 naming
the field: an ``http(s)://`` URL; a server that answers and runs our plugin with this
router's local policy (a plain SGLang server would schedule by other rules than the ones
announced); a zmq KV endpoint that is not a public address (the events are plaintext).
Removing one (``DELETE /workers/{id}``) drains it, then stops its bridge and subscription;
the server itself keeps running (it is not the launcher's).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from typing import Any

import zmq

from sgl_fair.launch.backends import HTTP_URL, public_ip
from sgl_fair.launch.config import LaunchConfig, local_policy_opts
from sgl_fair.router.liveness import WorkerState
from sgl_fair.router.membership import MembershipError, ServerLinkFactory

log = logging.getLogger("sgl_fair.launch")


def _check_endpoint(field: str, endpoint: str | None) -> None:
    if endpoint is None:
        return
    if not endpoint.startswith(("tcp://", "ipc://")):
        raise MembershipError(
            f"{field}: {endpoint!r} is not a zmq tcp:// or ipc:// endpoint", field=field
        )
    if public_ip(endpoint):
        raise MembershipError(
            f"{field}: {endpoint} is a public address, and SGLang's KV events are plaintext "
            "zmq anyone there can publish to or read (docs/operators.md)",
            field=field,
        )


async def check_server(cfg: LaunchConfig, tenants: Any, url: str) -> None:
    """The server at ``url`` answers and runs our plugin with the launch's local policy."""
    import aiohttp

    from sgl_fair.worker.sglang.http_api import auth_headers, plugin_check, probe_server

    async with aiohttp.ClientSession(headers=auth_headers(cfg.worker_api_key)) as http:
        info = await probe_server(http, url, cfg.health_check_timeout_s)
    refusal, warning = plugin_check(info, cfg.schedule_policy, local_policy_opts(cfg, tenants))
    if refusal is not None:
        raise MembershipError(f"url: the SGLang server at {url} {refusal}", field="url")
    if warning is not None:
        log.warning("SGLang server %s: %s", url, warning)


class ServerLink:
    """Worker ``wid``: the bridge to one SGLang server, on the router's loop, and its KV
    events; ``start`` joins it to the service (it takes requests once its bridge says
    Hello), ``close`` leaves."""

    def __init__(
        self, state: Any, cfg: LaunchConfig, tenants: Any, wid: int, url: str,
        kv_endpoint: str | None, kv_replay_endpoint: str | None,
    ) -> None:  # fmt: skip
        self.state, self.cfg, self.tenants = state, cfg, tenants
        self.wid, self.url = wid, url
        self.kv_endpoint, self.kv_replay_endpoint = kv_endpoint, kv_replay_endpoint
        self.hosted: Any = None
        self.sub: Any = None
        self._kv_task: asyncio.Task | None = None

    def start(self) -> None:
        from sgl_fair.launch.sglang import bridge_configs
        from sgl_fair.worker.sglang.bridge import Bridge
        from sgl_fair.worker.sglang.bridge_link import HostedBridge, LocalLink

        svc, wid = self.state.service, self.wid
        if wid in svc.workers:
            raise ValueError(f"worker {wid} exists already")
        (bcfg,) = bridge_configs(self.cfg, svc.endpoints.base, [self.url], [None], self.tenants)
        bcfg = dataclasses.replace(bcfg, wid=wid)
        w = svc.workers[wid] = WorkerState(wid)
        w.kv_replay = self.kv_replay_endpoint
        svc.router.remove_worker(wid)  # until its bridge says Hello
        urls = self.state.worker_urls
        urls.extend([""] * (wid + 1 - len(urls)))
        urls[wid] = self.url
        self.hosted = HostedBridge(Bridge(bcfg, LocalLink(svc.deliver)))
        svc.attach_local(wid, self.hosted.handle)
        self.hosted.start()
        svc.watch_process(wid, self.hosted)
        if self.kv_endpoint is not None:
            self.sub = svc.actx.socket(zmq.SUB)
            self.sub.setsockopt(zmq.SUBSCRIBE, b"")
            self.sub.setsockopt(zmq.RCVHWM, 0)
            self.sub.setsockopt(zmq.LINGER, 0)
            self.sub.connect(self.kv_endpoint)
            svc.subs[wid] = self.sub
            loop = asyncio.get_running_loop()
            self._kv_task = loop.create_task(svc._kv_loop(wid, self.sub), name=f"kv-{wid}")
            svc._tasks.append(self._kv_task)

    async def close(self) -> None:
        svc = self.state.service
        svc.local.pop(self.wid, None)
        if self.hosted is not None and self.hosted.task is not None:
            self.hosted.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.hosted.task
        if self._kv_task is not None:
            self._kv_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._kv_task
        if self.sub is not None:
            svc.subs.pop(self.wid, None)
            self.sub.close(linger=0)


def server_links(state: Any, cfg: LaunchConfig, tenants: Any) -> ServerLinkFactory:
    """The factory ``Membership(server_link=...)`` calls for ``POST /workers {"url"}``."""

    async def link(
        wid: int, url: str, kv_endpoint: str | None, kv_replay_endpoint: str | None
    ) -> ServerLink:
        if not HTTP_URL.fullmatch(url):
            raise MembershipError(f"url: {url!r} is not an http:// or https:// URL", field="url")
        if kv_replay_endpoint is not None and kv_endpoint is None:
            raise MembershipError(
                "kv_replay_endpoint: only with kv_endpoint", field="kv_replay_endpoint"
            )
        _check_endpoint("kv_endpoint", kv_endpoint)
        _check_endpoint("kv_replay_endpoint", kv_replay_endpoint)
        await check_server(cfg, tenants, url.rstrip("/"))
        server = ServerLink(
            state, cfg, tenants, wid, url.rstrip("/"), kv_endpoint, kv_replay_endpoint
        )
        server.start()
        return server

    return link


__all__ = ["ServerLink", "check_server", "server_links"]
