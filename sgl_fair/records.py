"""What a run leaves behind: service events and per-request records.

Metrics (``sgl_fair.metrics``) are pure functions of these, so the simulator, the
live server and the SGLang backend all report through the same code.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from sgl_fair.request import ClientId, Phase, Request, ServiceClass

# A call that waited longer than this in a worker's queue before admission counts as *queued*
# (FairServe's "% of users who saw queueing delay"): the experiments, the load test and the
# live router's /metrics all use it.
QUEUED_S = 1.0


class EventKind(str, enum.Enum):
    PREFILL = "prefill"  # request admitted: input service is counted at admission (VTC fn. 5)
    DECODE = "decode"  # output tokens [start, end) were generated


@dataclass(slots=True)
class ServiceEvent:
    """One piece of service delivered to a client at time ``t_s``.

    PREFILL: counted when the request is admitted; ``extend_len`` is the uncached part.
    DECODE: output tokens ``[start, end)`` of the request were produced.
    A cost function (``sgl_fair.cost``) turns an event into service units.

    Not frozen, though nothing changes an event once made: the scheduler makes one per
    generated token, and a frozen dataclass's ``__init__`` costs 6x as much (1.3 vs 0.2 µs,
    a tenth of a simulated cluster run's time).
    """

    t_s: float
    client: ClientId
    rid: str
    kind: EventKind
    input_len: int
    extend_len: int = 0
    start: int = 0
    end: int = 0


@dataclass(frozen=True, slots=True)
class RequestRecord:
    rid: str
    client: ClientId
    arrival_s: float
    input_len: int
    output_len: int
    num_output: int
    prefix_len: int
    admit_s: float | None
    first_token_s: float | None
    finish_s: float | None
    rejected: bool
    reject_reason: str | None
    num_retractions: int
    service_class: str
    interaction_id: str | None
    app: str | None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    @classmethod
    def build(
        cls,
        *,
        rid: str,
        client: ClientId,
        arrival_s: float,
        input_len: int,
        output_len: int,
        output_ids: Sequence[int] = (),
        prefix_len: int | None = None,
        admit_s: float | None = None,
        first_token_s: float | None = None,
        finish_s: float | None = None,
        rejected: bool = False,
        reject_reason: str | None = None,
        num_retractions: int = 0,
        service_class: str = ServiceClass.BE.value,
        interaction_id: str | None = None,
        app: str | None = None,
    ) -> RequestRecord:
        """The one way a record is made, by the scheduler (``from_request``) and by the live
        load-test client alike. The defaults are what an observer outside the server cannot
        see (no retractions, best-effort); a prefix that was never measured counts as 0."""
        return cls(
            rid=rid,
            client=client,
            arrival_s=arrival_s,
            input_len=input_len,
            output_len=output_len,
            num_output=len(output_ids),
            prefix_len=prefix_len or 0,
            admit_s=admit_s,
            first_token_s=first_token_s,
            finish_s=finish_s,
            rejected=rejected,
            reject_reason=reject_reason,
            num_retractions=num_retractions,
            service_class=service_class,
            interaction_id=interaction_id,
            app=app,
        )

    @classmethod
    def from_request(cls, req: Request) -> RequestRecord:
        return cls.build(
            rid=req.rid,
            client=req.client,
            arrival_s=req.arrival_s,
            input_len=req.input_len,
            output_len=req.output_len,
            output_ids=req.output_ids,
            prefix_len=req.first_prefix_len,
            admit_s=req.admit_s,
            first_token_s=req.first_token_s,
            finish_s=req.finish_s,
            rejected=req.phase is Phase.REJECTED,
            reject_reason=req.reject_reason,
            num_retractions=req.num_retractions,
            service_class=req.service_class.value,
            interaction_id=req.interaction_id,
            app=req.app,
        )

    def to_dict(self) -> dict:
        return asdict(self)
