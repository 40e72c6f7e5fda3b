"""``make bench``: run every benchmark and print one JSON document with machine and date."""

from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import bench_cluster_quality  # noqa: E402
import bench_fairserve  # noqa: E402
import bench_flood  # noqa: E402
import bench_kv_decoder  # noqa: E402
import bench_live  # noqa: E402
import bench_live_cell  # noqa: E402
import bench_liveness  # noqa: E402
import bench_policy_step  # noqa: E402
import bench_relay  # noqa: E402
import bench_replica_ledger  # noqa: E402
import bench_router  # noqa: E402
import bench_service_read  # noqa: E402
import bench_sglang_adapter  # noqa: E402
import bench_sglang_live  # noqa: E402
import bench_sglang_side_by_side  # noqa: E402
import bench_sim_speed  # noqa: E402

from sgl_fair.experiment import bros, stored  # noqa: E402


def machine() -> str:
    m = stored.machine()  # the stored results' own reading of the machine
    return f"{m['cpu']}, {m['cores']} cores, Python {m['python']}"


def bros_overhead() -> dict:
    """BROS's scheduler cost per iteration (issue 12), full length: rows and claims."""
    out = bros.run_overhead(False, 0)
    return {"rows": out["rows"], "claims": out["claims"]}


def main() -> None:
    sys.argv = sys.argv[:1]
    results = {
        "date": dt.date.today().isoformat(),
        "machine": machine(),
        "sim_speed": bench_sim_speed.main(),
        "bros_overhead": bros_overhead(),
        "policy_step": bench_policy_step.main(),
        "fairserve": bench_fairserve.main([]),
        "router": bench_router.main(),
        "kv_decoder": bench_kv_decoder.main([]),
        "replica_ledger": bench_replica_ledger.main([]),
        "cluster_quality": bench_cluster_quality.main([]),
        "live": bench_live.main(),
        "live_cell": bench_live_cell.main([]),
        "flood": bench_flood.main([]),
        "liveness": bench_liveness.main([]),
        "plugin_property": bench_liveness.main(["--test", "plugin", "--examples", "500"]),
        "sglang_adapter": bench_sglang_adapter.main(),
        "sglang_adapter_unified": bench_sglang_adapter.main(
            ["--waiting", "1000", "--cases", "plugin:dlpm,plugin-exact:dlpm", "--cache", "unified"]
        ),
        "sglang_live": bench_sglang_live.main([]),
        "sglang_live_churn": bench_sglang_live.main(["--churn", "--requests", "2000"]),
        "sglang_side_by_side": bench_sglang_side_by_side.main(["--duration", "10"]),
        "relay": bench_relay.main(["--duration", "10"]),
        "service_read": bench_service_read.main(["--reads", "20", "--rows", "200"]),
    }
    out = Path("runs") / "bench.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
