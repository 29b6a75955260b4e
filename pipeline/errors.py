"""The domain exceptions of the pipeline: one class per way a record or a request can fail.

Most of them are never raised across a module boundary: the processor turns a failure into a
dead letter on the spot, and the class's name is what the dead letter's
`__connect.errors.exception.class.name` header carries (`pipeline.dead_letter_reasons` maps each
reason to its class). Naming real classes there lets a reader of the dead-letter topic find the
code that made the record. `SnapshotError` is the one raised to a caller: the worker catches it
around each restored changelog record.
"""

from __future__ import annotations


class SequenceError(Exception):
    """An event that breaks its request's sequence rules: no prompt before it, after the
    finish, a gap that never closed, or a request that had already failed."""


class TokenIdOutOfRangeError(ValueError):
    """A prompt id the model itself could not have produced (at or past its vocabulary)."""


class RequestExpiredError(Exception):
    """A request that received no event for longer than the request TTL."""


class DuplicateRequestIdError(ValueError):
    """A request id that already appeared earlier in the same `detok run` input."""


class OutputTooLargeError(Exception):
    """An output (a request's text, a completion, a snapshot) larger than the broker accepts."""


class SnapshotError(ValueError):
    """A changelog value that cannot be turned back into request state: undecodable bytes, a
    missing or wrong-typed field, an unknown snapshot version, a model no longer configured."""


class KeyMismatchError(ValueError):
    """A record whose Kafka key differs from the request id in its value."""


class PartitionMismatchError(Exception):
    """A request whose events arrive on more than one input partition."""
