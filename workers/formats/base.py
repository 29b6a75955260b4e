"""What every completion writer takes, whatever it writes.

A writer gets each request's result once: its completion (when the processor published one) and,
when the request failed, why. detok's own formats need only the completion; OpenAI batch output
needs the reason, because there a failed request is an error line with a code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, TextIO

from schemas.events import Completion


class FormatError(ValueError):
    """A file is not in the format it was read as, or a format cannot be used here."""


class MissingExtra(FormatError):
    """A format needs an optional dependency that is not installed."""


@dataclass(frozen=True, slots=True)
class RequestFailure:
    """Why a request has no usable completion: a dead-letter reason as `code`."""

    request_id: str
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class Destination:
    """Where a writer writes: a temporary file it creates (`mode` "x", never an existing file)
    or, for an output that is not a regular file, the output itself (`mode` "w")."""

    path: Path
    mode: Literal["x", "w"]

    def open_text(self) -> TextIO:
        return self.path.open(self.mode, encoding="utf-8")


class CompletionWriter(Protocol):
    # Completions the format could not hold, left out of the file (each names its request).
    refused: list[RequestFailure]

    def write(self, completion: Completion | None, failure: RequestFailure | None) -> None: ...

    def close(self) -> None:
        """Write out anything buffered; the file is complete after it."""


# A completion's chat outputs (docs/chat-outputs.md): None for a request no chat parser read.
CHAT_FIELDS = ("reasoning", "tool_calls", "reasoning_tokens")


def carries_chat(completion: Completion) -> bool:
    """Whether a chat parser read the request (the completion has a chat field)."""
    return any(getattr(completion, name) is not None for name in CHAT_FIELDS)


# One request's result as one line of text, or None when the format has nothing to say about it.
LineOf = Callable[[Completion | None, RequestFailure | None], str | None]


class LineWriter:
    """A writer of one JSON line per request, for the JSONL-based formats."""

    def __init__(self, handle: TextIO, line_of: LineOf) -> None:
        self._handle = handle
        self._line_of = line_of
        self.refused: list[RequestFailure] = []  # JSON holds every completion

    def write(self, completion: Completion | None, failure: RequestFailure | None) -> None:
        line = self._line_of(completion, failure)
        if line is not None:
            self._handle.write(line + "\n")

    def close(self) -> None:
        self._handle.close()
