"""The BROS experiments (apps/experiment/bros.py): one small hybrid run, rows and registry."""

from __future__ import annotations

from sgl_fair.experiment import bros, bros_workload, cli

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


def test_claims_and_regimes_are_per_be_batch_size():
    rows = [
        bros.run_one(p, 2.0, 4.0, seed=0, be_batch=b)
        for b in (8, 64)
        for p in ("fcfs", "rr", "bros")
    ]
    assert {r["be_batch"] for r in rows} == {8, 64}
    claims = bros.hybrid_claims(rows)
    assert len(claims) == 8
    assert sum("(BE batch 8)" in c["text"] for c in claims) == 4
    assert sum("(BE batch 64)" in c["text"] for c in claims) == 4
    regimes = {r["be_batch"]: r for r in bros.hybrid_regimes(rows)}
    fcfs = {r["be_batch"]: r["rt_ttft_attain"] for r in rows if r["policy"] == "fcfs"}
    assert {b: regimes[b]["fcfs_rt_ttft_attain"] for b in (8, 64)} == fcfs


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


def test_token_clock_counts_each_rt_token_against_the_tpot_slo():
    from sgl_fair.request import Request, ServiceClass

    a = Request("a", "c", (1, 2), 4, 0.0, service_class=ServiceClass.RT, tpot_slo_s=0.2)
    b = Request("b", "c", (1, 2), 4, 0.0, service_class=ServiceClass.RT, tpot_slo_s=0.2)
    be = Request("x", "c", (1, 2), 4, 0.0, service_class=ServiceClass.BE)
    clock = bros_workload.TokenClock()
    clock.tick([a, be], 1.0)  # a's first token: TTFT's, not TPOT's
    clock.tick([a, be], 1.1)  # on time
    clock.tick([a], 1.5)  # 0.4 s late
    clock.tick([a], 1.6)  # on time
    a.finish_s = 1.6
    assert clock.tokens[id(a)] == 3 and clock.on_time[id(a)] == 2
    assert id(be) not in clock.tokens
    # b never finished: 0; a: 2 of 3 on time.
    assert abs(clock.attainment([a, b]) - (2 / 3) / 2) < 1e-9
    b.finish_s = 2.0  # finished with only its first token: nothing was late
    assert abs(clock.attainment([a, b]) - (2 / 3 + 1) / 2) < 1e-9


def test_bicache_rows_carry_their_arm_and_the_claims_the_papers_figures():
    from sgl_fair.experiment import bros_bicache as bb

    rows = [bb.run_arm(a, 2.0, 2.0, 0, setting=bb.PAPER, be_batch=8) for a in bb.ARM_NAMES]
    assert [r["arm"] for r in rows] == [
        "bidirectional", "paged-recompute", "paged-retract-be", "paged-wait",
        "paged-recompute-vllm",
    ]  # fmt: skip
    for r in rows:
        assert r["setting"] == "paper" and r["admission"] == "prompt" and r["be_batch"] == 8
        assert r["bicache"] is (r["arm"] == "bidirectional")  # the earlier fields stay
        assert r["rt_unfinished"] == 0 and r["rt_retractions"] >= 0
    summary = bb.summarize(rows, at_rate=2.0)
    claims = summary["claims"]
    assert len(claims) == 4 and all({"text", "passed", "detail"} <= set(c) for c in claims)
    assert "paper: 1.23x" in claims[0]["text"] and "paper: 1.63x" in claims[1]["text"]
    assert all("ours=" in c["detail"] for c in claims)
    assert ["(paged-recompute;" in c["text"] for c in claims] == [True, True, False, False]
    assert all("(paged-recompute-vllm;" in c["text"] for c in claims[2:])
    (cell,) = summary["gains"]
    assert {f"vs_{a}" for a in bb.ARM_NAMES[1:]} <= set(cell)
    assert set(cell["rt_recomputed"]) == set(bb.ARM_NAMES)


def test_bicache_paper_setting_is_opt30b_tp4_on_a100_40gb():
    from sgl_fair.experiment import bros_bicache as bb

    cm = bb.PAPER.cost_model()
    assert (cm.gpu.name, cm.model.name, cm.tp) == ("A100-40GB", "OPT-30B", 4)
    assert bb.PAPER.pool_tokens() == cm.kv_capacity_tokens(0.90)
    duration, cells = bb.paper_cells(quick=False)
    assert duration == 60.0
    assert {r for s, r, _ in cells if s is bb.PAPER} == {6.0, 8.0, 10.0, 12.0, 14.0}
    assert {(s.admission, r) for s, r, _ in cells if s is bb.PAPER_RESERVE} == {("reserve", 10.0)}
    duration, cells = bb.paper_cells(quick=True)
    assert duration == 15.0 and {(s, r) for s, r, _ in cells} == {(bb.PAPER, 10.0)}
