"""`Delta.absorb`: a request's deltas coalesced within a transaction carry exactly what the
deltas did, in every field (text, logprobs, reasoning, tool-call pieces), placed by the
first delta's offsets."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pipeline.results import Delta

_PIECES = st.lists(
    st.tuples(st.text(max_size=4), st.text(max_size=4), st.integers(0, 2), st.text(max_size=4)),
    min_size=1,
    max_size=8,
)


def _deltas(pieces: list[tuple[str, str, int, str]]) -> list[Delta]:
    """Chat deltas of one request, with offsets counted as the stage counts them: each call
    is started once (its first piece carries id and name), then takes argument pieces."""
    deltas, text_at, reasoning_at, arguments_at = [], 0, 0, {}
    for seq, (text, reasoning, index, arguments) in enumerate(pieces, start=1):
        calls = []
        if index not in arguments_at:
            function = {"name": f"f{index}", "arguments": arguments}
            calls.append({"index": index, "id": f"c{index}", "type": "function",
                          "function": function, "arguments_offset": 0})  # fmt: skip
            arguments_at[index] = len(arguments)
        elif arguments:
            calls.append({"index": index, "function": {"arguments": arguments},
                          "arguments_offset": arguments_at[index]})  # fmt: skip
            arguments_at[index] += len(arguments)
        deltas.append(
            Delta("r", "m", seq, seq, text_at, text, False, None, reasoning, reasoning_at, calls)
        )
        text_at += len(text)
        reasoning_at += len(reasoning)
    return deltas


def _arguments(deltas: list[Delta]) -> dict[int, str]:
    """Each call's arguments, placed by offset as a reader does."""
    placed: dict[int, str] = {}
    for delta in deltas:
        for call in delta.tool_calls or []:
            have = placed.get(call["index"], "")
            piece = call["function"]["arguments"]
            start = call["arguments_offset"]
            assert start <= len(have)
            placed[call["index"]] = have[:start] + piece + have[start + len(piece) :]
    return placed


@given(_PIECES, st.data())
def test_coalesced_deltas_carry_what_the_deltas_carried(pieces, data):
    deltas = _deltas(pieces)
    cut = data.draw(st.integers(0, len(deltas) - 1))
    first, *rest = _deltas(pieces)[cut:]
    for later in rest:
        first.absorb(later)
    tail = deltas[cut:]
    assert first.text == "".join(d.text for d in tail)
    assert first.text_offset == tail[0].text_offset
    assert first.reasoning == "".join(d.reasoning for d in tail)
    assert first.reasoning_offset == tail[0].reasoning_offset
    assert _arguments(deltas[:cut] + [first]) == _arguments(deltas)
    # No call's pieces are split where they could be one: each index once per run.
    indexes = [call["index"] for call in first.tool_calls]
    assert all(a != b for a, b in zip(indexes, indexes[1:], strict=False))


def test_absorb_does_not_change_the_later_delta():
    a, b = _deltas([("x", "", 0, "{"), ("y", "", 0, "}")])
    before = repr(b)
    a.absorb(b)
    assert repr(b) == before
    assert a.tool_calls[0]["function"]["arguments"] == "{}"
    assert a.tool_calls[0]["id"] == "c0"
