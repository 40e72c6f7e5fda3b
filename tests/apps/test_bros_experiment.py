"""The BROS experiments (apps/experiment/bros.py): one small hybrid run, rows and registry."""

from __future__ import annotations

from sgl_fair.experiment import bros, cli

ROW_FIELDS = {
    "policy",
    "rate",
    "rt_norm_latency_s",
    "rt_ttft_attain",
    "rt_tpot_attain",
    "be_throughput_req_s",
    "be_throughput_tok_s",
}


def test_small_hybrid_run_finishes_in_seconds_with_the_issue_fields():
    rows = {p: bros.run_one(p, 2.0, 4.0, seed=0) for p in ("fcfs", "rr", "bros")}
    for policy, row in rows.items():
        assert set(row) >= ROW_FIELDS, policy
        assert row["rt_unfinished"] == 0 and row["rt_num"] > 0, row
        assert 0.0 <= row["rt_ttft_attain"] <= 1.0 and 0.0 <= row["rt_tpot_attain"] <= 1.0
        assert row["be_throughput_tok_s"] > 0, row
        assert row["sim_wall_s"] < 30, row
    # A BE batch's prefill delays FCFS's RT first tokens; BROS serves RT first.
    assert rows["bros"]["rt_ttft_attain"] >= rows["fcfs"]["rt_ttft_attain"]
    claims = bros.hybrid_claims(list(rows.values()))
    assert len(claims) == 4 and all({"text", "passed", "detail"} <= set(c) for c in claims)


def test_bicache_rows_run_on_both_allocators():
    for allocator in ("paged", "bidirectional"):
        row = bros.run_one("bros", 2.0, 2.0, 0, allocator=allocator, kv_tokens=6000)
        assert row["rt_unfinished"] == 0, (allocator, row)


def test_registered_with_the_cli(capsys):
    assert {"bros-hybrid", "bros-bicache", "bros-overhead"} <= set(bros.EXPERIMENTS)
    assert cli.main(["list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in bros.EXPERIMENTS)


def test_selection_time_is_measured():
    assert 0 < bros.selection_time_ms(num_rt=32, num_be=32, repeats=3) < 1000
