"""``bench/bench_live_cell.py``'s flags, the live load test's programs and its claims, without
starting a server: the table's logic on fabricated rows."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_live_cell.py"
_spec = importlib.util.spec_from_file_location("bench_live_cell", BENCH)
blc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(blc)


def _row(label: str, sim: float, live: float) -> dict:
    side = {"jain": 0.9, "p99_well_behaved_s": 1.0, "cache_hit_rate": 0.8, "makespan_s": 40.0}
    return {
        "label": label,
        "sim": {**side, "throughput_tok_s": sim},
        "live": {**side, "throughput_tok_s": live, "router_lag_max_s": 0.01},
    }


def test_flags() -> None:
    args = blc.parse_args([])
    assert [c.label for c in args.combos] == ["D2LPM", "RR+LPM", "Preble", "VTC", "CacheAware+LPM"]
    assert (args.gpu, args.model, args.rate_scale) == ("H100-80GB", "Llama-3.1-8B", 2.5)
    args = blc.parse_args(["--combos", "VTC,D2LPM", "--time-scale", "0.25"])
    assert [c.label for c in args.combos] == ["D2LPM", "VTC"]  # grid order
    assert "0.25" in blc.server_args(args.combos[0], args)
    for bad in (["--combos", "LPM"], ["--time-scale", "0"], ["--duration", "-1"]):
        with pytest.raises(SystemExit):
            blc.parse_args(bad)


@pytest.mark.parametrize("scale", [1.0, 0.4])
def test_live_programs_are_the_simulators(scale: float) -> None:
    args = blc.parse_args(["--duration", "4", "--time-scale", str(scale), "--seed", "2"])
    check = blc.check_same_programs(args)
    assert check["same"], check["problems"]
    assert check["programs"] > 0 and set(check["per_client"]) == {"c0", "c1", "c2", "c3"}


def test_claims_on_fabricated_rows() -> None:
    rows = [_row("A", 100.0, 95.0), _row("B", 90.0, 96.0), _row("C", 80.0, 70.0)]
    res = blc.compare(rows, tolerance=0.15)
    assert res["sim_order"] == ["A", "B", "C"] and res["live_order"] == ["B", "A", "C"]
    assert not res["orders_match"] and not res["orders_match_up_to_ties"]
    assert res["discordant"] == ["A>B (sim +11.1%)"]
    assert res["within_tolerance"]
    assert [round(r["ratio"], 3) for r in res["rows"]] == [0.95, 1.067, 0.875]
    text = blc.format_table(res)
    assert "orders match: no" in text and "within ±15% of sim: yes" in text

    rows = [_row("A", 100.0, 90.0), _row("B", 99.5, 95.0), _row("C", 50.0, 30.0)]
    res = blc.compare(rows, tolerance=0.15)
    assert res["orders_match_up_to_ties"] and res["swapped_ties"]  # A, B within 1 % in sim
    assert not res["within_tolerance"] and not res["rows"][2]["within"]
