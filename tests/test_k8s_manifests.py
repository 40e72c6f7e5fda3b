"""docs/k8s: the Kubernetes example of docs/operators.md ("Many hosts") is checked, not just
shown. Every manifest parses; every container's command line passes its program's own flag
checks (the worker's and the launcher's parsers, with the mounted key and tenant paths made
real, and the router's service account as a pod has it); and the pieces agree: the routers
find the worker pods by their labels at the worker's port by name, their service account may
list pods, the worker Service opens that port and the KV-event port after it, the router
Service targets the routers' port, and the routers split the tenants' limits over their
replica count.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml  # declared in the dev extra (pyproject.toml): never skipped

from sgl_fair.remote import make_keys, parse_tcp

K8S = Path(__file__).resolve().parent.parent / "docs" / "k8s"


def objects() -> list[dict]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def containers(kind: str) -> list[tuple[dict, dict]]:
    return [
        (obj, c)
        for obj in objects()
        if obj["kind"] == kind
        for c in obj["spec"]["template"]["spec"]["containers"]
    ]


def flag(args: list[str], name: str) -> list[str]:
    return [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]


@pytest.fixture
def in_a_pod(tmp_path, monkeypatch):
    """The API server and service account a router pod has (namespace, token)."""
    from sgl_fair.router import discovery_k8s

    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    (sa / "namespace").write_text("default\n")
    (sa / "token").write_text("token\n")
    monkeypatch.setattr(discovery_k8s, "SA_DIR", str(sa))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")


@pytest.fixture
def real_paths(tmp_path):
    """The manifests' mounted paths, made real in tmp_path (keys, tenants file)."""
    keys = tmp_path / "keys"
    make_keys(str(keys))
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[[tenant]]\nname = "a"\napi_keys = ["ka"]\nmax_inflight = 8\n')

    def fix(args: list[str]) -> list[str]:
        return [
            a.replace("/etc/sgl-fair/keys", str(keys)).replace(
                "/etc/sgl-fair/tenants.toml", str(tenants)
            )
            for a in args
        ]

    return fix


def test_the_manifests_parse_and_name_their_kinds():
    kinds = sorted(o["kind"] for o in objects())
    assert kinds == ["Deployment", "Role", "RoleBinding", "Service", "Service",
                     "ServiceAccount", "StatefulSet"]  # fmt: skip


def test_every_command_line_passes_its_programs_checks(real_paths, in_a_pod):
    from sgl_fair.launch.config import parse_config
    from sgl_fair.worker.__main__ import parse

    (_, worker), = containers("StatefulSet")  # fmt: skip
    assert worker["command"] == ["python", "-m", "sgl_fair.worker"]
    a, cfg, keys = parse(real_paths(worker["args"]))  # exits 2 on a bad flag
    assert keys is not None and cfg.backend == "torch"
    (_, router), = containers("Deployment")  # fmt: skip
    assert router["command"] == ["python", "-m", "sgl_fair.launch"]
    lcfg = parse_config(real_paths(router["args"]))
    assert lcfg.backend == "remote" and lcfg.worker_keys and lcfg.tenants
    assert lcfg.worker_discovery_k8s


def test_the_pieces_agree():
    (sts, worker), = containers("StatefulSet")  # fmt: skip
    (dep, router), = containers("Deployment")  # fmt: skip
    services = {o["metadata"]["name"]: o for o in objects() if o["kind"] == "Service"}
    _, port = parse_tcp(flag(worker["args"], "--bind")[0], "--bind")
    svc = sts["spec"]["serviceName"]
    # the routers find the worker pods: their labels, their port by name
    (selector,) = flag(router["args"], "--worker-discovery-k8s")
    key, value = selector.split("=", 1)
    assert sts["spec"]["template"]["metadata"]["labels"][key] == value
    port_name = (flag(router["args"], "--k8s-port-name") or ["dispatch"])[0]
    named = {p.get("name"): p["containerPort"] for p in worker["ports"]}
    assert named[port_name] == port
    assert not flag(router["args"], "--worker-endpoint")
    # … as their service account may
    account = dep["spec"]["template"]["spec"]["serviceAccountName"]
    (binding,) = [o for o in objects() if o["kind"] == "RoleBinding"]
    assert {"kind": "ServiceAccount", "name": account} in binding["subjects"]
    (role,) = [o for o in objects() if o["kind"] == "Role"
               and o["metadata"]["name"] == binding["roleRef"]["name"]]  # fmt: skip
    assert any("pods" in r["resources"] and {"get", "list"} <= set(r["verbs"])
               for r in role["rules"])  # fmt: skip
    opened = {p["port"] for p in services[svc]["spec"]["ports"]}
    assert {port, port + 1} <= opened  # dispatches and KV events
    assert int(flag(router["args"], "--tenant-limits-split")[0]) == dep["spec"]["replicas"]
    front = next(
        s for s in services.values() if s["spec"]["selector"] == {"app": "sgl-fair-router"}
    )
    router_port = int(flag(router["args"], "--port")[0])
    assert front["spec"]["ports"][0]["targetPort"] == router_port
    assert router["readinessProbe"]["httpGet"]["port"] == router_port
    mounts = {m["mountPath"] for m in worker["volumeMounts"]}
    assert flag(worker["args"], "--keys")[0] in mounts
    items = sts["spec"]["template"]["spec"]["volumes"][0]["secret"]["items"]
    assert {i["path"] for i in items} == {"worker.key_secret", "authorized/router.key"}


def sglang_objects() -> list[dict]:
    out = []
    for path in sorted((K8S / "sglang").glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def test_the_sglang_path_passes_sglangs_checks_and_ours(real_paths, in_a_pod, tmp_path):
    """docs/k8s/sglang: the servers' command line passes SGLang's own parser and the plugin
    settings ours; the router's passes the launcher's; the router finds the server pods by
    their labels, at the ports named http and kv-events that the servers listen on, runs the
    policy the servers' plugin runs, and may list pods."""
    import json

    pytest.importorskip("sglang")  # installed by make test (SGLFAIR_REQUIRE_SGLANG)
    from sglang.srt.server_args import ServerArgs

    from sgl_fair.launch.config import parse_config
    from sgl_fair.worker.sglang.settings import settings_from_env

    objs = sglang_objects()
    (sts,) = [o for o in objs if o["kind"] == "StatefulSet"]
    (dep,) = [o for o in objs if o["kind"] == "Deployment"]
    (server,) = sts["spec"]["template"]["spec"]["containers"]
    (router,) = dep["spec"]["template"]["spec"]["containers"]
    key = {"$(SGLANG_API_KEY)": "k"}
    args = [next((a.replace(k, v) for k, v in key.items() if k in a), a) for a in server["args"]]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    sargs = parser.parse_args(args)  # exits 2 on a flag SGLang does not have
    env = {e["name"]: e.get("value") for e in server["env"]}
    settings = settings_from_env(env)
    assert settings is not None
    settings.make_policy()  # the policy and its options build
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert ports["http"] == sargs.port
    kv = json.loads(sargs.kv_events_config)
    assert kv["endpoint"].endswith(f":{ports['kv-events']}") and kv["publisher"] == "zmq"
    rargs = [a.replace("/models/llama", str(tmp_path)).replace("$(SGLANG_API_KEY)", "k")
             for a in router["args"]]  # fmt: skip
    cfg = parse_config(real_paths(rargs))
    assert cfg.backend == "sglang" and cfg.worker_discovery_k8s
    assert cfg.schedule_policy == settings.policy
    label_key, value = cfg.worker_discovery_k8s.split("=", 1)
    assert sts["spec"]["template"]["metadata"]["labels"][label_key] == value
    assert (cfg.k8s_port_name or "http") in ports
    account = dep["spec"]["template"]["spec"]["serviceAccountName"]
    (binding,) = [o for o in objs if o["kind"] == "RoleBinding"]
    assert {"kind": "ServiceAccount", "name": account} in binding["subjects"]
    (role,) = [o for o in objs if o["kind"] == "Role"]
    assert any("pods" in r["resources"] and "list" in r["verbs"] for r in role["rules"])
