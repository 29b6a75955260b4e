"""The reasoning stage: splits generated text into reasoning and the content that follows it.

It reproduces vLLM's `deepseek_r1` and `qwen3` parsers (pipeline/chat/formats.py), streamed:
text is reasoning until the end marker, the first start marker is dropped, and without an end
marker everything is reasoning (a truncated thought). For Qwen3, a `<tool_call>` followed by
`<function=` also ends reasoning and stays in the content; only the first `<tool_call>` counts,
as vLLM looks only at the first. Markers split across pieces are held back (pipeline/chat/
scan.py); a `<tool_call>` whose follow-up is still undecided is held back with what follows it
(whitespace, then at most the follow-up's length).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pipeline.chat.formats import ReasoningFormat
from pipeline.chat.scan import marker_set

PromptState = Literal["open", "closed"] | None
_FOLLOW_NEXT = re.compile(r"[\s=]")


class ReasoningStage:
    """One request's reasoning split; its fields are plain values (see `snapshot`)."""

    __slots__ = (
        "fmt", "active", "in_reasoning", "held", "start_seen", "implicit", "lead",
    )  # fmt: skip

    def __init__(self, fmt: ReasoningFormat, prompt_state: PromptState = None) -> None:
        self.fmt = fmt
        # "closed": the prompt already ended reasoning (vLLM's prompt_is_reasoning_end), so
        # the whole output is content and reasoning is None. "open" and None both start in
        # reasoning for these formats: text before the end marker is reasoning either way.
        self.active = prompt_state != "closed"
        self.in_reasoning = self.active
        self.held = ""
        self.start_seen = False
        # The implicit end: "" not met yet, "pending" (its marker and follow-up are `held`),
        # "denied" (the first one was not a call: later ones are not looked at), "ended".
        self.implicit = ""
        # Whitespace before any start marker, held: vLLM drops the text before `<think>`, and
        # keeping whitespace back is enough to agree on a leading newline (NEW_LINE in vLLM's
        # tests/reasoning/test_deepseekr1_reasoning_parser.py). Other text cannot wait.
        self.lead: str | None = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) that `text` makes final. `final` flushes what is held: a held
        marker prefix is text after all, and an undecided implicit end is denied."""
        if not self.in_reasoning:
            return "", text
        text, self.held = self.held + text, ""
        reasoning: list[str] = []
        pos = 0
        if self.implicit == "pending":
            marker = self.fmt.implicit_end or ""
            content = self._implicit(text, len(marker), reasoning, final)
            if content is not None:
                return "".join(reasoning), content
            pos = len(marker) if self.implicit == "denied" else len(text)
        content = self._scan(text, pos, reasoning, final)
        return "".join(reasoning), content

    def result(self, reasoning: str) -> str | None:
        """The final reasoning as vLLM reports it: None when absent, else the text ("" too)."""
        if not self.active or (self.implicit == "ended" and not reasoning):
            return None
        return reasoning

    def _markers(self) -> tuple[str, ...]:
        fmt = self.fmt
        markers = [fmt.end]
        if not self.start_seen:
            markers.append(fmt.start)
        if fmt.implicit_end and not self.implicit:
            markers.append(fmt.implicit_end)
        return tuple(markers)

    def _scan(self, text: str, pos: int, reasoning: list[str], final: bool) -> str:
        """Reasoning from `pos` up to a region change; returns the content after it."""
        while pos < len(text) or final:
            markers = marker_set(self._markers())
            hit = markers.find(text, pos)
            if hit is None:
                rest = text[pos:]
                keep = 0 if final else markers.held_length(rest)
                self._emit(rest[: len(rest) - keep], reasoning, final)
                self.held = rest[len(rest) - keep :]
                return ""
            self._emit(text[pos : hit.start], reasoning, False)
            if hit.marker == self.fmt.end:
                self._emit("", reasoning, True)
                self.in_reasoning = False
                return text[hit.end :]
            if hit.marker == self.fmt.start:
                self.start_seen, self.lead = True, None
                pos = hit.end
                continue
            content = self._implicit(text[hit.start :], hit.end - hit.start, reasoning, final)
            if content is not None:
                return content
            if self.implicit == "pending":
                return ""
            pos = hit.end
        return ""

    def _implicit(self, text: str, size: int, reasoning: list[str], final: bool) -> str | None:
        """`text` starts with the implicit end marker (`size` chars): end, hold, or deny it.

        Returns the content when reasoning ends here, else None (held: `implicit` is
        "pending"; denied: the marker went to reasoning and scanning goes on after it).
        """
        verdict = implicit_follows(text[size:], self.fmt, final)
        if verdict is True:
            self._emit("", reasoning, True)
            self.in_reasoning = False
            self.implicit = "ended"
            return text
        if verdict is None:
            self.implicit = "pending"
            self.held = text
            return None
        self.implicit = "denied"
        self._emit(text[:size], reasoning, False)
        return None

    def _emit(self, piece: str, reasoning: list[str], flush: bool) -> None:
        """Reasoning text, except leading whitespace while a start marker may still come."""
        if self.lead is not None:
            if not flush and (not piece or piece.isspace()):
                self.lead += piece
                return
            piece, self.lead = self.lead + piece, None
        if piece:
            reasoning.append(piece)

    def snapshot(self) -> dict[str, Any]:
        """The stage's state as plain values (the format is the parser's, not stored here)."""
        return {
            "active": self.active,
            "in_reasoning": self.in_reasoning,
            "held": self.held,
            "start_seen": self.start_seen,
            "implicit": self.implicit,
            "lead": self.lead,
        }

    def restore(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def implicit_follows(after: str, fmt: ReasoningFormat, final: bool) -> bool | None:
    """Whether `after` confirms an implicit end (True), refutes it (False), or may yet (None).

    vLLM's test on the whole output is `re.match(r"<function[\\s=]", after.lstrip())`.
    """
    follow = fmt.implicit_follow
    stripped = after.lstrip()
    if len(stripped) <= len(follow):
        if final or not follow.startswith(stripped):
            return False
        return None
    return stripped.startswith(follow) and _FOLLOW_NEXT.match(stripped, len(follow)) is not None
