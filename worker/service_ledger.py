"""A worker's service ledger: what router replicas read to share one fairness state.

Each dispatch a worker receives from a replica that shares fairness is tagged
``(replica, charge)``: who sent it and the extend tokens it charged the client for it
(D2LPM's ``input_len − matched_len_on_u``, before weights). The ledger keeps one **row** per
(replica, client): the charges of that replica's dispatches of that client received here,
and the output tokens of their ``Finished`` *sent*. A row grows only by its own replica's
dispatches — a G-counter row — so a replica counts its own service itself and adds up the
others' rows: there is no order between replicas to keep, no sequence to check, and nothing
a lost, refused or duplicated message can make a replica count twice (``docs/replicas.md``)::

    ledger.received(rid, replica, client, charge, interaction=iid)  # a tagged dispatch
    ledger.refused(replica, client, charge)  # a tagged dispatch refused here (charged, ended)
    ledger.sent(rid, num_output)  # its Finished (any reason) goes out
    load = Load(..., service=ledger.report())

Bounded: ``report()`` lists only the rows changed since the previous report, and every
``full_every``-th report (and the first, and the next after ``want_full()``: a replica
attached) every row — a snapshot. A row with no request here that has not changed for
``idle_reports`` reports is forgotten before a snapshot; should its client come back, the row
starts again from zero with a new *birth*, which tells a replica that held the old row that
the whole new one is new service.

The report also lists the interactions under way here (``ServiceReport.interactions``): those
with a call received and its ``Finished`` not yet sent, and those whose ``Finished`` went out
since the previous report (listed once more, so a call shorter than a report period is seen).

A ``Finished`` counts when it is sent, not when the request ends: the replica that receives
it counts its output then, and the other replicas through the next report.
"""

from __future__ import annotations

import random
from collections.abc import Hashable
from dataclasses import dataclass

from sgl_fair.messages import ServiceReport


@dataclass
class _Row:
    born: int
    extend: int = 0
    output: int = 0
    requests: int = 0  # received here, Finished not yet sent
    changed_at: int = 0  # the report count when it last changed


def new_boot_id() -> int:
    """A random nonzero 63-bit id for one worker process (``Hello.boot``)."""
    return random.SystemRandom().getrandbits(63) | 1


class ServiceLedger:
    def __init__(
        self, *, boot: int | None = None, full_every: int = 10, idle_reports: int = 100
    ) -> None:
        if full_every < 1 or idle_reports < 1:
            raise ValueError(f"full_every and idle_reports must be >= 1 "
                             f"(got {full_every}, {idle_reports})")  # fmt: skip
        self.boot = new_boot_id() if boot is None else boot
        self.full_every = full_every
        self.idle_reports = idle_reports
        self._rows: dict[tuple[int, str], _Row] = {}
        self._changed: set[tuple[int, str]] = set()
        # rid (the plugin's: id of SGLang's Req) -> its row, its interaction
        self._rids: dict[Hashable, tuple[tuple[int, str], str | None]] = {}
        self._births = 0
        self._requests: dict[int, int] = {}  # replica -> its requests here
        self._reports = 0
        self._full_due = True  # the first report is a snapshot
        self._open: dict[str, int] = {}  # interaction id -> its calls here
        self._ended: set[str] = set()  # interactions whose call ended since the last report

    @property
    def num_requests(self) -> int:
        """Tagged requests here: received, their Finished not yet sent."""
        return len(self._rids)

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    def _row(self, replica: int, client: str) -> tuple[tuple[int, str], _Row]:
        key = (replica, client)
        row = self._rows.get(key)
        if row is None:
            self._births += 1
            row = self._rows[key] = _Row(self._births)
        row.changed_at = self._reports
        self._changed.add(key)
        return key, row

    def received(
        self,
        rid: Hashable,
        replica: int,
        client: str,
        charge: int,
        *,
        interaction: str | None = None,
    ) -> None:
        """A dispatch of ``rid`` tagged by ``replica`` with ``charge`` extend tokens. A rid
        already here is the caller's to refuse first (``refused``): ValueError."""
        if charge < 0:
            raise ValueError(f"charge must be >= 0 (got {charge})")
        if rid in self._rids:
            raise ValueError(f"request {rid!r} is here already (refuse it: refused())")
        key, row = self._row(replica, client)
        row.extend += charge
        row.requests += 1
        self._requests[replica] = self._requests.get(replica, 0) + 1
        self._rids[rid] = (key, interaction)
        if interaction is not None:
            self._open[interaction] = self._open.get(interaction, 0) + 1

    def refused(self, replica: int, client: str, charge: int) -> None:
        """A tagged dispatch this worker refused at once (a duplicate rid): its replica
        charged it, so its row counts the charge; no request stays here."""
        if charge < 0:
            raise ValueError(f"charge must be >= 0 (got {charge})")
        self._row(replica, client)[1].extend += charge

    def sent(self, rid: Hashable, num_output: int) -> None:
        """The ``Finished`` of ``rid`` (ok or not) is being sent with ``num_output`` tokens;
        nothing for a request no tag came with."""
        entry = self._rids.pop(rid, None)
        if entry is None:
            return
        key, interaction = entry
        row = self._rows[key]
        row.output += num_output
        row.requests -= 1
        n = self._requests[key[0]] - 1
        if n:
            self._requests[key[0]] = n
        else:
            del self._requests[key[0]]
        row.changed_at = self._reports
        self._changed.add(key)
        if interaction is not None:
            n = self._open.get(interaction, 0) - 1
            if n > 0:
                self._open[interaction] = n
            else:
                self._open.pop(interaction, None)
            self._ended.add(interaction)

    def want_full(self) -> None:
        """The next report is a snapshot (a replica attached: its view starts from one)."""
        self._full_due = True

    def report(self) -> ServiceReport:
        """The changed rows (or every row), the requests here per replica, the interactions
        under way (the ended ones are listed this once)."""
        self._reports += 1
        full = self._full_due or self._reports % self.full_every == 0
        if full:
            self._forget_idle()
            keys = list(self._rows)
        else:
            keys = [k for k in self._changed if k in self._rows]
        self._full_due = False
        self._changed = set()
        rows = self._rows
        out = tuple((k[0], k[1], rows[k].extend, rows[k].output, rows[k].born) for k in keys)
        interactions = tuple(self._open.keys() | self._ended)
        self._ended = set()
        return ServiceReport(
            self.boot, out, full, tuple(sorted(self._requests.items())), self.num_requests,
            interactions,
        )  # fmt: skip

    def _forget_idle(self) -> None:
        horizon = self._reports - self.idle_reports
        idle = [k for k, r in self._rows.items() if not r.requests and r.changed_at < horizon]
        for k in idle:
            del self._rows[k]
