"""Decoding: one batched round per input batch, and one way from a chunk's text to outcomes.

Every request with in-order events this batch is decoded here, on one path. A request's text
stages (`pipeline.stages`: chosen once per request by `Stages.of`) say what they need of the
decode: a request whose stages need no per-token text goes whole into the batched round (with a
copy of its stream from before the chunk if a stage asked for one); one whose stages need each
id's text (`per_token`) is pushed id by id. Then `_advance` takes the chunk's text through the
stages in order (`pipeline.stages.base.TextStage`): whether one ends the request (a stop), the
ids that count, what each releases, then the delta and at the finish the completion, whose
fields the stages fill in (`Outcomes.publish`, `Outcomes.completion`). A request without
options has no stages: it pays for the choice (one attribute test) and for no hook.

Adding a text stage: its module in `pipeline/stages/`, its snapshot field in
`pipeline.request_state._ActiveFields`, and its line in `pipeline.stages.KINDS`; nothing here.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.batch import ChunkResult, decode_round
from pipeline.decode_stream import (
    DecodeStream,
    InvalidTokenIdError,
    StrictDecodeError,
    push_each,
)
from pipeline.request_state import FinishedRequest, HeldEvent, json_size
from pipeline.requests import failures
from pipeline.requests.outcomes import Outcomes
from pipeline.requests.work import Work
from pipeline.results import BatchResult, Delta
from pipeline.stages.base import NO_PLAN, Chunk, Plan
from schemas.fast_events import ParsedFinish, ParsedTokens
from schemas.validation import is_record_fault

# (request, its chunk, its decode outcome, per-token texts or None, its stream before or None,
# its stages' plan)
_Step = tuple[Work, list[int], ChunkResult, list[str] | None, DecodeStream | None, Plan]
_Staged = tuple[Work, list[int], DecodeStream | None, Plan]


class Decoder:
    """Decodes the batch's chunks and turns each into its request's outcomes."""

    def __init__(self, outcomes: Outcomes, max_text_bytes: int | None) -> None:
        self.outcomes = outcomes
        self.stages = outcomes.stages
        self.max_text_bytes = max_text_bytes  # see `RequestProcessor`

    def decode(self, work: Sequence[Work], result: BatchResult) -> None:
        """Decode every request's chunk: one batched round for the chunks pushed whole (those
        of requests whose stages need no per-token text), id by id for the others."""
        requests = self.outcomes.requests
        choose = self.stages.of
        # Only requests still active get decoded: a gap overflow may have failed one meanwhile.
        plain: list[tuple[Work, list[int]]] = []
        staged: list[_Staged] = []
        singles: list[_Step] = []
        for entry in work:
            state = entry.state
            if requests.get(entry.request_id) is not state:
                continue
            plan = state.stages
            if plan is None:
                plan = choose(entry.request_id, state, entry)
            if not plan.stages:
                plain.append((entry, _joined_ids(entry.events)))  # no stage: the fast path
                continue
            if plan.whole:  # stages that need nothing of the decode: the batched round as is
                staged.append((entry, _joined_ids(entry.events), None, plan))
                continue
            try:
                self._stages_asked(entry, plan, staged, singles, result)
            except BaseException as error:  # as in `process`: this request only
                if not is_record_fault(error):
                    raise
                failures.fail_unexpected(self.outcomes, entry, error, result)
        batched = list(staged)
        batched += [(w, chunk, None, NO_PLAN) for w, chunk in plain]
        try:
            outcomes = decode_round([(w.state.stream, chunk) for w, chunk, _, _ in batched])
        except BaseException as error:  # the round isolates streams; this fault is around them
            if not is_record_fault(error):
                raise
            for entry, _, _, _ in batched:
                failures.fail_unexpected(self.outcomes, entry, error, result)
            return
        steps: list[_Step] = [
            (w, c, o, None, before, plan)
            for (w, c, before, plan), o in zip(batched, outcomes, strict=True)
        ]
        # Requests with stages first, then the rest: the order results have always come in.
        steps[len(staged) : len(staged)] = singles
        advance = self._advance
        for entry, chunk, outcome, texts, before, plan in steps:
            try:
                advance(entry, chunk, outcome, texts, before, plan, result)
            except BaseException as unexpected:  # as in `process`: this request only
                if not is_record_fault(unexpected):
                    raise
                failures.fail_unexpected(self.outcomes, entry, unexpected, result)

    def _stages_asked(
        self,
        entry: Work,
        plan: Plan,
        staged: list[_Staged],
        singles: list[_Step],
        result: BatchResult,
    ) -> None:
        """What a request's stages need of its decode: each id's text (into `singles`, pushed
        id by id here) or a copy of the stream before the chunk (into `staged`, for the
        batched round). A chunk a stage cannot use fails its request here."""
        for check in plan.checks:
            fault = check(entry)
            if fault is not None:
                failures.fail_on_event(self.outcomes, entry, *fault, result)
                return
        chunk = _joined_ids(entry.events)
        stream = entry.state.stream
        if plan.per_token:
            texts: list[str] = []
            try:
                push_each(stream, chunk, texts)
                outcome = ChunkResult("".join(texts))
            except (StrictDecodeError, InvalidTokenIdError) as error:
                outcome = ChunkResult("".join(texts), error)
            singles.append((entry, chunk, outcome, texts, None, plan))
        else:
            before = stream.clone() if plan.stream_before else None
            staged.append((entry, chunk, before, plan))  # type: ignore[arg-type]

    def _advance(
        self,
        entry: Work,
        chunk: list[int],
        outcome: ChunkResult,
        texts: list[str] | None,
        before: DecodeStream | None,
        plan: Plan,
        result: BatchResult,
    ) -> None:
        """A chunk's decoded text into its request: through its stages (a stop found, the ids
        that count recorded, text held back), then the delta, and at the finish the
        completion."""
        out = self.outcomes
        state = entry.state
        error = outcome.error
        if error is not None and not isinstance(error, StrictDecodeError | InvalidTokenIdError):
            failures.fail_unexpected(out, entry, error, result)
            return
        text = outcome.text
        pushed = len(chunk)
        if error is not None:
            bad_id = getattr(error, "token_id", None)
            pushed = chunk.index(bad_id) if bad_id in chunk else 0
        last = entry.events[-1].event
        finished = error is None and type(last) is ParsedFinish
        if finished:
            text += state.stream.flush()
        if chunk and state.logprobs is None:
            state.logprobs = False  # its first ids came without logprobs: see `Logprobs.choose`
        staged = plan.stages  # falsy for a request without options: no stage work below
        if staged:
            for stops, end in plan.stoppers:
                found = stops(state, text)
                if found is not None:
                    step = Chunk(entry, chunk, pushed, text, texts, before, finished, plan)
                    end(out, step, found, result)
                    return
            if plan.decodes:
                step = Chunk(entry, chunk, pushed, text, texts, before, finished, plan)
                for decoded in plan.decodes:
                    decoded(state, step, pushed)
        if error is not None:
            failures.fail_decode(out, entry, chunk, text, error, result)  # type: ignore[arg-type]
            return
        state.generated_tokens += pushed
        result.decoded_tokens += pushed
        limit = self.max_text_bytes
        size = None  # encoded once: the limit check and the running size share it
        if limit is not None:
            size = json_size(text)
            if state.text_size + size > limit:
                failures.fail_too_large(out, entry, text, result)
                return
        state.add_text(text, size)
        published = text
        if staged:
            for release in plan.releases:
                published = release(state, published, finished)
        out.filtered_ids(entry.request_id, state, result)
        if plan.publishes:
            out.publish(entry.request_id, state, last.seq, published, finished, result, plan)
        elif published or finished:  # no stage fills in a field: the delta as it is, inline
            offset = state.text_chars - len(state.stop_held) - len(published)
            delta = Delta(
                entry.request_id, state.model, state.delta_start, last.seq, offset, published,
                finished,
            )  # fmt: skip
            result.deltas.append(delta)
            state.delta_start = last.seq + 1
        if finished:
            result.completions.append(
                out.completion(entry.request_id, state, "ok", last.finish_reason, plan=plan)
            )
            marker = FinishedRequest(last_seq=last.seq, last_event_at=state.last_event_at)
            out.close(entry.request_id, state, marker, result)


def _joined_ids(events: Sequence[HeldEvent]) -> list[int]:
    """The generated ids of a request's in-order events, as one chunk (list extends, no
    per-id Python loop: this runs for every active request of every batch)."""
    ids: list[int] = []
    for held in events:
        if type(held.event) is ParsedTokens:
            ids += held.event.token_ids
    return ids
