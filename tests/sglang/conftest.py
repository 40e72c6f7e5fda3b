"""The SGLang plugin's CPU tests: real sglang 0.5.23 modules, no GPU.

They need the environment ``make sglang-cpu`` builds (``make test`` builds it first and sets
``SGLFAIR_REQUIRE_SGLANG=1``, so in CI a missing sglang fails instead of skipping).
"""

from __future__ import annotations

import importlib.util
import os

import cpu_stubs  # tests/sglang/ is on sys.path (pytest rootdir-relative imports)
import pytest

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None

if HAVE_SGLANG:
    cpu_stubs.install()
elif os.environ.get("SGLFAIR_REQUIRE_SGLANG") == "1":
    raise pytest.UsageError(
        "SGLFAIR_REQUIRE_SGLANG=1 but sglang is not installed: run `make sglang-cpu`"
    )


def pytest_collection_modifyitems(config, items):
    if HAVE_SGLANG:
        return
    skip = pytest.mark.skip(reason="sglang is not installed (make sglang-cpu builds it)")
    for item in items:
        if "tests/sglang/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under ``make test`` (``SGLFAIR_REQUIRE_SGLANG=1``) a test that starts a real SGLang
    server is never skipped: a skip (a missing package, an importorskip) is a failure."""
    outcome = yield
    report = outcome.get_result()
    if (
        report.skipped
        and item.get_closest_marker("sglang_server") is not None
        and os.environ.get("SGLFAIR_REQUIRE_SGLANG") == "1"
    ):
        report.outcome = "failed"
        report.longrepr = (
            f"sglang_server test skipped under SGLFAIR_REQUIRE_SGLANG=1: {report.longrepr}"
        )


@pytest.fixture(scope="module")
def plugin_hooks():
    """The plugin's hooks, applied once per process (as SGLang's load_plugins() does), for
    modules that drive SGLang's real scheduler through them (``pytestmark``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sgl_fair.worker.sglang import plugin
    from sgl_fair.worker.sglang.settings import PluginSettings

    target = plugin.TARGETS["add_one_req"]
    if not any(h is plugin._after_add_one_req for _, h, _ in HookRegistry._hooks.get(target, [])):
        mp = pytest.MonkeyPatch()
        for k, v in PluginSettings("dlpm", {}).env().items():
            mp.setenv(k, v)
        plugin._settings = None
        plugin.register()
        HookRegistry.apply_hooks()
        mp.undo()
    yield


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny random Llama checkpoint with an offline tokenizer, written once per session
    (``live_rig.write_tiny_llama``), for the tests that start real SGLang servers."""
    import live_rig

    return live_rig.write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
