"""The worker's outputs: what a batch produces, kept in the checkpoint, and committed.

Completions, filtered-id records and dead letters go into the checkpoint as they come; deltas
are coalesced per request. Every commit interval the loop hands the checkpoint to `commit`:
those outputs, the changelog records of the requests touched, and the consumed offsets go to
the commit strategy (workers/runtime/checkpointing.py). A commit that did not take is accounted for
in `take`: re-offered offsets, or a rollback (forget uncommitted state, restore it, re-consume
from the commit).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from confluent_kafka import OFFSET_BEGINNING, KafkaException, TopicPartition

from pipeline.processor import BatchResult, DeadLetter, RequestProcessor
from schemas.events import DeadLetterReason, dump_json
from workers.kafka.topic_names import TopicNames
from workers.runtime.changelog import (
    SETTLE_LOOKUP_TIMEOUT_S,
    RestoreInterrupted,
    changelog_record,
    settled_commits,
)
from workers.runtime.checkpointing import (
    Checkpoint,
    CommitOutcome,
    Deadline,
    FatalWorkerError,
    Output,
    ProducerFailed,
)
from workers.runtime.output_writer import OutputWriter
from workers.runtime.process_policy import StopRequest
from workers.runtime.prometheus import PrometheusMetrics
from workers.runtime.record_handling import unexpected
from workers.runtime.run_stats import RunStats
from workers.runtime.timeline import Timeline
from workers.runtime.worker_context import Clients, Ownership

log = logging.getLogger("detok.worker")


class Emitter:
    """The checkpoint of outputs and offsets not committed yet, and the commits that carry it."""

    def __init__(
        self,
        topics: TopicNames,
        processor: RequestProcessor,
        writer: OutputWriter,
        clients: Clients,
        ownership: Ownership,
        *,
        metrics: PrometheusMetrics,
        stats: RunStats,
        timeline: Timeline,
        stop: StopRequest,
        deadline: Deadline,
    ) -> None:
        self.topics = topics
        self.processor = processor
        self.writer = writer
        self.clients = clients
        self.ownership = ownership
        self.metrics = metrics
        self.stats = stats
        self.timeline = timeline
        self.stop = stop
        self.deadline = deadline
        self.checkpoint = Checkpoint.fresh()
        # The input partitions of the commit whose outcome `take` gets next (one is in flight
        # at most): what the timeline's "first commit" of an assignment is told about.
        self._committing: list[int] = []

    def emit(self, result: BatchResult) -> None:
        deltas = self.checkpoint.deltas
        for delta in result.deltas:
            previous = deltas.get(delta.request_id)
            if previous is None:
                deltas[delta.request_id] = delta
            else:
                previous.absorb(delta)
        outputs = self.checkpoint.outputs
        for completion in result.completions:
            request_id = completion.request_id
            outputs.append(
                Output(
                    self.topics.completions,
                    request_id.encode(),
                    dump_json(completion),
                    request_id=request_id,
                )
            )
        for record in result.filtered_ids:
            request_id = record.request_id
            outputs.append(
                Output(
                    self.topics.metrics,
                    request_id.encode(),
                    dump_json(record),
                    request_id=request_id,
                )
            )
        for letter in result.dead_letters:
            self.dead_letter(letter)
        if result.stop_signals:  # requests ended early: rare, and nothing to do otherwise
            outputs += self.writer.stop_signals(result)
        self.checkpoint.dirty |= result.touched
        self.metrics.observe_outputs(result)

    def dead_letter(self, letter: DeadLetter) -> None:
        self.checkpoint.outputs.append(self.writer.dead_letter(letter))

    def commit(self, wait: bool = True, in_rebalance_callback: bool = False) -> None:
        """Produce the checkpoint's records and commit them with its offsets.

        Under exactly-once the transaction commits on the committer thread; `wait=False` (the
        loop's periodic commit) returns at once and the next commit settles it first. Every
        other caller (shutdown, a revoke) waits for the outcome.
        """
        started = time.perf_counter()
        strategy, consumer = self.clients.strategy, self.clients.consumer
        self.take(strategy.settle(consumer))  # may roll back: a new checkpoint
        checkpoint = self.checkpoint
        if checkpoint.empty:
            checkpoint.started_at = time.monotonic()
            if not strategy.committing():
                self.metrics.observe_caught_up()
            return
        self.writer.produced = [] if strategy.keeps_records else None
        try:
            self._produce(checkpoint)
        except ProducerFailed as failure:
            strategy.producer_failed(failure)
        records, self.writer.produced = self.writer.produced or [], None
        offsets = [
            TopicPartition(self.topics.input, partition, offset)
            for partition, offset in sorted(checkpoint.offsets.items())
        ]
        self.checkpoint = Checkpoint.fresh()
        self._committing = list(checkpoint.offsets)
        ownership = self.ownership
        ownership.uncommitted = [
            p for p in ownership.uncommitted if p.isdisjoint(checkpoint.offsets)
        ]
        outcome = strategy.commit(
            consumer, offsets, checkpoint.decoded_tokens, records, in_rebalance_callback
        )
        self.stats.commit_s += time.perf_counter() - started
        if outcome is None and wait:
            outcome = strategy.settle(consumer)
        self.take(outcome)

    def _produce(self, checkpoint: Checkpoint) -> None:
        for output in checkpoint.outputs:
            self.writer.write(output)
        for request_id, delta in checkpoint.deltas.items():
            self.writer.write(
                Output(
                    self.topics.deltas,
                    request_id.encode(),
                    delta.to_wire_json(),
                    request_id=request_id,
                )
            )
        self.metrics.deltas_produced.inc(len(checkpoint.deltas))
        self._write_changelog(checkpoint)

    def take(self, outcome: CommitOutcome | None) -> None:
        """Account for a finished commit; roll back or re-offer what did not take."""
        if outcome is None:
            return
        self.stats.recommitted_commits += outcome.recommits > 0  # transactions, not attempts
        if outcome.committed:
            self.stats.commits += 1
            self.stats.last_commit_at = outcome.finished_at
            self.metrics.observe_caught_up()
            self.timeline.mark_partitions("first commit", self._committing, outcome.finished_at)
        else:
            self.stats.aborted_commits += 1
            moved = any(p not in self.ownership.assigned for p in outcome.refused_offsets)
            if outcome.rollback or moved:  # decoded again, here or by the partition's new owner
                self.stats.redone_tokens += outcome.decoded_tokens
        self.stats.slowest_commit_s = max(self.stats.slowest_commit_s, outcome.seconds)
        self.metrics.observe_commit(outcome.seconds, outcome.committed, outcome.recommits > 0)
        self.metrics.active_requests.set(self.processor.active_requests)
        if outcome.abort_cause is not None:
            self.metrics.observe_abort(outcome.abort_cause)
        if outcome.rollback:
            # Retrying a batch aborted because a pipeline topic was deleted aborts again, forever
            # (each retry writes to the same missing topic): that is fatal, and named.
            if self.missing_topics():
                raise FatalWorkerError("the transaction was aborted")
            self.rollback()
        # The outputs are out; only the offsets were refused, by a rebalance. Partitions we kept
        # (cooperative rebalances keep most) offer them again with the next commit: dropped, an
        # idle partition's committed offset would lag behind its end forever.
        for partition, offset in outcome.refused_offsets.items():
            if partition in self.ownership.assigned:
                self.checkpoint.offsets.setdefault(partition, offset)

    def _write_changelog(self, checkpoint: Checkpoint) -> None:
        for request_id in checkpoint.dirty:
            partition = self.ownership.owners.get(request_id)
            if partition is None:
                continue
            records = self._changelog_records(request_id)  # may fail the request first
            state = self.processor.requests.get(request_id)
            for key, value in records:
                if self.processor.requests.get(request_id) is not state:
                    break  # a record too large failed the request, and wrote its marker
                self.writer.write(
                    changelog_record(
                        self.topics.changelog,
                        request_id,
                        value,
                        partition,
                        checkpoint.offsets.get(partition, -1),
                        key=key,
                    )
                )
            if state is None:
                del self.ownership.owners[request_id]

    def _changelog_records(self, request_id: str) -> list[tuple[bytes, bytes | None]]:
        """The request's changelog records (incremental: new text and a small head); a request
        whose state cannot be encoded fails (with an `unexpected_error` dead letter naming it)
        instead of the commit."""
        try:
            return self.processor.changelog_records(request_id)
        except Exception as error:
            log.warning("snapshot of request %s failed: %r", request_id, error)
            self.writer.write_failure(
                self.processor.mark_failed(request_id, DeadLetterReason.UNEXPECTED_ERROR)
            )
            letter = unexpected(error, None, request_id, None)
            self.writer.write_stand_in(letter, keep_original=True)
            return self.processor.changelog_records(request_id)

    def rollback(self) -> None:
        """After an abort: forget uncommitted state, restore it, re-consume from the commit."""
        partitions = sorted(self.ownership.assigned)
        self.stats.redone_tokens += self.checkpoint.decoded_tokens
        self.checkpoint = Checkpoint.fresh()
        self.drop_state(partitions)
        if not partitions:
            return
        try:
            committed = settled_commits(
                self.clients.consumer,
                self.topics.input,
                partitions,
                lambda: self.stop.requested,
                self.deadline.remaining(SETTLE_LOOKUP_TIMEOUT_S),
            )
        except RestoreInterrupted as interrupted:
            # Stopping: left unrestored, the partitions' records are dropped unhandled, and
            # nothing of them is committed; their next owner reprocesses from the commit.
            log.info("%s; not rewinding partitions %s", interrupted, partitions)
            committed = {}
        for partition, committed_offset in committed.items():
            offset = committed_offset if committed_offset >= 0 else OFFSET_BEGINNING
            try:
                self.clients.consumer.seek(TopicPartition(self.topics.input, partition, offset))
            except KafkaException:
                log.warning("rewind of partition %d failed", partition, exc_info=True)
        self.ownership.begin_restore(partitions)

    def drop_state(self, partitions: Iterable[int]) -> None:
        """Forget the requests of `partitions` and what the checkpoint holds of them: they are
        no longer ours (a revoke), or about to be restored from their last commit (a rollback)."""
        dropped = set(partitions)
        gone = [r for r, p in self.ownership.owners.items() if p in dropped]
        for request_id in gone:
            del self.ownership.owners[request_id]
            self.checkpoint.dirty.discard(request_id)
            self.checkpoint.deltas.pop(request_id, None)
        self.processor.forget(gone)
        for partition in dropped:
            self.checkpoint.offsets.pop(partition, None)
            self.ownership.newest_timestamp.pop(partition, None)

    def missing_topics(self) -> str:
        """Name a pipeline topic that is gone: a deleted output topic otherwise surfaces as a
        transaction error whose text blames fencing or timeouts.

        Asked through the producer: this runs in the consumer's revoke and lost callbacks too (a
        rollback there), and the consumer's own `list_topics` inside its callback aborts the
        process (confluent-kafka's `CallState_get: Assertion cs != NULL`; seen in the 2-worker
        bench when a rebalance aborted a transaction).
        """
        try:
            metadata = self.clients.producer.list_topics(timeout=self.deadline.remaining(5.0))
        except KafkaException:
            return ""
        missing = [t for t in self.topics.model_dump().values() if t not in metadata.topics]
        if not missing:
            return ""
        return f"; topic(s) {', '.join(missing)} no longer exist (deleted while the worker ran?)"
