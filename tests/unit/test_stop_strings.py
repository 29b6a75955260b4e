"""The stop-string matcher against brute force, and stop strings / logprobs in the processor
(docs/decode-options.md): events after a stop, restore, hold-back, and bad logprob input."""

from __future__ import annotations

import json
import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline import stop_strings
from pipeline.processor import RequestProcessor
from pipeline.stop_strings import StopMatcher, StopScanner, matcher_for
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.events import Logprobs, TextDelta, dump_json
from schemas.fast_events import ParsedPrompt, ParsedTokens
from tests.unit.request_events import bytes_registry, finish, ids, reasons, run, run_records, tokens

# Stops that overlap, repeat, are prefixes and suffixes of each other, and hold multi-byte and
# astral characters.
CHARS = "ab\u00e9\U0001f389\n"
alphabet = st.text(alphabet=CHARS, max_size=12)
stop_lists = st.lists(st.text(alphabet=CHARS, min_size=1, max_size=4), min_size=1, max_size=4)


def first_stop(text: str, stops: list[str]) -> tuple[str, int, int] | None:
    """The naive rule: each string's first occurrence (`str.find` over the whole text) is its
    smallest end; the smallest end wins, and the longest string among those ending there."""
    found = [(text.find(s) + len(s), -len(s), s) for s in set(stops) if s in text]
    if not found:
        return None
    end, _, stop = min(found)
    return stop, end - len(stop), end


def held_suffix(text: str, stops: list[str]) -> str:
    """The naive hold-back: the longest suffix of `text` that is a proper prefix of a stop."""
    for start in range(len(text)):
        if any(len(s) > len(text) - start and s.startswith(text[start:]) for s in stops):
            return text[start:]
    return ""


@given(alphabet, stop_lists)
def test_a_scan_is_the_smallest_end_and_the_longest_there(text: str, stops: list[str]) -> None:
    expected = None
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            expected = (stop, end - len(stop), end)
            break
    match = StopScanner(StopMatcher(stops)).scan("", text)
    assert (None if match is None else tuple(match)) == expected == first_stop(text, stops)


@given(
    st.lists(st.text(alphabet=CHARS, max_size=6), max_size=12),
    stop_lists,
    st.lists(st.booleans(), min_size=12, max_size=12),
)
def test_chunked_scans_are_the_whole_text_rule(
    chunks: list[str], stops: list[str], restores: list[bool]
) -> None:
    """Fed chunk by chunk with the held text carried between them (as the processor does,
    sometimes through a fresh scanner, as after a restore from a snapshot), the first stop is
    the naive rule's on the whole text, and the held text the naive hold-back so far."""
    matcher = StopMatcher(stops)
    scanner = StopScanner(matcher)
    text = held = ""
    expected = None
    for chunk, restore in zip(chunks, restores, strict=False):
        if restore:
            scanner = StopScanner(matcher)
        base = len(text) - len(held)  # where `held + chunk` starts in the text
        text += chunk
        expected = first_stop(text, stops)
        match = scanner.scan(held, chunk)
        if match is not None:
            assert (match.stop, base + match.start, base + match.end) == expected
            return
        assert expected is None
        held = scanner.held
        assert held == held_suffix(text, stops)
    assert expected is None


def test_shared_prefixes_branch_and_fail_over() -> None:
    # A stop inside a longer one's prefix, two long stops sharing a prefix that branches, and
    # a failure link from deep in one chain into another.
    scanner = StopScanner(StopMatcher(["abcx", "abcy", "bcz", "c"]))
    assert scanner.scan("", "ab") is None and scanner.held == "ab"
    assert tuple(scanner.scan("ab", "cz")) == ("c", 2, 3)  # "c" ends first
    scanner = StopScanner(StopMatcher(["abcx", "abcy", "bcz"]))
    assert scanner.scan("", "zab") is None and scanner.held == "ab"
    assert scanner.scan("ab", "c") is None and scanner.held == "abc"
    assert tuple(scanner.scan("abc", "z")) == ("bcz", 1, 4)


def test_the_matcher_cache_is_bounded_in_characters(monkeypatch) -> None:
    # A producer sending a fresh long stop list per request: each list is cached (and reused
    # while its requests live), but the cache never holds more than its bound in characters.
    monkeypatch.setattr(stop_strings, "_MATCHERS", {})
    monkeypatch.setattr(stop_strings, "_MAX_CACHED_CHARS", 10_000, raising=False)
    for n in range(40):
        stops = [f"{n}:{'x' * 998}"]
        assert matcher_for(stops) is matcher_for(stops)
        assert sum(len(s) for key in stop_strings._MATCHERS for s in key) <= 10_000


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> TokenizerRegistry:
    return bytes_registry(tmp_path_factory.mktemp("tok"))


def stop_prompt(stop: list[str], include: bool = False) -> ParsedPrompt:
    return ParsedPrompt(
        request_id="r",
        model="bytes",
        prompt_token_ids=ids("Hi"),
        stop=stop,
        include_stop_str_in_output=include,
    )


def test_hold_back_is_only_what_may_begin_a_stop(registry) -> None:
    processor = RequestProcessor(registry)
    first = run(processor, stop_prompt(["</end>", "STOP"]), tokens(1, "text </e"))
    assert [d.text for d in first.deltas] == ["text "]
    second = run(processor, tokens(2, "x and S"))
    assert [d.text for d in second.deltas] == ["</ex and "]
    third = run(processor, tokens(3, "TOP more"), finish(4))
    assert [d.text for d in third.deltas] == [""]
    (completion,) = third.completions
    assert completion.text == "text </ex and "
    assert (completion.finish_reason, completion.stop_reason) == ("stop", "STOP")
    assert completion.generated_tokens == len(ids("text </ex and STOP"))
    # The finish in the same batch after the stop: consumed, and the marker is a plain one.
    assert third.events_after_stop == 1
    assert reasons(run(processor, tokens(5, "late"))) == ["event_after_finish"]


def test_without_stop_strings_nothing_is_held(registry) -> None:
    processor = RequestProcessor(registry)
    result = run(processor, stop_prompt(["zz"]), tokens(1, "abc z"))
    assert [d.text for d in result.deltas] == ["abc "]
    plain = run(
        RequestProcessor(registry),
        stop_prompt(["x"]).__class__(request_id="r", model="bytes", prompt_token_ids=ids("Hi")),
        tokens(1, "abc z"),
    )
    assert [d.text for d in plain.deltas] == ["abc z"]


def test_events_after_a_stop_are_counted_across_restore(registry) -> None:
    processor = RequestProcessor(registry)
    result = run(processor, stop_prompt(["\n\n"], include=True), tokens(1, "one\n\ntwo"))
    (completion,) = result.completions
    assert completion.text == "one\n\n" and completion.stop_reason == "\n\n"
    assert [d.text for d in result.deltas] == ["one\n\n"] and result.deltas[0].final
    restored = RequestProcessor(registry)
    restored.restore("r", processor.snapshot("r"))
    later = run_records(restored, tokens(2, "more"), tokens(3, "x"), finish(4))
    assert later.deltas == [] and later.completions == [] and later.dead_letters == []
    assert later.events_after_stop == 3
    assert reasons(run(restored, tokens(5, "x"))) == ["event_after_finish"]


def test_a_stop_completed_across_events_is_kept_whole_when_asked(registry) -> None:
    processor = RequestProcessor(registry)
    first = run(processor, stop_prompt(["abc"], include=True), tokens(1, "xxab"))
    assert [d.text for d in first.deltas] == ["xx"]
    second = run(processor, tokens(2, "cd"))
    assert [d.text for d in second.deltas] == ["abc"]
    assert second.completions[0].text == "xxabc"
    assert second.completions[0].generated_tokens == 5


def test_held_text_survives_restore(registry) -> None:
    processor = RequestProcessor(registry)
    first = run(processor, stop_prompt(["abc"]), tokens(1, "xxab"))
    assert [d.text for d in first.deltas] == ["xx"]
    restored = RequestProcessor(registry)
    restored.restore("r", processor.snapshot("r"))
    second = run(restored, tokens(2, "d"), finish(3))
    assert [d.text for d in second.deltas] == ["abd"]
    assert second.completions[0].text == "xxabd"


def logprob_tokens(seq: int, text: str, tops: list | None = None) -> ParsedTokens:
    token_ids = ids(text)
    return ParsedTokens(
        request_id="r",
        seq=seq,
        token_ids=token_ids,
        logprobs=[-1.0] * len(token_ids),
        top_logprobs=tops if tops is not None else [[(i, -2.0)] for i in token_ids],
    )


def test_logprob_entries_attribute_characters_to_the_completing_token(registry) -> None:
    processor = RequestProcessor(registry)
    result = run(processor, stop_prompt(["zz"]), logprob_tokens(1, "a€"), finish(2))
    logprobs = result.completions[0].logprobs
    content = logprobs.entries()
    assert [e.text for e in content] == ["a", "", "", "€"]
    assert [e.text_offset for e in content] == [0, 1, 1, 1]
    assert [bytes(e.bytes) for e in content] == [b"a", b"\xe2", b"\x82", b"\xac"]
    (delta,) = result.deltas
    assert delta.logprobs == logprobs.content  # the same entries, built once
    wire = TextDelta.model_validate_json(delta.to_wire_json())
    assert wire.logprobs.content == content
    assert delta.to_wire_json() == wire.model_dump_json().encode()
    # Built as JSON: equal to a validated copy, and dumped by pydantic without warnings.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Logprobs.model_validate_json(logprobs.model_dump_json()).content == content
        assert json.loads(result.completions[0].model_dump_json()) == json.loads(
            dump_json(result.completions[0])
        )


def test_mixed_logprob_presence_fails_the_request(registry) -> None:
    processor = RequestProcessor(registry)
    result = run(processor, stop_prompt(["zz"]), logprob_tokens(1, "ab"), tokens(2, "cd"))
    # The chunk is decoded as one: its other events go with the request.
    assert reasons(result) == ["schema_violation", "request_already_failed"]
    assert result.dead_letters[0].seq == 2
    assert result.completions[0].status == "failed"


def test_an_alternative_outside_the_vocabulary_is_out_of_range(registry) -> None:
    processor = RequestProcessor(registry)
    bad = logprob_tokens(1, "a", tops=[[(5, -1.0), (25_000, -2.0)]])
    result = run(processor, stop_prompt(["zz"]), bad)
    assert reasons(result) == ["token_id_out_of_range"]
    assert "25000" in result.dead_letters[0].message


def test_logprobs_after_a_first_event_without_them_are_ignored(registry) -> None:
    processor = RequestProcessor(registry)
    plain = ParsedPrompt(request_id="r", model="bytes", prompt_token_ids=ids("Hi"))
    result = run(processor, plain, tokens(1, "ab"), logprob_tokens(2, "cd"), finish(3))
    assert result.dead_letters == []
    assert result.completions[0].text == "abcd" and result.completions[0].logprobs is None


def test_the_decision_without_logprobs_survives_restore(registry) -> None:
    processor = RequestProcessor(registry)
    plain = ParsedPrompt(request_id="r", model="bytes", prompt_token_ids=ids("Hi"))
    run(processor, plain, tokens(1, "ab"))
    snapshot = processor.snapshot("r")
    assert b"logprobs" not in snapshot and b"stop" not in snapshot  # costs the changelog nothing
    restored = RequestProcessor(registry)
    restored.restore("r", snapshot)
    result = run(restored, logprob_tokens(2, "cd"), finish(3))
    assert result.dead_letters == []
    assert result.completions[0].text == "abcd" and result.completions[0].logprobs is None
