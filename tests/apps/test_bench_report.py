"""Results are data, prose cites them (issue 41, item 1).

* BENCHMARKS.md's current-figures table is exactly what ``bench/report.py`` generates from the
  stored files in ``bench/results/`` (it cannot drift);
* every README figure declared in ``bench/figures.py: README_QUOTES`` appears in the README
  with the stored value;
* each check fails when a stored value, the table or a README figure changes (shown on copies);
* ``experiment run NAME --results DIR`` stores rows and claims with date, commit and machine.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

from sgl_fair.experiment import stored
from sgl_fair.experiment.cli import main as experiment_main

ROOT = Path(__file__).resolve().parents[2]


def _load_report():
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = _load_report()


def _copies(tmp_path: Path) -> tuple[Path, Path, Path]:
    results = tmp_path / "results"
    shutil.copytree(ROOT / "bench" / "results", results)
    bench = tmp_path / "BENCHMARKS.md"
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "BENCHMARKS.md", bench)
    shutil.copy(ROOT / "README.md", readme)
    return results, bench, readme


def _check(results: Path, bench: Path, readme: Path) -> int:
    argv = ["--check", "--results", str(results), "--benchmarks", str(bench)]
    return report.main([*argv, "--readme", str(readme)])


def test_the_table_in_benchmarks_is_what_the_stored_files_give():
    doc = report.BENCHMARKS.read_text()
    assert doc.count(report.BEGIN) == 1 and doc.count(report.END) == 1
    assert doc.index(report.BEGIN) < doc.index("\n## 20")  # at the top, the journal below
    table = report.render(report.figures())
    assert report.splice(doc, table) == doc, "stale: run `make bench-report`"


def test_every_readme_figure_is_the_stored_one():
    assert report.readme_mismatches(report.README.read_text(), report.figures()) == []


def test_every_headline_figure_has_a_stored_value():
    rows = report.figures()
    missing = [r["name"] for r in rows if r["value"] == "—"]
    assert missing == []
    assert len(report.quotes(rows)) == len(report.README_QUOTES)  # every {key} is a figure


def test_a_changed_stored_value_fails_the_check_until_the_report_is_rerun(tmp_path, capsys):
    results, bench, readme = _copies(tmp_path)
    assert _check(results, bench, readme) == 0
    source = next(r["source"] for r in report.figures(results) if r["key"] == "sbs-tokens")
    path = results / source  # the newest side-by-side file, whichever it is
    data = json.loads(path.read_text())
    data["ratios"]["ours"]["tokens"] = 0.5
    path.write_text(json.dumps(data))
    assert _check(results, bench, readme) == 1
    assert "table is stale" in capsys.readouterr().err
    assert report.main(["--results", str(results), "--benchmarks", str(bench)]) == 0
    assert _check(results, bench, readme) == 0
    line = next(x for x in bench.read_text().splitlines() if "tokens served" in x)
    assert "| 0.50× | ≥ 0.95× | **missed** |" in line  # a missed target is printed, not hidden


def test_a_hand_edited_table_fails_the_check(tmp_path):
    results, bench, readme = _copies(tmp_path)
    value = next(r["value"] for r in report.figures(results) if r["key"] == "sbs-relay-cpu")
    edited = bench.read_text().replace(f"| {value} |", "| 1.90× |", 1)
    assert edited != bench.read_text()
    bench.write_text(edited)
    assert _check(results, bench, readme) == 1


def test_a_readme_figure_that_differs_from_its_file_fails(tmp_path, capsys):
    results, bench, readme = _copies(tmp_path)
    rows = report.figures(results)
    value = next(r["value"] for r in rows if r["key"] == "bicache-rate-ttft-32")
    quote = report.quotes(rows)[0]
    assert f"TTFT attainment {value} at BE batch 32" in quote
    text = " ".join(readme.read_text().split())  # the quote may span lines
    assert quote in text
    readme.write_text(text.replace(quote, quote.replace(value, "1.15×", 1)))
    assert _check(results, bench, readme) == 1
    assert "README lacks" in capsys.readouterr().err


def test_a_failing_claim_reads_fail():
    rows = {r["key"]: r for r in report.figures()}
    assert rows["bicache-rate-ttft-32"]["status"] == "**FAIL**"
    assert rows["kv-gc"]["status"] == "pass"


def test_the_newest_file_of_a_glob_is_the_source(tmp_path):
    for date, value in (("2026-11-01", 1.0), ("2026-11-29", 2.0), ("2026-11-15", 3.0)):
        stored.write(tmp_path / f"sim-speed-{date}.json", "bench", "sim-speed",
                     {"min_speedup": value, "max_speedup": value}, date=date)  # fmt: skip
    rows = {r["key"]: r for r in report.figures(tmp_path)}
    assert rows["sim-speed-min"]["value"] == "2× real time"
    assert rows["sim-speed-min"]["date"] == "2026-11-29"
    assert rows["sim-speed-min"]["status"] == "**missed**"
    assert rows["sbs-tokens"]["status"] == "no stored file"


def test_lookup_selects_list_elements_by_fields():
    data = {"rows": [{"case": "a:b", "rate": 10.0, "x": {"~1": 3}}, {"case": "c", "rate": 6}]}
    assert report.lookup(data, "rows[case=a:b,rate=10].x.~1") == 3
    assert report.lookup(data, "rows[1].rate") == 6
    with pytest.raises(KeyError, match="matches 0"):
        report.lookup(data, "rows[case=z].x")


def test_experiment_run_stores_rows_claims_date_commit_machine(tmp_path, capsys):
    out, results = tmp_path / "out", tmp_path / "results"
    argv = ["run", "vtc-weighted", "--quick", "--out", str(out), "--results", str(results)]
    assert experiment_main([*argv, "--date", "2026-11-29"]) == 0
    path = results / "vtc-weighted-quick-2026-11-29.json"
    assert f"stored: {path}" in capsys.readouterr().out
    data = json.loads(path.read_text())
    assert (data["schema"], data["kind"], data["name"]) == (stored.SCHEMA, "experiment",
                                                            "vtc-weighted")  # fmt: skip
    prov = data["provenance"]
    assert prov["date"] == "2026-11-29" and prov["commit"]
    assert set(prov["machine"]) == {"cpu", "cores", "python"}
    assert prov["command"][-4:] == ["--results", str(results), "--date", "2026-11-29"]
    same = json.loads((out / "results.json").read_text())
    assert {k: data[k] for k in same} == same  # the results.json keys, unchanged
    assert data["rows"] and data["claims"]


def test_date_without_results_is_a_usage_error(tmp_path, capsys):
    assert experiment_main(["run", "vtc-weighted", "--date", "2026-11-29"]) == 2
    assert "--date: only with --results" in capsys.readouterr().err
    argv = ["run", "vtc-weighted", "--results", str(tmp_path), "--date", "29/11"]
    assert experiment_main(argv) == 2


def test_a_long_run_stores_the_provenance_it_started_with(tmp_path):
    """A bench takes ``provenance()`` as it starts and stores that: a commit made while it
    ran (the checkout moving on) is not the commit that ran."""
    started = stored.provenance("2026-11-29", ["bench.py"])
    started["commit"] = "abc1234"  # as if HEAD had moved since
    path = stored.write(tmp_path, "bench", "x", {"v": 1}, started=started)
    data = json.loads(path.read_text())
    assert path.name == "x-2026-11-29.json"
    assert data["provenance"]["commit"] == "abc1234" and data["v"] == 1
    assert stored.write(tmp_path / "y.json", "bench", "x", {"v": 2}).name == "y.json"
