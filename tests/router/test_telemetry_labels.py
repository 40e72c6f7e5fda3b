"""/metrics label cardinality is bounded (issue 31 item 6): without API keys a tenant is a
client id from a header, so a caller could mint label values without end."""

from __future__ import annotations

from live_helpers import metric

from sgl_fair.router.telemetry import MAX_TENANT_LABELS, Telemetry


def test_tenant_labels_past_the_cap_fold_into_other() -> None:
    t = Telemetry()
    n = MAX_TENANT_LABELS + 500
    for i in range(n):
        tenant = f"c{i}"
        t.finished(tenant, outcome="ok", input_len=3, cached=0, output_len=2, ttft_s=0.1,
                   e2e_s=0.2)  # fmt: skip
        t.submitted(tenant, "be")
        t.rejected(tenant, "rpm")
        t.throttled(tenant, "chat", "user")
        t.interactions.answered(tenant, "chat", tenant, f"i{i}", tokens=5, output_len=2,
                                ttft_s=0.1, queue_s=0.0)  # fmt: skip
        t.interactions.throttled(tenant, "chat", tenant, f"i{i}")
    text = t.render().decode()
    tenants = {
        line.split('tenant="', 1)[1].split('"', 1)[0]
        for line in text.splitlines()
        if 'tenant="' in line
    }
    assert len(tenants) == MAX_TENANT_LABELS + 1
    assert "other" in tenants and "c0" in tenants and f"c{n - 1}" not in tenants
    # nothing is lost: the folded ones are counted under "other"
    assert metric(text, "sgl_fair_tenant_output_tokens_total", tenant="other") == 2 * 500
    assert metric(text, "sgl_fair_users_total", tenant="other", app="chat") == 500
    assert metric(text, "sgl_fair_tokens_wasted_total", tenant="other", app="chat") == 5 * 500


def test_a_tenants_files_tenants_always_get_their_own_label() -> None:
    t = Telemetry(max_tenant_labels=2, tenants=["acme", "globex"])
    for tenant in ("x", "y", "z", "acme", "globex"):
        t.submitted(tenant, "be")
    text = t.render().decode()
    for tenant in ("x", "y", "other", "acme", "globex"):
        assert (
            metric(text, "sgl_fair_requests_by_class_total", tenant=tenant, priority_class="be")
            == 1
        )
