"""`TextAssembler` (issue 31 item 3): deltas placed by offset show each character once under
either guarantee, whatever the cut and however often a delta is replayed."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.text_assembly import TextAssembler, TextUpdate
from schemas.events import Completion, TextDelta


def delta(offset: int, text: str, request_id: str = "r") -> TextDelta:
    return TextDelta(request_id=request_id, model="m", seq_start=1, seq_end=1,
                     text_offset=offset, text=text)  # fmt: skip


def completion(text: str, status: str = "ok", request_id: str = "r") -> Completion:
    return Completion(request_id=request_id, model="m", text=text, status=status,
                      prompt_tokens=1, generated_tokens=1)  # fmt: skip


def shown(updates: list[TextUpdate]) -> str:
    text = ""
    for update in updates:
        assert update.text_offset == len(text)
        text += update.text
    return text


def test_in_order_deltas_show_as_they_come() -> None:
    assembler = TextAssembler()
    updates = assembler.delta(delta(0, "Hello")) + assembler.delta(delta(5, ", 世界"))
    assert [(u.text_offset, u.text) for u in updates] == [(0, "Hello"), (5, ", 世界")]
    last = assembler.completion(completion("Hello, 世界"))
    assert last is not None and last.text == "" and last.completion is not None


def test_a_replay_cut_differently_adds_only_new_characters() -> None:
    """At-least-once: after a crash the worker writes deltas for 1..4 and then 1..14 again."""
    assembler = TextAssembler()
    updates = assembler.delta(delta(0, "abc")) + assembler.delta(delta(3, "def"))
    updates += assembler.delta(delta(0, "ab"))  # replayed, shorter
    updates += assembler.delta(delta(0, "abcdefgh"))  # replayed, longer
    updates += assembler.delta(delta(6, "gh"))  # replayed tail
    assert shown(updates) == "abcdefgh"
    assert [u.text for u in updates] == ["abc", "def", "gh"]


def test_a_delta_past_the_shown_text_waits_for_the_gap() -> None:
    assembler = TextAssembler()
    assert assembler.delta(delta(3, "def")) == []
    updates = assembler.delta(delta(0, "abc"))
    assert [u.text for u in updates] == ["abc", "def"]


def test_the_completion_brings_text_no_delta_showed_and_ends_the_request() -> None:
    assembler = TextAssembler()
    assembler.delta(delta(0, "par"))
    last = assembler.completion(completion("partial text", status="failed"))
    assert last == TextUpdate("r", 3, "tial text", last.completion)
    assert assembler.delta(delta(3, "tial")) == []  # a late delta of a completed request
    assert assembler.completion(completion("partial text")) is None  # met again


def test_requests_are_kept_apart() -> None:
    assembler = TextAssembler()
    assembler.delta(delta(0, "one", "a"))
    assembler.delta(delta(0, "two", "b"))
    assert (assembler.text("a"), assembler.text("b")) == ("one", "two")


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(max_size=40),
    data=st.data(),
)
def test_any_cut_with_any_replays_shows_the_text_once(text: str, data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)))) | {0, len(text)})
    pieces = [delta(a, text[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]
    # Replays: a worker restarted from an earlier commit writes a prefix of the stream again,
    # possibly merged into longer deltas.
    stream = list(pieces)
    for _ in range(data.draw(st.integers(0, 3))):
        start = data.draw(st.integers(0, len(text)))
        end = data.draw(st.integers(start, len(text)))
        stream.insert(data.draw(st.integers(0, len(stream))), delta(start, text[start:end]))
    assembler = TextAssembler()
    updates = [u for d in stream for u in assembler.delta(d)]
    assert shown(updates) == text
    last = assembler.completion(completion(text))
    assert last is not None and last.text == ""
