"""The launcher's command line: ``build_parser`` (SGLang's ``ServerArgs`` flag names).

``config.parse_config`` turns what it parses into a checked ``LaunchConfig``.
"""

from __future__ import annotations

import argparse
import os
import shutil

from sgl_fair.launch.backends import backend_names
from sgl_fair.policies import policy_names
from sgl_fair.router.policies import router_policy_names
from sgl_fair.worker.sim.hardware import GPUS, MODELS


def gpu_visible() -> bool:
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sgl_fair.launch",
        description="Start the sgl-fair router and data-parallel workers behind one HTTP API "
        "(SGLang-native /generate and OpenAI-compatible /v1).",
    )
    p.add_argument("--dp-size", "--dp", dest="dp", type=int, default=None, help="workers (GPUs)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument(
        "--model-path",
        default=None,
        help="a local model directory with a Hugging Face tokenizer (else: built-in tokenizer; "
        "a hub name is used as the served model name only)",
    )
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--schedule-policy", default="dlpm", help="local policy: " + ", ".join(policy_names())
    )
    p.add_argument("--schedule-policy-opt", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--router-policy",
        default="d2lpm",
        help="router policy: " + ", ".join(router_policy_names()),
    )
    p.add_argument("--router-policy-opt", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--cluster-oit", choices=("auto", "on", "off"), default="auto",
        help="FairServe's throttling at the router, over the whole cluster from the workers' "
        "Load reports (auto: on with --schedule-policy fairserve, unless its throttle=false)",
    )  # fmt: skip
    p.add_argument(
        "--cluster-oit-opt", action="append", default=[], metavar="KEY=VALUE",
        help="the cluster OIT's options: max_waiting (per worker), kv_threshold, "
        "interaction_timeout_s, stale_after_s, limits.* (default: fairserve's own "
        "--schedule-policy-opt values)",
    )  # fmt: skip
    p.add_argument(
        "--chunked-prefill-size", type=int, default=None,
        help="default: 8192 (sim, torch); sglang: SGLang's own (per GPU) unless given",
    )  # fmt: skip
    p.add_argument(
        "--max-running-requests", type=int, default=None,
        help="default: 256 (sim, torch); sglang: SGLang's own (per GPU) unless given",
    )  # fmt: skip
    p.add_argument(
        "--backend", choices=backend_names(), default=None,
        help="engine: 'sim' (simulated GPU; the default), 'sglang' (real SGLang servers; "
        "implied by --worker-url) or 'torch' (a Llama model in plain torch in each worker: "
        "--model tiny or a checkpoint directory). With sglang, flags this launcher does not "
        "know are passed to every SGLang server it starts",
    )  # fmt: skip
    p.add_argument(
        "--torch-dtype", default=None, choices=("float32", "float16", "bfloat16"),
        help="torch: the model's dtype",
    )  # fmt: skip
    p.add_argument(
        "--torch-device", default=None, help="torch: where the model runs (cpu, cuda, cuda:1)"
    )
    p.add_argument(
        "--torch-attention", default=None, choices=("reference", "triton"),
        help="torch: attention over the paged KV (reference: plain torch; triton: the "
        "bidirectional paged kernels, CUDA)",
    )  # fmt: skip
    p.add_argument(
        "--kv-allocator", default=None, choices=("token", "paged", "bidirectional"),
        help="the workers' KV allocator, sim and torch (paged: blocks of 16 tokens; "
        "bidirectional: BROS blocks, RT from the left, BE from the right, host checkpoints)",
    )  # fmt: skip
    p.add_argument(
        "--kv-allocator-opt", action="append", default=[], metavar="KEY=VALUE",
        help="an option of --kv-allocator (repeatable): block_size (paged, bidirectional; "
        "default 16), host_capacity_tokens (bidirectional: host memory for checkpointed BE KV, "
        "in tokens; default as much as the device pool)",
    )  # fmt: skip
    p.add_argument(
        "--worker-url", action="append", default=[], metavar="URL",
        help="sglang: an SGLang server that is already running (repeat: one per worker; "
        "dp = their number); the launcher then starts no server",
    )  # fmt: skip
    p.add_argument(
        "--worker-kv-endpoint", action="append", default=[], metavar="EP",
        help="sglang: the KV-event publisher of each --worker-url, in order (e.g. "
        "tcp://host:5557); without it the router guesses the caches from what it routed",
    )  # fmt: skip
    p.add_argument(
        "--worker-kv-replay-endpoint", action="append", default=[], metavar="EP",
        help="sglang: the replay endpoint of each --worker-kv-endpoint, in order (its "
        "--kv-events-config's replay_endpoint): the router asks it for KV-event batches it "
        "missed (servers the launcher starts get one)",
    )  # fmt: skip
    p.add_argument(
        "--worker-api-key", default=None, metavar="KEY",
        help="sglang: the SGLang servers' --api-key: the bridges send it as a Bearer token on "
        "every call, and servers the launcher starts get it (default: env "
        "SGLFAIR_WORKER_API_KEY)",
    )  # fmt: skip
    p.add_argument(
        "--bridges", choices=("router", "process"), default=None,
        help="sglang: where the bridge to each SGLang server runs: inside the router's "
        "process and event loop (router, the default: no hop per streamed token), or a "
        "process per server (process: spreads the reading of many fast streams over cores "
        "when the router's own core is the limit)",
    )  # fmt: skip
    p.add_argument(
        "--health-check-interval", type=float, default=5.0, metavar="S",
        help="sglang: seconds between a bridge's /health checks of its server",
    )  # fmt: skip
    p.add_argument(
        "--health-check-timeout", type=float, default=30.0, metavar="S",
        help="sglang: a server whose /health fails this long is taken out of routing",
    )  # fmt: skip
    p.add_argument("--gpu", default=None, help="sim: " + ", ".join(GPUS) + " (default H100-80GB)")
    p.add_argument(
        "--model", default=None,
        help="sim: " + ", ".join(MODELS) + " (default Llama-3.1-8B); torch: tiny (the default) "
        "or a local Hugging Face Llama checkpoint directory",
    )  # fmt: skip
    p.add_argument("--tp", "--tp-size", dest="tp", type=int, default=None)
    p.add_argument("--kv-tokens", type=int, default=None, help="sim: KV pool per worker (tokens)")
    p.add_argument(
        "--time-scale", type=float, default=None,
        help="sim: simulated seconds per wall second (2 = twice as fast as the GPU; "
        "inf = zero-cost engine)",
    )  # fmt: skip
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--tenants", default=None, metavar="FILE", help="tenants TOML (keys, weights)")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    p.add_argument("--max-body-bytes", type=int, default=16 << 20)
    p.add_argument("--kv-page-size", type=int, default=16, help="KV-event block size (tokens)")
    p.add_argument("--heartbeat-timeout", type=float, default=10.0, metavar="S")
    p.add_argument(
        "--sim-eos", default=None, metavar="MEDIAN[,SIGMA]|off",
        help="the simulated model stops on its own (EOS) after a log-normal number of tokens "
        "per request (default median 192, sigma 0.9; off: every request runs to its "
        "max_new_tokens); ignore_eos is respected",
    )  # fmt: skip
    p.add_argument(
        "--sim-text", default="on", choices=("on", "off"),
        help="simulated output has sentence ends, commas and newlines (so stop strings fire)",
    )  # fmt: skip
    p.add_argument(
        "--share-guard", choices=("auto", "on", "off"), default=None,
        help="while a client waits, running requests of the client holding the most KV / "
        "running slots give way to it (auto: on for the fair policies vtc, dlpm, fairserve)",
    )  # fmt: skip
    p.add_argument(
        "--max-queued-requests", type=int, default=4096, metavar="N",
        help="generation requests the server takes at once (parsing, queued or running); "
        "more get 429 + Retry-After at once, so memory stays bounded (0: no bound)",
    )  # fmt: skip
    p.add_argument(
        "--http-header-timeout", type=float, default=10.0, metavar="S",
        help="close a connection that has not sent a request's headers S seconds after it "
        "opened or after its last response (idle keep-alive and slow-header clients)",
    )  # fmt: skip
    p.add_argument(
        "--max-connections", type=int, default=None, metavar="N",
        help="open client connections at most; past it the longest-idle one is closed "
        "(default: the file limit less 512)",
    )  # fmt: skip
    p.add_argument(
        "--admin-key", default=None, metavar="KEY",
        help="Bearer key for /metrics, /server_info and /flush_cache (besides admin tenants' "
        "keys); default: env SGLFAIR_ADMIN_KEY",
    )  # fmt: skip
    p.add_argument(
        "--admin-loopback", default="on", choices=("on", "off"),
        help="callers on loopback reach the admin endpoints without a key (turn off behind a "
        "proxy on the same host)",
    )  # fmt: skip
    p.add_argument(
        "--worker-restart-backoff", type=float, default=0.5, metavar="S",
        help="restart a simulated worker whose process exited after S seconds, doubling per "
        "restart up to 30 s (0: never restart)",
    )  # fmt: skip
    p.add_argument(
        "--rt-priority-threshold", type=int, default=None, metavar="N",
        help="SGLang's integer `priority` field sets a request's service class when it gives "
        "no priority_class: priority >= N is real-time (RT), below is best-effort (default: "
        "priority does not set a class)",
    )  # fmt: skip
    p.add_argument(
        "--schedule-low-priority-values-first", action="store_true",
        help="with --rt-priority-threshold: priority <= N is RT (SGLang's flag of that name; "
        "also passed on to SGLang servers the launcher starts)",
    )  # fmt: skip
    p.add_argument(
        "--startup-timeout", type=float, default=None, metavar="S",
        help="wait this long for every worker (default: 120; sglang: 900, loading a model "
        "takes minutes)",
    )  # fmt: skip
    p.add_argument(
        "--min-ready-workers", type=int, default=None, metavar="N",
        help="serve once N workers said Hello, within --startup-timeout (default: every "
        "one); the others join when they do, as a worker restarted at run time does (a "
        "router replica rolled out while a GPU node is down starts with the rest)",
    )  # fmt: skip
    # ---- many hosts (docs/operators.md): remote workers and router replicas ----
    p.add_argument(
        "--worker-endpoint", action="append", default=[], metavar="tcp://HOST:PORT",
        help="a standalone worker (python -m sgl_fair.worker --bind tcp://HOST:PORT) to route "
        "to; repeatable. Implies --backend remote: this process is a router only",
    )  # fmt: skip
    p.add_argument(
        "--worker-endpoints-file", default=None, metavar="FILE",
        help="more --worker-endpoint ones, one a line, watched: a line added joins that "
        "worker, a line removed drains it (also implies --backend remote)",
    )  # fmt: skip
    p.add_argument(
        "--worker-discovery-k8s", default=None, metavar="SELECTOR",
        help="find standalone workers in Kubernetes: the ready pods of this label selector "
        "(e.g. app=sgl-fair-worker) in the namespace, at their container port --k8s-port-name; "
        "a pod that turns ready joins, one that goes is drained (implies --backend remote)",
    )  # fmt: skip
    p.add_argument("--k8s-port-name", default=None, metavar="NAME",
                   help="the workers' container port by name (default dispatch; with "
                   "--backend sglang, http: the server's; its KV events: kv-events)")  # fmt: skip
    p.add_argument("--k8s-namespace", default=None,
                   help="default: the router pod's own (its service account's)")  # fmt: skip
    p.add_argument("--k8s-api", default=None, metavar="URL",
                   help="the API server; default: the pod's (KUBERNETES_SERVICE_HOST)")  # fmt: skip
    p.add_argument("--k8s-token-file", default=None, metavar="FILE",
                   help="default: the pod's service account token")  # fmt: skip
    p.add_argument("--k8s-period-s", type=float, default=2.0,
                   help="how often the pods are listed (default 2)")  # fmt: skip
    p.add_argument(
        "--router-only", action="store_true",
        help="start no workers: route to the --worker-endpoint ones (implied by them)",
    )  # fmt: skip
    p.add_argument(
        "--worker-keys", default=None, metavar="DIR",
        help="CURVE keys for --worker-endpoint: DIR/router.key_secret and DIR/worker.key "
        "(python -m sgl_fair.worker --make-keys DIR); needed off loopback",
    )  # fmt: skip
    p.add_argument(
        "--insecure", action="store_true",
        help="allow a non-loopback --worker-endpoint without --worker-keys (plain text)",
    )  # fmt: skip
    p.add_argument(
        "--router-replicas", type=int, default=None, metavar="R",
        help="start --dp workers (standalone sim/torch workers, or SGLang servers) and R router "
        "replicas over them, on ports --port .. --port+R-1 (for trying replicas on one host)",
    )  # fmt: skip
    p.add_argument(
        "--replica-state", choices=("shared", "independent"), default="shared",
        help="with --worker-endpoint / --router-replicas: share the fairness state through "
        "the workers' service reports (shared), or each replica alone (independent)",
    )  # fmt: skip
    p.add_argument(
        "--tenant-limits-split", type=int, default=1, metavar="R",
        help="enforce 1/R of each tenant's max_inflight, rpm and burst here (this router is "
        "one of R replicas behind a load balancer; --router-replicas sets it); with R > 1 a "
        "replica that shares no service reports (over SGLang servers, or --replica-state "
        "independent) takes each worker's queue from its Load, every replica's requests",
    )  # fmt: skip
    return p
