"""The plugin's start inside an SGLang scheduler process, in SGLang 0.5.23's real order:
``run_scheduler_process`` calls ``load_plugins()`` (our ``register``), then configures logging,
then ``Scheduler.__init__`` runs ``init_schedule_policy`` (our ``install_policy``, hooked) and
only later ``init_disaggregation``. Each case runs in a fresh process, as a scheduler does:
SGLang's real plugin loader, its real ``configure_logger`` and its real ``init_schedule_policy``
on a rig scheduler."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent

SCRIPT = """
import os, sys
sys.path.insert(0, {here!r})
import cpu_stubs
cpu_stubs.install()
from sglang.srt.plugins import load_plugins
from sglang.srt.runtime_context import get_context
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.common import configure_logger

load_plugins()  # as run_scheduler_process does first: our register()
args = ServerArgs(model_path="dummy", device="cpu", pp_max_micro_batch_size=1 << 20, **{args})
configure_logger(args, prefix=" TP0")  # SGLang's logging, after the plugins
import sglang_rig
sglang_rig._published = True
get_context().set_server_args(args)  # what publish() leaves for the scheduler's config bags
rig = sglang_rig.Rig()
s = rig.scheduler
s.schedule_policy = "fcfs"
s.enable_priority_scheduling = False
s.schedule_low_priority_values_first = False
assert not hasattr(s, "disaggregation_mode")  # set by init_disaggregation, later
s.init_schedule_policy()  # the real method, with our AFTER hook
print("POLICY", type(s.policy).__name__, flush=True)
s.max_total_num_tokens, s.max_req_input_len, s.startup_time = 1000, 100, 0.0
import json
print("INFO", json.dumps(s.get_init_info().get("sgl_fair")), flush=True)  # -> /server_info
"""


def run_scheduler_start(env: dict[str, str], **server_args) -> subprocess.CompletedProcess:
    code = textwrap.dedent(SCRIPT).format(here=str(HERE), args=repr(server_args))
    full = {**os.environ, **env}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=300
    )


ON = {"SGLFAIR_SCHEDULE_POLICY": "vtc", "SGLFAIR_SCHEDULE_POLICY_OPTS": '{"weights": {"a": 2}}'}


def test_the_plugins_on_line_is_in_sglangs_log():
    out = run_scheduler_start(ON)
    assert "POLICY FairSchedulePolicy" in out.stdout, out.stderr[-3000:]
    lines = [x for x in out.stderr.splitlines() if "sgl-fair plugin on" in x]
    assert len(lines) == 1, out.stderr[-3000:]
    assert "TP0" in lines[0] and "vtc" in lines[0] and '"weights": {"a": 2}' in lines[0]


def test_the_scheduler_reports_the_plugins_state_for_server_info():
    """``get_init_info`` is what SGLang spreads into ``/server_info``: the bridges read the
    plugin's policy there and refuse a server that does not run it."""
    import json

    out = run_scheduler_start(ON)
    [info] = [x for x in out.stdout.splitlines() if x.startswith("INFO ")]
    assert json.loads(info[5:]) == {"policy": "vtc", "opts": {"weights": {"a": 2}}}


def test_sglang_sets_the_disaggregation_mode_after_the_schedule_policy():
    """Why the guard cannot read ``scheduler.disaggregation_mode``: it is not set yet."""
    import inspect

    from sglang.srt.managers.scheduler import Scheduler

    init = inspect.getsource(Scheduler.__init__)
    assert init.index("self.init_schedule_policy()") < init.index("self.init_disaggregation()")


def test_a_prefill_disaggregated_server_refuses_the_plugin():
    """In prefill mode every arrival would be recorded as aborted (SGLang queues them
    elsewhere): the scheduler stops with one line naming the flag, at the plugin's install."""
    out = run_scheduler_start(ON, disaggregation_mode="prefill")
    assert out.returncode != 0 and "POLICY" not in out.stdout, out.stdout
    assert "--disaggregation-mode prefill is not supported" in out.stderr, out.stderr[-3000:]
    plain = run_scheduler_start(ON, disaggregation_mode="null")
    assert "POLICY FairSchedulePolicy" in plain.stdout, plain.stderr[-3000:]
