"""``python -m sgl_fair.launch --dp 4``: one router process (HTTP front + router) and N workers.

::

    clients ──HTTP──▶ router process (this one): uvicorn + Starlette, the global router
                         │ zmq (ipc in a private temp dir)
                         ├──▶ worker 0 process: scheduler + simulated engine (wall clock)
                         ├──▶ …
                         └──▶ worker N-1

``--backend sglang`` puts real SGLang servers behind the same router: the launcher starts one
``sglang.launch_server`` per worker (our local policy switched on inside it by the plugin's
environment variables; flags we do not know are passed through to every server) and one
bridge process per server that speaks the worker protocol to the router and HTTP to the
server; the router follows each server's KV events directly::

    router ──zmq──▶ bridge i ──HTTP──▶ SGLang server i (GPUs i*tp ..)   KV events ──zmq──▶ router

``--worker-url URL`` (repeated) does the same for servers that are already running: only the
bridges are started (``--worker-kv-endpoint`` names their KV-event publishers).

Flags follow SGLang's ``ServerArgs`` names where SGLang has one. Ctrl-C / SIGTERM stop the
server, tell every worker to stop, wait for them (killing stragglers), stop the SGLang servers
it started and remove the sockets. Errors in flags, the tenants file or the model path are one
line naming the flag, exit 2.

This is a command-line app (the top layer): it may import every layer below; nothing imports
it. Modules: ``flags`` (the parser), ``config`` (the checked configuration), ``backends`` (one
``Backend`` object per engine: its flags, checks, workers and what the protocol passes to
it), ``workers`` (the worker processes of one launch; sim and torch), ``sglang`` (the SGLang
servers and bridges), ``serve`` (the router process and the event loop).
"""

from sgl_fair.launch.backends import BACKENDS, Backend, backend_of
from sgl_fair.launch.config import LaunchConfig, local_policy_opts, parse_config
from sgl_fair.launch.flags import build_parser, gpu_visible
from sgl_fair.launch.ports import free_ports, port_free
from sgl_fair.launch.serve import main, serve
from sgl_fair.launch.sglang import (
    bridge_configs,
    probe_servers,
    sglang_server_command,
    sglang_servers,
)
from sgl_fair.launch.workers import LocalWorkers, ProcessGroup, Workers

__all__ = [
    "BACKENDS",
    "Backend",
    "LaunchConfig",
    "LocalWorkers",
    "ProcessGroup",
    "Workers",
    "bridge_configs",
    "backend_of",
    "build_parser",
    "free_ports",
    "gpu_visible",
    "local_policy_opts",
    "main",
    "parse_config",
    "port_free",
    "probe_servers",
    "serve",
    "sglang_server_command",
    "sglang_servers",
]
