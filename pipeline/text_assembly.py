"""One request's text rebuilt from its deltas, placed by offset: what a reader that follows
requests (`workers.io.follow`) shows.

A delta says where its text starts (`text_offset`, characters before it). Under exactly-once a
read_committed reader sees each delta once, in order; under at-least-once a worker restarted
after a crash writes again deltas it had written (cut differently, the same characters, since
the text is a function of the ids). Placing by offset covers both: of each delta only the
characters past those already shown are new, so a replayed delta adds nothing and a longer one
adds only its tail. A delta that starts past the shown text (one a reader met before the delta
ahead of it, which a reader of one partition does not see, but costs nothing to allow) is held
until the text reaches it. The completion ends the request: the characters of its text not yet
shown (a failed request's text, the text of deltas a reader never got) come with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.events import Completion, TextDelta


@dataclass(frozen=True)
class TextUpdate:
    """Characters new to the reader: `text` starts `text_offset` characters into the request's
    text. The request's last update carries its `completion`."""

    request_id: str
    text_offset: int
    text: str
    completion: Completion | None = None


class TextAssembler:
    """The shown text of every request met so far, and deltas held for a gap."""

    def __init__(self) -> None:
        self._shown: dict[str, str] = {}
        self._held: dict[str, dict[int, str]] = {}
        self._completed: set[str] = set()

    def delta(self, delta: TextDelta) -> list[TextUpdate]:
        """The updates this delta makes (none for a replay of shown text, or a completed
        request's late delta)."""
        request_id = delta.request_id
        if request_id in self._completed:
            return []
        held = self._held.setdefault(request_id, {})
        if len(delta.text) > len(held.get(delta.text_offset, "")):
            held[delta.text_offset] = delta.text
        updates = []
        while True:
            shown = self._shown.get(request_id, "")
            placeable = [offset for offset in held if offset <= len(shown)]
            if not placeable:
                break
            for offset in sorted(placeable):
                text = held.pop(offset)
                new = text[len(shown) - offset :]
                if new:
                    updates.append(TextUpdate(request_id, len(shown), new))
                    shown += new
            self._shown[request_id] = shown
        if not held:
            del self._held[request_id]
        return updates

    def completion(self, completion: Completion) -> TextUpdate | None:
        """The request's last update: the completion, with any of its text not yet shown;
        None for a completion met again (a compacted topic read twice, an at-least-once
        replay)."""
        request_id = completion.request_id
        if request_id in self._completed:
            return None
        self._completed.add(request_id)
        self._held.pop(request_id, None)
        shown = self._shown.pop(request_id, "")
        offset = min(len(shown), len(completion.text))
        return TextUpdate(request_id, offset, completion.text[offset:], completion)

    def text(self, request_id: str) -> str:
        """What was shown of a request not yet completed."""
        return self._shown.get(request_id, "")
