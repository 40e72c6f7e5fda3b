"""A worker's service ledger: what router replicas read to share one fairness state (issue 34).

Each dispatch a worker receives is tagged ``(replica, seq, charge)``: the replica that sent
it, that replica's running count of its dispatches to this worker (1, 2, …), and the extend
tokens it charged the client for it (D2LPM's ``input_len − matched_len_on_u``, before
weights). The ledger sums, per client, the charges of the dispatches received and the output
tokens of every ``Finished`` *sent*, and keeps each replica's last ``seq``; ``report()`` is the
``ServiceReport`` the worker sends with its ``Load`` (``docs/replicas.md``)::

    ledger.received(replica, seq, client, charge, interaction=iid)  # a tagged dispatch
    ledger.sent(client, num_output, interaction=iid)  # its Finished (any reason) goes out
    load = Load(..., service=ledger.report())

The report also lists the interactions under way here (``ServiceReport.interactions``): those
with a call received and its ``Finished`` not yet sent, and those whose ``Finished`` went out
since the previous report (listed once more, so a call shorter than a report period is seen).

A ``Finished`` counts when it is sent, not when the request ends: a report then covers
exactly the ``Finished`` sent before it, which its replica has received before the report
(each worker → replica channel keeps its order), so no replica counts an output twice.
"""

from __future__ import annotations

from sgl_fair.messages import ServiceReport


class ServiceLedger:
    def __init__(self) -> None:
        self._clients: dict[str, list[int]] = {}  # client -> [extend charged, output served]
        self._seqs: dict[int, int] = {}  # replica -> last seq received
        self.num_requests = 0  # received, Finished not yet sent
        self._open: dict[str, int] = {}  # interaction id -> its calls here
        self._ended: set[str] = set()  # interactions whose call ended since the last report

    def received(
        self, replica: int, seq: int, client: str, charge: int, *, interaction: str | None = None
    ) -> None:
        last = self._seqs.get(replica, 0)
        if seq != last + 1:
            raise ValueError(
                f"replica {replica}'s dispatch seq {seq} after {last}: dispatches from one "
                "replica must arrive in order, none lost"
            )
        if charge < 0:
            raise ValueError(f"charge must be >= 0 (got {charge})")
        self._seqs[replica] = seq
        self._totals(client)[0] += charge
        self.num_requests += 1
        if interaction is not None:
            self._open[interaction] = self._open.get(interaction, 0) + 1

    def restart(self, replica: int, seq: int = 0) -> None:
        """``replica``'s dispatches count on from ``seq`` (it forgot this worker and starts
        its count again; the live remote worker's resync)."""
        self._seqs[replica] = seq

    def sent(self, client: str, num_output: int, *, interaction: str | None = None) -> None:
        """A ``Finished`` of ``client`` (ok or not) is being sent, with ``num_output`` tokens
        (``interaction``: the one its call belonged to, as given to ``received``)."""
        if self.num_requests <= 0:
            raise ValueError("a Finished sent for no request received")
        self._totals(client)[1] += num_output
        self.num_requests -= 1
        if interaction is not None:
            n = self._open.get(interaction, 0) - 1
            if n > 0:
                self._open[interaction] = n
            else:
                self._open.pop(interaction, None)
            self._ended.add(interaction)

    def report(self) -> ServiceReport:
        """The totals, and the interactions under way (the ended ones are listed this once)."""
        interactions = tuple(self._open.keys() | self._ended)
        self._ended = set()
        return ServiceReport(
            tuple((c, a, s) for c, (a, s) in self._clients.items()),
            tuple(self._seqs.items()),
            self.num_requests,
            interactions,
        )

    def _totals(self, client: str) -> list[int]:
        totals = self._clients.get(client)
        if totals is None:
            totals = self._clients[client] = [0, 0]
        return totals
