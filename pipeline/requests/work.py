"""One active request's share of a batch: what sequencing hands the decode."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.request_state import ActiveRequest, HeldEvent


@dataclass
class Work:
    """The in-order events of one active request to decode now."""

    request_id: str
    state: ActiveRequest
    events: list[HeldEvent] = field(default_factory=list)
    finished: bool = False  # the last of `events` is the request's finish
