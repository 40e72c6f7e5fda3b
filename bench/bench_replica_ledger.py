"""A worker's service ledger under one-shot clients: per-report bytes and time stay flat.

Issue 40's bound: 100,000 one-shot clients (each sends one call and never returns) through
R = 4 replicas; a worker reports every period (the live Load period, 0.1 s) with ``clients
per period`` new ones. Printed at checkpoints (each a snapshot report, the largest): the rows
in it, the bytes of the report on the wire (its ``Load``, msgpack) and their mean over the
last ten reports (one snapshot, nine reports of the changed rows), the time of
``ledger.report()`` and of one replica's ``ReplicaState.report()``. Before the (replica,
client) rows (the ledger of 2026-11-27: totals of every client ever seen, in every report),
bytes and time grew with every client seen; now they follow the clients active in the last
``idle_reports`` reports.

Runs either ledger: the API is detected (``received(rid, replica, ...)`` is the new one), so
a checkout of the old code can be measured with the same file (``PYTHONPATH``).
``--json FILE`` stores the rows (``bench/results``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import sys
import time

from sgl_fair.messages import Load
from sgl_fair.router.replica_state import ReplicaState
from sgl_fair.transport import encode
from sgl_fair.worker.service_ledger import ServiceLedger


def run(clients: int, per_report: int, replicas: int) -> list[dict]:
    ledger = ServiceLedger()
    new_api = "rid" in inspect.signature(ledger.received).parameters
    view = ReplicaState(replica=0)
    seqs = [0] * replicas
    checkpoints = {1_000, 10_000, 50_000, clients}
    rows: list[dict] = []
    recent: list[int] = []  # the last 10 reports' bytes: one snapshot and nine deltas
    sent = 0
    while sent < clients:
        for _ in range(per_report):
            rid = client = f"c{sent}"
            r = sent % replicas
            if new_api:
                ledger.received(rid, r, client, 100)
                ledger.sent(rid, 20)
            else:
                seqs[r] += 1
                ledger.received(r, seqs[r], client, 100)
                ledger.sent(client, 20)
                if r == 0:  # the old view must see its own dispatches first
                    view.dispatched(0, client, 100)
                    view.finished(0, client, 20)
            sent += 1
        t0 = time.perf_counter()
        report = ledger.report()
        t1 = time.perf_counter()
        wire = encode(Load(0, t1, 0, 0, 0, 0, 1, service=report))
        t2 = time.perf_counter()
        view.report(0, float(sent), report)
        t3 = time.perf_counter()
        recent = [*recent[-9:], len(wire)]
        if sent in checkpoints:
            n_rows = len(report.rows) if new_api else len(report.clients)
            rows.append({"clients_seen": sent, "rows_in_report": n_rows,
                         "report_bytes": len(wire), "mean_bytes_last_10": sum(recent) // 10,
                         "ledger_report_ms": round((t1 - t0) * 1e3, 3),
                         "replica_report_ms": round((t3 - t2) * 1e3, 3),
                         "ledger": "rows" if new_api else "totals"})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=100_000)
    ap.add_argument("--per-report", type=int, default=50, help="new clients per report")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--json", metavar="FILE", help="store the rows here")
    a = ap.parse_args(argv)
    if a.clients < 1 or a.per_report < 1 or a.replicas < 1:
        ap.error("--clients, --per-report and --replicas must be >= 1")
    rows = run(a.clients, a.per_report, a.replicas)
    for row in rows:
        print(row)
    out = {"bench": "replica-ledger", "date": time.strftime("%Y-%m-%d"),
               "machine": f"{platform.processor() or platform.machine()}, "
                          f"Python {platform.python_version()}",
               "clients": a.clients, "per_report": a.per_report, "replicas": a.replicas,
           "rows": rows}  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
