"""The tool stage: finds tool calls in the content the reasoning stage leaves.

One reader per region of a format's body kind (pipeline/chat/formats.py). Readers take the
text from a position, emit what became final, and return where they stopped (the end of the
text, having kept back a possible marker prefix in `held`, or a region change). vLLM's rule
that a malformed call turns the whole output into content needs the text since the first call
marker until the first call is read, so that text is kept (`raw`) exactly that long; a call's
own body is kept until it is complete. Both are linear in the text.

Where a stream cannot give vLLM's non-streaming result (a malformed call after calls already
sent, text before a bare JSON call), the choices are in docs/chat-outputs.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from pipeline.chat.calls import call_id, json_list_calls, json_object_call, tagged_json_call
from pipeline.chat.formats import ToolFormat
from pipeline.chat.output import DeltaBuilder
from pipeline.chat.scan import Hit, marker_set

_IN_STRING = re.compile(r'["\\]')
_OUT_STRING = re.compile(r'["{}]')
_FIRST_REGION = {
    "tagged_json": "text",
    "name_then_args": "text",
    "json_list": "text",
    "json_objects": "lead",
}
_BODY_REGION = {"tagged_json": "call", "name_then_args": "name", "json_list": "body"}


class ToolStage:
    """One request's tool-call parsing state, all plain values (see `snapshot`)."""

    __slots__ = (
        "fmt", "request_id", "region", "held", "buf", "raw", "calls", "called", "depth",
        "in_string", "escaped", "adjacent",
    )  # fmt: skip

    def __init__(self, fmt: ToolFormat, request_id: str) -> None:
        self.fmt = fmt
        self.request_id = request_id
        self.region = _FIRST_REGION[fmt.body]
        self.held = ""
        self.buf: list[str] = []  # the current call's body (or name) so far
        self.raw: list[str] | None = None  # text since the first call marker, until a call
        self.calls: list[list[str]] = []  # [name, arguments] of each call sent
        self.called = False  # vLLM's tools_called
        self.depth = 0
        self.in_string = False
        self.escaped = False
        # vLLM's llama3_json skips a `{` right at the end of the previous object (its
        # `start_index <= end_index` test) and reads the objects inside it instead.
        self.adjacent = False

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """Parse `text` (content after reasoning); `final` flushes and closes what is open.
        Returns the content and the tool-call deltas it makes final."""
        out = DeltaBuilder()
        text, self.held = self.held + text, ""
        pos, size = 0, len(text)
        while pos < size:
            pos = _READERS[self.region](self, text, pos, out, final)
        if final:
            self._finish(out)
        return "".join(out.content), out.tool_calls

    def _until(
        self, text: str, pos: int, markers: tuple[str, ...], final: bool
    ) -> tuple[str, Hit | None]:
        """The text from `pos` to the first marker (and the marker), holding a prefix back."""
        found = marker_set(markers)
        hit = found.find(text, pos)
        if hit is not None:
            return text[pos : hit.start], hit
        rest = text[pos:]
        keep = 0 if final else found.held_length(rest)
        self.held = rest[len(rest) - keep :]
        return rest[: len(rest) - keep], None

    # -- regions ---------------------------------------------------------------------------

    def _text(self, text: str, pos: int, out: DeltaBuilder, final: bool) -> int:
        piece, hit = self._until(text, pos, (self.fmt.open,), final)
        out.content.append(piece)
        if hit is None:
            return len(text)
        self.region = _BODY_REGION[self.fmt.body]
        self.buf = []
        if self.fmt.body == "tagged_json" and not self.calls:
            self.raw = [hit.marker]
        if self.fmt.body == "name_then_args":
            self.called = True
        return hit.end

    def _plain(self, text: str, pos: int, out: DeltaBuilder, final: bool) -> int:
        out.content.append(text[pos:])
        return len(text)

    def _call(self, text: str, pos: int, out: DeltaBuilder, final: bool) -> int:
        piece, hit = self._until(text, pos, (self.fmt.close,), final)
        self.buf.append(piece)
        if hit is None:
            return len(text)
        self._close_call(tagged_json_call("".join(self.buf)), out, self.fmt.close)
        return hit.end

    def _between(self, text: str, pos: int, out: DeltaBuilder, final: bool) -> int:
        _, hit = self._until(text, pos, (self.fmt.open,), final)
        if hit is None:
            return len(text)
        self.region, self.buf = "call", []
        return hit.end

    def _name(self, text: str, pos: int, out: DeltaBuilder, final: bool) -> int:
        fmt = self.fmt
        piece, hit = self._until(text, pos, (fmt.open, fmt.args_start), final)
        self.buf.append(piece)
        if hit is None:
            return len(text)
        if hit.marker == fmt.open:  # a part without arguments: vLLM skips it
            self.buf = []
            return hit.end
        name = "".join(self.buf).replace(fmt.name_drop, "") if fmt.name_drop else "".join(self.buf)
        index = len(self.calls)
        self.calls.append([name, ""])
        out.start_call(index, call_id(self.request_id, index, fmt.id_style), name)
        self.region, self.buf = "args", []
        return hit.start  # the `{` opens the arguments

    def _args(self, text: str, pos: int, out: DeltaBuilder, final: bool) -> int:
        piece, hit = self._until(text, pos, (self.fmt.open,), final)
        if piece:
            self.calls[-1][1] += piece
            out.add_arguments(len(self.calls) - 1, piece)
        if hit is None:
            return len(text)
        self.region, self.buf = "name", []
        return hit.end

    def _body(self, text: str, pos: int, out: DeltaBuilder, final: bool) -> int:
        self.buf.append(text[pos:])
        return len(text)

    def _lead(self, text: str, pos: int, out: DeltaBuilder, final: bool) -> int:
        piece, hit = self._until(text, pos, (self.fmt.open, "{"), final)
        if piece and not piece.isspace():
            # Text first: not a call output (vLLM's streaming rule); everything is content.
            out.content.extend(self.raw or ())
            self.raw, self.held, self.region = None, "", "plain"
            return pos
        if self.raw is None:
            self.raw = []
        self.raw.append(piece)
        if hit is None:
            return len(text)
        self.region = "objects"
        if hit.marker == "{":
            return hit.start
        self.raw.append(hit.marker)
        return hit.end

    def _objects(self, text: str, pos: int, out: DeltaBuilder, final: bool) -> int:
        if self.depth == 0:
            if self.adjacent:
                self.adjacent = False
                if text[pos] == "{":
                    if self.raw is not None:
                        self.raw.append("{")
                    return pos + 1
            start = text.find("{", pos)
            between = text[pos:] if start < 0 else text[pos:start]
            if self.raw is not None:  # text between calls is dropped once a call is read
                self.raw.append(between)
            if start < 0:
                return len(text)
            self.depth, self.buf = 1, ["{"]
            return self._object_body(text, start + 1, out)
        return self._object_body(text, pos, out)

    def _object_body(self, text: str, pos: int, out: DeltaBuilder) -> int:
        """Brace matching outside JSON strings, to the end of the object or of the text."""
        size, buf = len(text), self.buf
        while pos < size:
            if self.escaped:
                buf.append(text[pos])
                pos, self.escaped = pos + 1, False
                continue
            found = (_IN_STRING if self.in_string else _OUT_STRING).search(text, pos)
            if found is None:
                buf.append(text[pos:])
                return size
            end = found.end()
            buf.append(text[pos:end])
            pos, char = end, found.group()
            if char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = not self.in_string
            elif char == "{":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    return self._close_object(text, pos, out)
        return size

    def _close_object(self, text: str, pos: int, out: DeltaBuilder) -> int:
        body = "".join(self.buf)
        self.buf, self.adjacent = [], True
        call = json_object_call(body)
        if call is None and self.raw is not None:
            out.content.extend(self.raw)
            out.content.append(body)
            self.raw, self.region = None, "plain"
            return pos
        self._send(call, body, out)
        return pos

    # -- calls -----------------------------------------------------------------------------

    def _close_call(self, call: tuple[str, str] | None, out: DeltaBuilder, close: str) -> None:
        """A tagged call is complete (`close` is its end marker, "" at the end of text)."""
        body = "".join(self.buf)
        self.buf = []
        if call is None and self.raw is not None:
            # vLLM: the whole output becomes content; nothing was sent since the marker.
            out.content.extend(self.raw)
            out.content.append(body + close)
            self.raw, self.region = None, "plain"
            return
        self._send(call, self.fmt.open + body + close, out)
        self.region = "between"

    def _send(self, call: tuple[str, str] | None, text: str, out: DeltaBuilder) -> None:
        """Send a read call. A malformed one after calls were sent: vLLM's llama3_json skips
        it (tests/tool_parsers/test_llama3_json_tool_parser.py, brace and JSON fragment in
        trailing text); for tagged calls it stays content (docs/chat-outputs.md)."""
        if call is None:
            if self.fmt.body != "json_objects":
                out.content.append(text)
            return
        self.raw = None
        index = len(self.calls)
        self.calls.append(list(call))
        self.called = True
        out.start_call(index, call_id(self.request_id, index, self.fmt.id_style), *call)

    def _finish(self, out: DeltaBuilder) -> None:
        region = self.region
        if region == "call":
            self._close_call(tagged_json_call("".join(self.buf)), out, "")
        elif region == "objects" and self.depth:
            self.depth, self.in_string, self.escaped = 0, False, False
            body = "".join(self.buf)
            self.buf = []
            if self.raw is not None:
                out.content.extend(self.raw)
                out.content.append(body)
                self.raw = None
        elif region == "body":
            self._finish_list(out)
        if self.raw is not None:  # a bare-JSON output without any object: all content
            out.content.extend(self.raw)
            self.raw = None
        self.region = "plain"

    def _finish_list(self, out: DeltaBuilder) -> None:
        body = "".join(self.buf)
        calls = None if self.fmt.open in body else json_list_calls(body)
        if calls is None:
            # vLLM's content here is the stripped body alone; the text before the marker
            # was already sent, so it stays (docs/chat-outputs.md).
            out.content.append(body.strip())
            return
        self.called = True
        for call in calls:
            self._send(call, "", out)

    # -- state -----------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The stage's state as plain values (lists of strings joined)."""
        return {
            "region": self.region,
            "held": self.held,
            "buf": "".join(self.buf),
            "raw": None if self.raw is None else "".join(self.raw),
            "calls": [list(call) for call in self.calls],
            "called": self.called,
            "depth": self.depth,
            "in_string": self.in_string,
            "escaped": self.escaped,
            "adjacent": self.adjacent,
        }

    def restore(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)
        self.buf = [state["buf"]] if state["buf"] else []
        self.raw = None if state["raw"] is None else [state["raw"]]
        self.calls = [list(call) for call in state["calls"]]


_Reader = Callable[[ToolStage, str, int, DeltaBuilder, bool], int]
_READERS: dict[str, _Reader] = {
    "text": ToolStage._text,
    "plain": ToolStage._plain,
    "call": ToolStage._call,
    "between": ToolStage._between,
    "name": ToolStage._name,
    "args": ToolStage._args,
    "body": ToolStage._body,
    "lead": ToolStage._lead,
    "objects": ToolStage._objects,
}
