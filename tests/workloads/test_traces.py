import json
import os

import pytest

from sgl_fair.request import ServiceClass
from sgl_fair.workloads.arrivals import Constant, Gamma, Poisson
from sgl_fair.workloads.lengths import Normal, Uniform
from sgl_fair.workloads.traces import (
    ClientSpec,
    TraceError,
    TraceRecord,
    client_weights,
    generate,
    group_tokens,
    load_trace,
    parse_trace_lines,
    parse_trace_records,
    record_of,
    save_trace,
    stable_hash,
)


def common_prefix_len(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def summary(reqs):
    return [(r.rid, r.client, r.arrival_s, r.input_ids, r.output_len) for r in reqs]


ALICE = ClientSpec("alice", Poisson(5.0), Uniform(20, 60), Uniform(5, 50))
BOB = ClientSpec("bob", Gamma(3.0, cv=2.0), Normal(40.0, 10.0), 16, weight=2.0)


# ---------------------------------------------------------------------------------------------
# generate()


def test_generate_is_deterministic_per_seed():
    a = generate([ALICE, BOB], duration_s=20.0, seed=3)
    assert len(a) > 100
    assert summary(a) == summary(generate([ALICE, BOB], duration_s=20.0, seed=3))
    assert summary(a) != summary(generate([ALICE, BOB], duration_s=20.0, seed=4))


def test_client_streams_do_not_depend_on_other_clients():
    alone = generate([ALICE], duration_s=20.0, seed=1)
    carol = ClientSpec("carol", Poisson(50.0), 100, 10, prefix_group="sys")
    with_others = generate([ALICE, BOB, carol], duration_s=20.0, seed=1)
    assert summary(alone) == summary([r for r in with_others if r.client == "alice"])


def test_generate_sorted_by_arrival_then_client_order():
    reqs = generate(
        [ClientSpec("zed", Constant(1.0), 8, 4), ClientSpec("amy", Constant(1.0), 8, 4)],
        duration_s=3.0,
    )
    assert [(r.arrival_s, r.rid) for r in reqs] == [
        (0.0, "zed-0"),
        (0.0, "amy-0"),
        (1.0, "zed-1"),
        (1.0, "amy-1"),
        (2.0, "zed-2"),
        (2.0, "amy-2"),
    ]


def test_generate_lengths_arrivals_and_token_range():
    reqs = generate([ALICE, BOB], duration_s=50.0, seed=2, vocab_size=1000)
    assert all(0.0 <= r.arrival_s < 50.0 for r in reqs)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    alice = [r for r in reqs if r.client == "alice"]
    assert abs(len(alice) - 250) < 5 * 250**0.5
    assert all(20 <= r.input_len <= 60 and 5 <= r.output_len <= 50 for r in alice)
    assert all(r.output_len == 16 and r.max_new_tokens == 16 for r in reqs if r.client == "bob")
    assert all(0 <= t < 1000 for r in reqs for t in r.input_ids)
    assert len({r.input_ids for r in reqs}) == len(reqs)  # no prefix groups: all distinct
    assert [r.rid for r in alice] == [f"alice-{i}" for i in range(len(alice))]
    assert all(r.service_class is ServiceClass.BE for r in reqs)


def test_prefix_groups_share_exactly_prefix_len_tokens():
    specs = [
        ClientSpec("a", Poisson(20.0), Uniform(100, 200), 8, prefix_group="sys", prefix_len=64),
        ClientSpec("b", Poisson(20.0), Uniform(100, 200), 8, prefix_group="sys", prefix_len=64),
        ClientSpec("c", Poisson(20.0), Uniform(100, 200), 8, prefix_group="other", prefix_len=64),
        ClientSpec("d", Poisson(20.0), Uniform(100, 200), 8),
    ]
    reqs = generate(specs, duration_s=5.0, seed=9)
    by_client = {c: [r for r in reqs if r.client == c] for c in "abcd"}
    assert all(len(v) > 50 for v in by_client.values())
    sys_head = tuple(group_tokens("sys", 65, seed=9).tolist())
    sys_reqs = by_client["a"] + by_client["b"]
    for r in sys_reqs:
        assert common_prefix_len(r.input_ids, sys_head) == 64
    for r, s in zip(sys_reqs, sys_reqs[1:], strict=False):
        assert common_prefix_len(r.input_ids, s.input_ids) == 64
    for r in by_client["c"]:
        assert common_prefix_len(r.input_ids, by_client["c"][0].input_ids) >= 64
        assert common_prefix_len(r.input_ids, sys_head) == 0
    for r in by_client["d"]:
        assert common_prefix_len(r.input_ids, sys_head) == 0
    assert len({r.input_ids for r in reqs}) == len(reqs)


def test_prefix_len_default_and_cap():
    specs = [
        ClientSpec("half", Poisson(20.0), Uniform(10, 99), 4, prefix_group="g"),
        ClientSpec("capped", Poisson(20.0), Uniform(10, 30), 4, prefix_group="g", prefix_len=50),
    ]
    reqs = generate(specs, duration_s=5.0, seed=0)
    head = tuple(group_tokens("g", 100, seed=0).tolist())
    for r in reqs:
        expected = r.input_len // 2 if r.client == "half" else r.input_len - 1
        assert common_prefix_len(r.input_ids, head) == expected
        assert record_of(r).prefix_len == expected


def test_group_stream_is_stable_and_prefix_consistent():
    long = group_tokens("system-prompt", 10_000, seed=5)
    assert group_tokens("system-prompt", 100, seed=5).tolist() == long[:100].tolist()
    assert group_tokens("system-prompt", 100, seed=6).tolist() != long[:100].tolist()
    assert group_tokens("other-prompt", 100, seed=5).tolist() != long[:100].tolist()
    # Pinned: the same in every process and Python version (hash() is salted per process).
    assert stable_hash("a") == 0x2F42665B399EF840


def test_same_client_in_two_specs_gets_unique_rids():
    specs = [
        ClientSpec("t", Poisson(10.0), 32, 4, prefix_group="app1"),
        ClientSpec("t", Poisson(10.0), 32, 4, prefix_group="app2"),
    ]
    reqs = generate(specs, duration_s=5.0)
    assert [r.rid for r in reqs] == [f"t-{i}" for i in range(len(reqs))]


def test_client_spec_validation_and_weights():
    assert client_weights([ALICE, BOB]) == {"alice": 1.0, "bob": 2.0}
    with pytest.raises(ValueError, match="weight"):
        ClientSpec("x", Poisson(1.0), 8, 8, weight=0.0)
    with pytest.raises(ValueError, match="prefix_len"):
        ClientSpec("x", Poisson(1.0), 8, 8, prefix_len=4)
    with pytest.raises(ValueError, match="service_class"):
        ClientSpec("x", Poisson(1.0), 8, 8, service_class="gold")
    with pytest.raises(ValueError, match="'n'"):
        ClientSpec("x", Poisson(1.0), 0, 8)
    with pytest.raises(ValueError, match="two different weights"):
        client_weights([ALICE, ClientSpec("alice", Poisson(1.0), 8, 8, weight=3.0)])
    with pytest.raises(ValueError, match="seed"):
        generate([ALICE], duration_s=1.0, seed=-1)
    rt = generate([ClientSpec("x", Poisson(5.0), 8, 8, service_class="rt")], duration_s=2.0)
    assert rt and all(r.service_class is ServiceClass.RT for r in rt)


# ---------------------------------------------------------------------------------------------
# JSONL traces


def test_trace_round_trip_reproduces_requests(tmp_path):
    specs = [
        ALICE,
        ClientSpec("bob", Poisson(4.0), Uniform(30, 80), 8, prefix_group="sys", prefix_len=16),
        ClientSpec("rt", Poisson(2.0), 12, 3, service_class="rt", prefix_group="sys"),
    ]
    reqs = generate(specs, duration_s=20.0, seed=11)
    path = tmp_path / "trace.jsonl"
    save_trace(reqs, path)
    back = load_trace(path, seed=11)
    assert summary(back) == summary(reqs)  # token ids included
    assert [record_of(r) for r in back] == [record_of(r) for r in reqs]
    assert [r.service_class for r in back] == [r.service_class for r in reqs]
    assert {record_of(r).prefix_group for r in back} == {None, "sys"}
    path2 = tmp_path / "again.jsonl"
    save_trace(back, path2)
    assert path2.read_text() == path.read_text()


def test_parse_trace_lines_fields_order_and_defaults():
    lines = [
        "# a comment",
        "",
        '{"arrival_s": 2.5, "client": "a", "input_len": 10, "output_len": 3}',
        '{"arrival_s": 1, "client": "b", "input_len": 8, "output_len": 2, "rid": "x",'
        ' "service_class": "rt", "max_new_tokens": 9, "interaction_id": "i1", "app": "judge",'
        ' "stage": 2, "ttft_slo_s": 1.5, "prefix_group": null}',
        '{"arrival_s": 1, "client": "a", "input_len": 6, "output_len": 1}',
        "   ",
        '{"arrival_s": 2.5, "client": "a", "input_len": 4, "output_len": 1}',
    ]
    reqs = parse_trace_lines(lines)
    assert [(r.rid, r.arrival_s, r.input_len) for r in reqs] == [
        ("x", 1.0, 8),
        ("a-0", 1.0, 6),  # ties keep file order
        ("a-1", 2.5, 10),
        ("a-2", 2.5, 4),
    ]
    x = reqs[0]
    assert x.service_class is ServiceClass.RT and x.max_new_tokens == 9
    assert (x.interaction_id, x.app, x.stage, x.ttft_slo_s) == ("i1", "judge", 2, 1.5)
    assert reqs[1].max_new_tokens == 1 and reqs[1].service_class is ServiceClass.BE
    assert isinstance(reqs[0].arrival_s, float)


def test_trace_prefix_matches_generated_group_prefix():
    lines = [
        '{"arrival_s": 0, "client": "a", "input_len": 40, "output_len": 1, "prefix_group": "g"}',
        '{"arrival_s": 1, "client": "b", "input_len": 30, "output_len": 1, "prefix_group": "g",'
        ' "prefix_len": 30}',
    ]
    a, b = parse_trace_lines(lines, seed=4)
    head = tuple(group_tokens("g", 40, seed=4).tolist())
    assert common_prefix_len(a.input_ids, head) == 20  # default: input_len // 2
    assert b.input_ids == head[:30]  # prefix_len == input_len is allowed in a trace
    gen = generate([ClientSpec("c", Constant(1.0), 40, 1, prefix_group="g")], duration_s=1, seed=4)
    assert gen[0].input_ids[:20] == head[:20]


def test_records_are_sorted_and_rids_filled():
    recs = parse_trace_records(['{"arrival_s": 0, "client": "a", "input_len": 1, "output_len": 1}'])
    assert recs == [TraceRecord(arrival_s=0, client="a", input_len=1, output_len=1, rid="a-0")]


BASE = {"arrival_s": 0.5, "client": "a", "input_len": 5, "output_len": 2}


def line(**changes) -> str:
    obj = {**BASE, **changes}
    return json.dumps({k: v for k, v in obj.items() if v is not ...})


MALFORMED = [
    ("missing", [line(output_len=...)], 3, "missing required field 'output_len'"),
    ("wrong type", [line(input_len="5")], 3, "field 'input_len' must be an integer >= 1"),
    ("float as int", [line(input_len=5.0)], 3, "field 'input_len' must be an integer"),
    ("negative", [line(input_len=-3)], 3, "field 'input_len' must be an integer >= 1 (got -3)"),
    ("bool as int", [line(output_len=True)], 3, "field 'output_len' must be an integer >= 1"),
    ("negative arrival", [line(arrival_s=-1)], 3, "field 'arrival_s' must be a number >= 0"),
    (
        "nan arrival",
        ['{"arrival_s": NaN, "client": "a", "input_len": 5, "output_len": 2}'],
        3,
        "field 'arrival_s'",
    ),
    ("null required", [line(client=None)], 3, "field 'client' must be a non-empty string"),
    ("empty client", [line(client="")], 3, "field 'client' must be a non-empty string"),
    ("unknown field", [line(inptu_len=5)], 3, "unknown field 'inptu_len'"),
    ("bad json", [line(), '{"arrival_s": 1, "client": '], 4, "invalid JSON"),
    ("not an object", ["[1, 2]"], 3, "expected a JSON object"),
    (
        "duplicate key",
        ['{"arrival_s": 0, "client": "a", "input_len": 5, "input_len": 6}'],
        3,
        "field 'input_len' appears twice",
    ),
    (
        "duplicate rid",
        [line(rid="r1"), line(rid="r2"), line(rid="r1")],
        5,
        "field 'rid' \"r1\" duplicates line 3",
    ),
    ("default rid taken", [line(client="b"), line(rid="b-0")], 3, "field 'rid' is missing"),
    ("prefix too long", [line(prefix_group="g", prefix_len=6)], 3, "field 'prefix_len'"),
    ("prefix without group", [line(prefix_len=2)], 3, "field 'prefix_len'"),
    (
        "max_new_tokens",
        [line(max_new_tokens=1)],
        3,
        "field 'max_new_tokens' must be an integer >= 2",
    ),
    ("service class", [line(service_class="gold")], 3, "field 'service_class'"),
    ("stage", [line(stage=-1)], 3, "field 'stage'"),
    ("slo", [line(ttft_slo_s=0)], 3, "field 'ttft_slo_s' must be a number > 0"),
]


@pytest.mark.parametrize(
    ("lines", "lineno", "expected"), [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED]
)
def test_malformed_trace_names_line_and_field(lines, lineno, expected):
    with pytest.raises(TraceError) as info:
        parse_trace_lines(["# header", "", *lines], source="trace.jsonl")
    message = str(info.value)
    assert message.startswith(f"trace.jsonl:{lineno}: "), message
    assert expected in message, message
    assert "\n" not in message
    assert isinstance(info.value, ValueError)


def test_negative_length_message_is_exact():
    with pytest.raises(TraceError) as info:
        parse_trace_lines([line(), line(input_len=-3)], source="trace.jsonl")
    assert str(info.value) == "trace.jsonl:2: field 'input_len' must be an integer >= 1 (got -3)"


@pytest.mark.parametrize("content", ["", "\n\n", "# only a comment\n   \n"])
def test_empty_trace_is_an_error(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(TraceError, match="no requests") as info:
        load_trace(path)
    assert str(info.value).startswith(os.fspath(path))


def test_load_trace_names_the_file(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(line() + "\n" + line(output_len=0) + "\n")
    with pytest.raises(TraceError, match=r"bad\.jsonl:2: field 'output_len'"):
        load_trace(path)
