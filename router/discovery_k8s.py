"""Workers found in Kubernetes: the pods of a label selector, read from the API server.

``--worker-discovery-k8s SELECTOR`` (e.g. ``app=sgl-fair-worker``): every ``period_s`` the
router lists the pods of its namespace that match (``GET /api/v1/namespaces/NS/pods
?labelSelector=…``, as SGLang's gateway watches pods by selector) and makes its standalone
workers exactly the ready ones (``router/membership.py``'s ``sync``): a pod that turns ready
joins as ``tcp://POD_IP:PORT`` (the container port named ``port_name``, ``dispatch`` in
``docs/k8s/workers.yaml``); one that stops being ready, is deleted (its terminating pod
drains itself too: ``python -m sgl_fair.worker`` on SIGTERM) or leaves the selector is
drained, then removed. Workers given otherwise (flags, ``POST /workers``) are left alone.

In a pod the API server, the service account's token, its CA and the namespace come from
the standard places (``KUBERNETES_SERVICE_HOST``/``_PORT``, ``/var/run/secrets/kubernetes.io
/serviceaccount/``); each can be given instead (a router outside the cluster, the tests'
fake API server). The router's service account needs ``get``/``list`` on ``pods``
(``docs/k8s/routers.yaml`` has the Role). A failed list keeps the workers as they are and
is tried again next period (counted, logged once per failure streak).

Plain HTTPS with aiohttp (the router's HTTP client already): three read-only calls do not
need a client library.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

log = logging.getLogger("sgl_fair.router")

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class DiscoveryError(ValueError):
    """Discovery cannot be set up as given (a one-line message naming what is missing)."""


@dataclass(frozen=True)
class KubeAPI:
    server: str  # https://HOST:PORT (or http:// for a test's fake API server)
    namespace: str
    token: str | None = None
    ca_file: str | None = None

    @classmethod
    def from_env(
        cls,
        server: str | None = None,
        namespace: str | None = None,
        token_file: str | None = None,
        ca_file: str | None = None,
        sa_dir: str | None = None,
    ) -> KubeAPI:
        """What was given, else the pod's own (in-cluster) configuration."""
        sa_dir = SA_DIR if sa_dir is None else sa_dir
        if server is None:
            host, port = (
                os.environ.get("KUBERNETES_SERVICE_HOST"),
                os.environ.get("KUBERNETES_SERVICE_PORT", "443"),
            )
            if not host:
                raise DiscoveryError(
                    "--k8s-api: not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST); give the "
                    "API server's URL"
                )
            server = f"https://{host}:{port}"
        if namespace is None:
            namespace = _read(os.path.join(sa_dir, "namespace"))
            if namespace is None:
                raise DiscoveryError("--k8s-namespace: not in a pod (no service account); give it")
        token_file = token_file or os.path.join(sa_dir, "token")
        token = _read(token_file)
        if ca_file is None and os.path.isfile(os.path.join(sa_dir, "ca.crt")):
            ca_file = os.path.join(sa_dir, "ca.crt")
        return cls(server.rstrip("/"), namespace, token, ca_file)

    def pods_url(self, selector: str) -> str:
        return (f"{self.server}/api/v1/namespaces/{quote(self.namespace)}/pods"
                f"?labelSelector={quote(selector)}")  # fmt: skip


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


Pod = tuple[str, dict[str, int]]  # a ready pod: its host ("[v6]" bracketed), ports by name


def ready_pods(pods: Any) -> list[Pod]:
    """Every pod of a ``PodList`` that is running, ready and not being deleted: its address
    and its containers' named ports; sorted."""
    out: list[Pod] = []
    for pod in (pods or {}).get("items") or ():
        meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
        status = pod.get("status") or {}
        if meta.get("deletionTimestamp") or status.get("phase") != "Running":
            continue
        conditions = status.get("conditions") or ()
        if not any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
            continue
        ip = status.get("podIP")
        if not ip:
            continue
        ports = {
            p["name"]: p["containerPort"]
            for c in spec.get("containers") or () for p in c.get("ports") or ()
            if p.get("name") and isinstance(p.get("containerPort"), int)
        }  # fmt: skip
        out.append((f"[{ip}]" if ":" in ip else ip, ports))
    return sorted(out, key=lambda pod: (pod[0], sorted(pod[1].items())))


def ready_endpoints(pods: Any, port_name: str) -> list[str]:
    """``tcp://IP:PORT`` of every ready pod (``ready_pods``) at its port named ``port_name``;
    sorted, each once."""
    return sorted({f"tcp://{host}:{ports[port_name]}" for host, ports in ready_pods(pods)
                   if port_name in ports})  # fmt: skip


class KubeDiscovery:
    """Polls the API server; hands each successful read to ``on_change(pods)`` (the ready
    pods, ``ready_pods``)."""

    def __init__(
        self,
        api: KubeAPI,
        selector: str,
        on_change: Callable[[list[Pod]], Any],
        *,
        period_s: float = 2.0,
    ) -> None:
        self.api = api
        self.selector = selector
        self.on_change = on_change
        self.period_s = period_s
        self.num_lists = 0
        self.num_failures = 0
        self.last: list[Pod] | None = None  # the last pods read
        self._failing = False
        # built once (it reads the CA file), not on every list
        self._ssl: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=api.ca_file)
            if api.server.startswith("https://") else False
        )  # fmt: skip

    async def list_once(self, http: Any) -> list[Pod] | None:
        """The ready pods now, or None when the API server could not be read."""
        import aiohttp

        headers = {"Authorization": f"Bearer {self.api.token}"} if self.api.token else {}
        try:
            async with http.get(
                self.api.pods_url(self.selector), headers=headers, ssl=self._ssl,
                timeout=aiohttp.ClientTimeout(total=10),
            ) as r:  # fmt: skip
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
                pods = await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError) as e:
            self.num_failures += 1
            if not self._failing:
                log.error("Kubernetes discovery: cannot list pods %s (%s); keeping the "
                          "workers as they are", self.selector, e)  # fmt: skip
            self._failing = True
            return None
        if self._failing:
            log.warning("Kubernetes discovery: listing pods again")
        self._failing = False
        self.num_lists += 1
        return ready_pods(pods)

    async def run(self) -> None:
        import aiohttp

        async with aiohttp.ClientSession() as http:
            while True:
                found = await self.list_once(http)
                if found is not None:
                    self.last = found
                    self.on_change(found)
                await asyncio.sleep(self.period_s)


__all__ = ["DiscoveryError", "KubeAPI", "KubeDiscovery", "Pod", "ready_endpoints", "ready_pods"]
