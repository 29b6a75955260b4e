"""The engine side of detok: publish live requests' token ids as the worker expects them.

`Publisher` (threads) and `AsyncPublisher` (asyncio) over `RequestEvents`, the broker-free core
that numbers, keys and coalesces events; docs/engines.md shows an engine loop.
"""

from workers.io.publish.aio import AsyncPublisher, StepOutput
from workers.io.publish.events import PromptOptions, RequestEvents, RequestStateError
from workers.io.publish.publisher import (
    DEFAULT_LINGER_S,
    FailedRecord,
    Publisher,
    PublishFailed,
)

__all__ = [
    "DEFAULT_LINGER_S",
    "AsyncPublisher",
    "FailedRecord",
    "PublishFailed",
    "Publisher",
    "RequestEvents",
    "PromptOptions",
    "RequestStateError",
    "StepOutput",
]
