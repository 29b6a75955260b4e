"""The events of live requests, as the worker expects them: the publisher's broker-free core.

`RequestEvents` turns an engine's calls (open a request, append generated ids, finish it) into
Kafka records (key, value): a prompt event (seq 0), tokens events (seq 1, 2, ...), a finish event,
each keyed by the request id (the producer's murmur2 partitioner then puts a request's events on
one partition, as the worker requires). It holds no Kafka client: records go to a `sink`, which is
the publisher's producer for an engine, a list for `detok replay`'s tests. Not thread safe: the
publisher serialises calls with its lock.

With `coalesce`, appended ids wait in a per-request buffer until `flush` (the publisher's linger
timer, or the request's finish), so ids an engine produces one at a time go out as a few large
tokens events instead of one record each. A coalesced event over the record limit is split in
halves until it fits: coalescing must never make a record the broker refuses out of appends that
each fitted. Without `coalesce`, every append is one event, the caller's cut (replay's
`--chunk-size`), and one over the limit is sent as it is, for the broker to refuse and the
publisher to report.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

import msgspec

from pipeline.decode_state import PROMPT_CONTEXT_IDS
from schemas.fast_events import ParsedFinish, ParsedPrompt, ParsedTokens, encode_event
from workers.kafka.topics import RECORD_OVERHEAD_BYTES

LOG = logging.getLogger("detok.publish")

# Where records go: (key, value, seq). The seq lets a delivery failure name its event.
Sink = Callable[[bytes, bytes, int], None]


class PromptOptions(TypedDict, total=False):
    """The prompt event's optional fields (docs/decode-options.md), named once: `Publisher.open`
    and `AsyncPublisher.open` pass them on to `RequestEvents.open`, which checks them."""

    skip_special_tokens: bool
    stop: Sequence[str] | None
    include_stop_str_in_output: bool
    prompt_tokens: int | None
    # OpenAI's `tools` list of the request (`{"type": "function", "function": {"name", ...}}`):
    # its tool calls are parsed when the model has a tool parser (docs/chat-outputs.md).
    tools: Sequence[Mapping[str, Any]] | None


class RequestStateError(ValueError):
    """A call that does not fit the request's life: opened twice, or used before `open` or after
    `finish`. Raised before anything is sent, so the worker never sees the broken stream."""


@dataclass(slots=True)
class _Live:
    """One open request: its key, the seq its next event gets, and its buffered ids.

    `layout` is which logprob lists the buffered ids carry ((logprobs?, top_logprobs?)): one event
    carries them for all of its ids or for none, so a change of layout flushes the buffer first.
    """

    key: bytes
    next_seq: int = 1
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    layout: tuple[bool, bool] = (False, False)


class RequestEvents:
    """Open requests and their next events (see the module docstring)."""

    def __init__(
        self,
        sink: Sink,
        *,
        coalesce: bool = True,
        max_record_bytes: int | None = None,
        prompt_tail: int | None = None,
        log: logging.Logger = LOG,
    ) -> None:
        self._sink = sink
        self._coalesce = coalesce
        self._max_record_bytes = max_record_bytes
        self._prompt_tail = prompt_tail
        self._log = log
        self._live: dict[str, _Live] = {}
        # Requests with buffered ids, in the order their buffers started.
        self._pending: list[_Live] = []

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def open(
        self,
        request_id: str,
        model: str,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
        prompt_tokens: int | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        """Send the prompt event (seq 0). Every field is checked against the schema's bounds
        here (msgspec.ValidationError), so a bad prompt fails the call, not the worker."""
        if request_id in self._live:
            raise RequestStateError(f"request {request_id!r} is already open")
        event = msgspec.convert(
            {
                "request_id": request_id,
                "model": model,
                "prompt_token_ids": list(prompt_token_ids),
                "skip_special_tokens": skip_special_tokens,
                "stop": None if stop is None else list(stop),
                "include_stop_str_in_output": include_stop_str_in_output,
                "prompt_tokens": prompt_tokens,
                "tools": None if tools is None else list(tools),
            },
            ParsedPrompt,
        )
        key = request_id.encode()
        self._live[request_id] = _Live(key)
        self._sink(key, self.prompt_record(event, key), 0)

    def append(
        self,
        request_id: str,
        token_ids: Sequence[int],
        logprobs: Sequence[float] | None = None,
        top_logprobs: Sequence[Sequence[tuple[int, float]]] | None = None,
    ) -> None:
        """Generated ids, in order, with one logprob (and one list of alternatives) per id when
        given. Buffered under `coalesce`, else sent as one tokens event."""
        if not token_ids:
            return
        live = self._live.get(request_id)
        if live is None:
            raise RequestStateError(f"request {request_id!r} is not open")
        for name, values in (("logprobs", logprobs), ("top_logprobs", top_logprobs)):
            if values is not None and len(values) != len(token_ids):
                raise ValueError(f"{name} has {len(values)} entries for {len(token_ids)} ids")
        layout = (logprobs is not None, top_logprobs is not None)
        if live.ids and layout != live.layout:
            self._send_tokens(live)
        if not live.ids:
            live.layout = layout
            self._pending.append(live)
        live.ids.extend(token_ids)
        if logprobs is not None:
            live.logprobs.extend(logprobs)
        if top_logprobs is not None:
            live.top_logprobs.extend(list(pairs) for pairs in top_logprobs)
        if not self._coalesce:
            self.flush()

    def append_many(self, steps: Sequence[tuple[str, Sequence[int]]]) -> None:
        """`append(request_id, ids)` for each pair: one engine step's new ids of every running
        request, without logprobs, in one call (the publisher then takes its lock once)."""
        live_requests = self._live
        pending = self._pending
        for request_id, token_ids in steps:
            live = live_requests.get(request_id)
            if live is None or live.layout != (False, False) or not self._coalesce:
                self.append(request_id, token_ids)
                continue
            if not live.ids:
                pending.append(live)
            live.ids.extend(token_ids)

    def finish(self, request_id: str, finish_reason: str | None = None) -> None:
        """Send the request's buffered ids, then its finish event; the request is closed."""
        live = self._live.pop(request_id, None)
        if live is None:
            raise RequestStateError(f"request {request_id!r} is not open")
        if live.ids:
            self._send_tokens(live)
        event = ParsedFinish(request_id=request_id, seq=live.next_seq, finish_reason=finish_reason)
        self._sink(live.key, encode_event(event), live.next_seq)

    def abandon(self, request_id: str) -> bool:
        """Close a request without sending anything more (its buffered ids are dropped): the
        worker already ended it (a stop signal), so later events would only be set aside.
        False when the request is not open."""
        live = self._live.pop(request_id, None)
        if live is None:
            return False
        live.ids, live.logprobs, live.top_logprobs = [], [], []  # `flush` skips it
        return True

    def flush(self) -> int:
        """Send every buffered id as tokens events; the number of ids sent."""
        pending, self._pending = self._pending, []
        sent = 0
        for live in pending:
            if live.ids:  # a finished request's buffer went out with its finish
                sent += len(live.ids)
                self._send_tokens(live)
        return sent

    def _send_tokens(self, live: _Live) -> None:
        ids, logprobs, tops = live.ids, live.logprobs, live.top_logprobs
        has_logprobs, has_tops = live.layout
        live.ids, live.logprobs, live.top_logprobs = [], [], []
        request_id = live.key.decode()
        self._send_chunk(
            live,
            request_id,
            ids,
            logprobs if has_logprobs else None,
            tops if has_tops else None,
        )

    def _send_chunk(
        self,
        live: _Live,
        request_id: str,
        ids: list[int],
        logprobs: list[float] | None,
        tops: list[list[tuple[int, float]]] | None,
    ) -> None:
        event = ParsedTokens(
            request_id=request_id,
            seq=live.next_seq,
            token_ids=ids,
            logprobs=logprobs,
            top_logprobs=tops,
        )
        value = encode_event(event)
        if self._coalesce and len(ids) > 1 and self._over_limit(live.key, value):
            half = len(ids) // 2
            for part in (slice(None, half), slice(half, None)):
                self._send_chunk(
                    live,
                    request_id,
                    ids[part],
                    None if logprobs is None else logprobs[part],
                    None if tops is None else tops[part],
                )
            return
        live.next_seq += 1
        self._sink(live.key, value, event.seq)

    def _over_limit(self, key: bytes, value: bytes) -> bool:
        limit = self._max_record_bytes
        return limit is not None and len(key) + len(value) + RECORD_OVERHEAD_BYTES > limit

    def prompt_record(self, event: ParsedPrompt, key: bytes) -> bytes:
        """A prompt event's value: the whole prompt, or its tail with the full count.

        A tail of `PROMPT_CONTEXT_IDS` ids decodes exactly as the whole prompt
        (docs/production-shapes.md, 'Prompt tails'), so a prompt too large for the topic (a
        150k-id prompt passes Kafka's default 1 MB) is sent as that tail rather than refused;
        `prompt_tail` asks for tails of every prompt longer than it.
        """
        ids = event.prompt_token_ids
        count = len(ids) if event.prompt_tokens is None else event.prompt_tokens
        tail = self._prompt_tail
        if tail is not None and len(ids) > tail:
            return encode_event(_with_tail(event, tail, count))
        value = encode_event(event)
        if self._over_limit(key, value) and len(ids) > PROMPT_CONTEXT_IDS:
            self._log.info(
                "request %s: prompt of %d ids is %d bytes, over the record limit %d: sending its "
                "last %d ids with prompt_tokens=%d",
                event.request_id,
                count,
                len(value),
                self._max_record_bytes,
                PROMPT_CONTEXT_IDS,
                count,
            )
            return encode_event(_with_tail(event, PROMPT_CONTEXT_IDS, count))
        return value


def _with_tail(event: ParsedPrompt, tail: int, count: int) -> ParsedPrompt:
    return msgspec.structs.replace(
        event, prompt_token_ids=event.prompt_token_ids[-tail:], prompt_tokens=count
    )
