"""The engine side of detok: publish live requests' token ids as the worker expects them, and
hear which of them the worker ended early (stop signals).

`Publisher` (threads) and `AsyncPublisher` (asyncio) over `RequestEvents`, the broker-free core
that numbers, keys and coalesces events; `StopSignals` and `AsyncStopSignals` over the control
topic; docs/engines.md shows an engine loop.
"""

from schemas.events import StopSignal
from workers.io.publish.aio import AsyncPublisher, AsyncStopSignals, StepOutput
from workers.io.publish.events import PromptOptions, RequestEvents, RequestStateError
from workers.io.publish.publisher import (
    DEFAULT_LINGER_S,
    FailedRecord,
    Publisher,
    PublishFailed,
)
from workers.io.publish.stop_signals import DEFAULT_CONTROL_TOPIC, StopSignals

__all__ = [
    "DEFAULT_CONTROL_TOPIC",
    "DEFAULT_LINGER_S",
    "AsyncPublisher",
    "AsyncStopSignals",
    "FailedRecord",
    "PublishFailed",
    "Publisher",
    "RequestEvents",
    "PromptOptions",
    "RequestStateError",
    "StepOutput",
    "StopSignal",
    "StopSignals",
]
