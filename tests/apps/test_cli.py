"""``python -m sgl_fair.experiment``: happy paths and one-line errors with exit status 2."""

import json
import subprocess
import sys

import pytest

from sgl_fair.experiment import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sgl_fair.experiment", *args], capture_output=True, text=True
    )


def assert_usage_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got: {proc.stderr!r}"
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def write_trace(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = [
    '{"arrival_s": 0.0, "client": "a", "input_len": 64, "output_len": 16}',
    '{"arrival_s": 0.1, "client": "b", "input_len": 64, "output_len": 16, "prefix_group": "s"}',
    '{"arrival_s": 0.2, "client": "a", "input_len": 80, "output_len": 8, "prefix_group": "s"}',
]


def test_list_names_every_experiment(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("vtc-overload", "vtc-dist-shift", "vtc-weighted"):
        assert name in out


def test_replay_json_row(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.jsonl", GOOD)
    assert main(["replay", "--trace", str(trace), "--policy", "dlpm", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    for key in (
        "policy",
        "throughput_tok_s",
        "throughput_req_s",
        "jain",
        "service_diff_max",
        "service_diff_avg",
        "ttft_p50_s",
        "ttft_p99_s",
        "cache_hit_rate",
        "clients",
    ):
        assert key in row
    assert row["num_finished"] == 3
    assert row["cache_hit_rate"] > 0  # the two prefix-group requests share 32+ tokens
    assert set(row["clients"]) == {"a", "b"}


def test_replay_policy_options_and_gpu(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.jsonl", GOOD)
    argv = [
        "replay",
        "--trace",
        str(trace),
        "--policy",
        "vtc",
        "--policy-opt",
        "predict=oracle",
        "--gpu",
        "H100",
        "--model",
        "Llama-3.1-8B",
        "--kv-tokens",
        "5000",
        "--json",
    ]
    assert main(argv) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["kv_tokens"] == 5000 and row["worker"]["gpu"] == "H100-80GB"


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["run", "no-such-experiment"], ["unknown experiment", "no-such-experiment"]),
        (["replay", "--trace", "TRACE", "--policy", "nope"], ["unknown policy", "nope"]),
        (["replay", "--trace", "TRACE", "--policy", "vtc", "--gpu", "K80"], ["unknown GPU", "K80"]),
        (["replay", "--trace", "TRACE", "--policy", "vtc", "--model", "gpt-9"], ["gpt-9"]),
        (
            ["replay", "--trace", "TRACE", "--policy", "dlpm", "--policy-opt", "quantum=-1"],
            ["quantum"],
        ),
        (["replay", "--trace", "TRACE", "--policy", "dlpm", "--policy-opt", "bogus=1"], ["bogus"]),
        (["replay", "--trace", "TRACE", "--policy", "vtc", "--kv-tokens", "0"], ["--kv-tokens"]),
        (["replay", "--trace", "/no/such/file.jsonl", "--policy", "vtc"], ["no such file"]),
        (["replay", "--policy", "vtc"], ["--trace"]),
        (["frobnicate"], ["frobnicate"]),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, argv, needles):
    trace = write_trace(tmp_path / "t.jsonl", GOOD)
    argv = [str(trace) if a == "TRACE" else a for a in argv]
    assert_usage_error(run_cli(*argv), *needles)


@pytest.mark.parametrize(
    ("line", "needles"),
    [
        ('{"arrival_s": 0, "client": "a", "input_len": -3, "output_len": 4}', ["input_len"]),
        ('{"arrival_s": 0, "client": "a", "output_len": 4}', ["input_len"]),
        (
            '{"arrival_s": 0, "client": "a", "input_len": 3, "output_len": 4, "colour": 1}',
            ["colour"],
        ),
        ("{not json", ["invalid JSON"]),
    ],
)
def test_malformed_trace_line_names_line_and_field(tmp_path, line, needles):
    trace = write_trace(tmp_path / "bad.jsonl", [GOOD[0], line])
    proc = run_cli("replay", "--trace", str(trace), "--policy", "fcfs")
    assert_usage_error(proc, "bad.jsonl:2", *needles)


def test_run_writes_report_and_plots(tmp_path):
    out = tmp_path / "out"
    proc = run_cli("run", "vtc-weighted", "--quick", "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["experiment"] == "vtc-weighted" and data["all_claims_passed"]
    assert json.loads((out / "results.json").read_text())["rows"] == data["rows"]
    for name in ("report.md", "service_rate.png", "response_time.png", "service_diff.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "service_rate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_reader_that_goes_away_gets_no_traceback():
    """``python -m sgl_fair.experiment list | head -1``: the pipe closes before the output is
    written; the command stops quietly instead of printing a BrokenPipeError traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "sgl_fair.experiment", "list"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # before the interpreter has even started: every write fails
    _, err = proc.communicate(timeout=60)
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()
