"""`AsyncPublisher`: the publisher for asyncio engines (vLLM's `AsyncLLM`, SGLang's runtime).

Opening, appending and finishing only queue records (librdkafka sends them from its own threads),
so they are plain calls that never wait on the network and are safe on the event loop; only
`flush` and `close`, which wait for delivery reports, run in a worker thread. `publish` consumes
an async stream of per-step outputs, the shape an engine's output loop already has.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Sequence
from typing import Any, NamedTuple, Unpack

from schemas.events import StopSignal
from workers.io.publish.events import PromptOptions
from workers.io.publish.publisher import Publisher
from workers.io.publish.stop_signals import StopSignals
from workers.kafka.clients import DeliveryReport


class StepOutput(NamedTuple):
    """New ids of one request from one engine step; `finished` closes it after them.

    A plain `(request_id, new_ids, finished)` tuple works too (`StepOutput(*item)`)."""

    request_id: str
    token_ids: Sequence[int]
    finished: bool = False
    finish_reason: str | None = None
    logprobs: Sequence[float] | None = None
    top_logprobs: Sequence[Sequence[tuple[int, float]]] | None = None


class AsyncPublisher:
    """A `Publisher` with awaitable methods; make it with `await AsyncPublisher.create(...)`
    (the cluster checks of `Publisher()` take a round trip, done off the loop)."""

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher

    @classmethod
    async def create(cls, *args: Any, **kwargs: Any) -> AsyncPublisher:
        """`Publisher(*args, **kwargs)`, made off the event loop."""
        return cls(await asyncio.to_thread(Publisher, *args, **kwargs))

    async def __aenter__(self) -> AsyncPublisher:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def open(
        self,
        request_id: str,
        model: str,
        prompt_token_ids: Sequence[int],
        **options: Unpack[PromptOptions],
    ) -> None:
        """`Publisher.open`."""
        self.publisher.open(
            request_id,
            model,
            prompt_token_ids,
            **options,
        )

    async def append(
        self,
        request_id: str,
        token_ids: Sequence[int],
        logprobs: Sequence[float] | None = None,
        top_logprobs: Sequence[Sequence[tuple[int, float]]] | None = None,
    ) -> None:
        """`Publisher.append`."""
        self.publisher.append(request_id, token_ids, logprobs, top_logprobs)

    async def finish(self, request_id: str, finish_reason: str | None = None) -> None:
        self.publisher.finish(request_id, finish_reason)

    async def abandon(self, request_id: str) -> bool:
        """`Publisher.abandon`."""
        return self.publisher.abandon(request_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.publisher

    async def publish(self, outputs: AsyncIterable[StepOutput | tuple]) -> int:
        """Append every output of the stream to its (already opened) request and finish the
        request at its `finished` output; the number of requests finished."""
        finished = 0
        async for item in outputs:
            output = item if isinstance(item, StepOutput) else StepOutput(*item)
            self.publisher.append(
                output.request_id, output.token_ids, output.logprobs, output.top_logprobs
            )
            if output.finished:
                self.publisher.finish(output.request_id, output.finish_reason)
                finished += 1
        return finished

    async def flush(self, timeout_s: float | None = None) -> DeliveryReport:
        return await asyncio.to_thread(self.publisher.flush, timeout_s)

    async def close(self, timeout_s: float | None = None) -> DeliveryReport:
        return await asyncio.to_thread(self.publisher.close, timeout_s)


class AsyncStopSignals:
    """`StopSignals` for asyncio engines: `async for signal in signals`, or `await get()`.

    Its consumer polls on a background thread (`StopSignals(on_stop=...)`), which hands each
    signal to the event loop's queue: the loop never waits on the network. Make it with
    `await AsyncStopSignals.create(...)` (the same arguments as `StopSignals`, without
    `on_stop`) on the loop that will read it.
    """

    def __init__(self, queue: asyncio.Queue[StopSignal]) -> None:
        self.queue = queue
        self.signals: StopSignals | None = None

    @classmethod
    async def create(cls, *args: Any, **kwargs: Any) -> AsyncStopSignals:
        loop = asyncio.get_running_loop()
        made = cls(asyncio.Queue())

        def on_stop(signal: StopSignal) -> None:
            loop.call_soon_threadsafe(made.queue.put_nowait, signal)

        made.signals = await asyncio.to_thread(StopSignals, *args, on_stop=on_stop, **kwargs)
        return made

    async def get(self) -> StopSignal:
        """The next signal, waiting for it."""
        return await self.queue.get()

    def __aiter__(self) -> AsyncStopSignals:
        return self

    async def __anext__(self) -> StopSignal:
        return await self.queue.get()

    async def __aenter__(self) -> AsyncStopSignals:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self.signals is not None:
            await asyncio.to_thread(self.signals.close)
