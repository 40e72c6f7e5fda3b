"""The launcher's backends (``apps/launch/backends.py``): what each declares, that a new one
slots in through the registry alone, and that nothing branches on a backend's name."""

from __future__ import annotations

import pathlib
import re

import pytest

from sgl_fair.launch import parse_config
from sgl_fair.launch.backends import BACKENDS, Backend, backend_of
from sgl_fair.router import protocol as P

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_each_backend_declares_what_the_launcher_asks() -> None:
    sim, torch, sglang = backend_of("sim"), backend_of("torch"), backend_of("sglang")
    assert sim.simulated and not torch.simulated and not sglang.simulated
    # only SGLang's servers take the fields a real engine honours; the others refuse them
    assert sglang.features.passthrough
    assert not sim.features.passthrough and not torch.features.passthrough
    assert sim.kv_allocator and torch.kv_allocator and not sglang.kv_allocator
    assert sglang.defaults == {"chunked_prefill_size": None, "max_running_requests": None}
    assert parse_config([]).backend == "sim"
    assert parse_config(["--worker-url", "http://127.0.0.1:1"]).backend == "sglang"


def test_a_new_backend_is_one_registry_entry(monkeypatch) -> None:
    """What issue 34's remote workers will be: a backend the parser offers and the config
    takes its defaults from, with no change to the launcher."""

    class Remote(Backend):
        name = "remote-test"
        defaults = {"chunked_prefill_size": 1024, "max_running_requests": 8}
        startup_timeout_s = 7.0

    monkeypatch.setitem(BACKENDS, Remote.name, Remote())
    cfg = parse_config(["--backend", "remote-test"])
    assert cfg.backend == "remote-test"
    assert (cfg.chunked_prefill_size, cfg.max_running_requests) == (1024, 8)
    assert cfg.startup_timeout_s == 7.0


def test_the_parsers_take_what_the_backend_declares() -> None:
    body = b'{"text": "hi", "sampling_params": {"regex": "a+"}}'
    item = P.parse_generate(body, P.Limits(), backend_of("sglang").features).items[0]
    assert item.sampling.engine_extra == {"regex": "a+"}
    with pytest.raises(P.ProtocolError) as e:
        P.parse_generate(body, P.Limits(), backend_of("sim").features)
    assert e.value.param == "sampling_params.regex"


# a comparison with a backend's or engine's name: `backend == "sglang"`, `engine != "sim"`,
# `backend.name == "remote"`, `cfg.backend in ("sim", ...)`, `"torch" == engine`, ...
_NAMES = "|".join(sorted(BACKENDS))
NAME_BRANCH = re.compile(
    rf"""(backend|engine)(\.name)?\s*(==|!=|\bin\b|\bnot in\b)\s*[(\[{{]?\s*["']({_NAMES})["']"""
    rf"""|["']({_NAMES})["']\s*(==|!=)\s*\w*\.?(backend|engine)"""
)


def test_the_name_branch_check_catches_each_form() -> None:
    for line in ('shared = backend.name == "remote" and x', 'if cfg.backend in ("sim", "torch"):',
                 'engine != "sglang"', 'if "torch" == cfg.engine:'):  # fmt: skip
        assert NAME_BRANCH.search(line), line
    assert not NAME_BRANCH.search('bad(f"--backend {backend.name} starts no workers")')


@pytest.mark.parametrize("folder", ["apps/launch", "router/protocol"])
def test_nothing_branches_on_a_backend_name(folder: str) -> None:
    hits = [
        f"{path.relative_to(ROOT)}:{i}"
        for path in sorted((ROOT / folder).glob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if NAME_BRANCH.search(line)
    ]
    assert hits == [], "declare a capability on the Backend / EngineFeatures instead"
