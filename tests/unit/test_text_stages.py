"""The text-stage interface: which stages a request gets, in which order, and when the choice
is kept (a request without options ends up with none, so it pays for no hook)."""

from __future__ import annotations

import pytest

from pipeline.processor import RequestProcessor
from pipeline.request_state import ActiveRequest
from pipeline.stages import KINDS, NO_PLAN, Plan
from pipeline.stages.logprobs import Logprobs
from pipeline.stages.stop_strings import StopStrings
from schemas.fast_events import ParsedPrompt, ParsedTokens
from tests.unit.request_events import bytes_registry, finish, ids, run, tokens


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    return bytes_registry(tmp_path_factory.mktemp("tok"))


def _state(processor: RequestProcessor, request_id: str = "r") -> ActiveRequest:
    state = processor.state(request_id)
    assert type(state) is ActiveRequest
    return state


def test_stop_strings_come_first_and_logprobs_last():
    assert KINDS[0] is StopStrings and KINDS[-1] is Logprobs


def test_a_plan_calls_only_the_hooks_a_stage_has(registry):
    processor = RequestProcessor(registry)
    stop = processor.outcomes.stages.kinds[0]
    plan = Plan((stop,))
    assert plan.stoppers == ((stop.stops, stop.end),) and plan.releases == (stop.release,)
    assert plan.decodes == plan.publishes == plan.completes == plan.checks == ()
    assert plan.stream_before and not plan.per_token


def test_a_request_without_options_keeps_no_stages_once_its_first_ids_are_decoded(registry):
    processor = RequestProcessor(registry)
    run(processor, ParsedPrompt(request_id="r", model="bytes", prompt_token_ids=ids("Hi")))
    assert _state(processor).stages is None  # not chosen before its first ids
    run(processor, tokens(1, "Hello"))
    assert _state(processor).stages is NO_PLAN


def test_stop_strings_and_logprobs_are_chosen_in_order(registry):
    processor = RequestProcessor(registry)
    event = ParsedPrompt(request_id="r", model="bytes", prompt_token_ids=ids("Hi"), stop=["###"])
    run(processor, event)
    text = ids("Hello")
    run(
        processor,
        ParsedTokens(request_id="r", seq=1, token_ids=text, logprobs=[-0.5] * len(text)),
    )
    plan = _state(processor).stages
    assert [type(stage) for stage in plan.stages] == [StopStrings, Logprobs]
    result = run(processor, finish(2))
    assert result.completions[0].text == "Hello"
    assert result.completions[0].logprobs is not None


def test_a_restored_request_chooses_its_stages_again(registry):
    processor = RequestProcessor(registry)
    event = ParsedPrompt(request_id="r", model="bytes", prompt_token_ids=ids("Hi"), stop=["###"])
    run(processor, event, tokens(1, "Hello #"))
    restored = RequestProcessor(registry)
    restored.restore("r", processor.snapshot("r"))
    assert _state(restored).stages is None
    result = run(restored, tokens(2, "## more"))
    assert result.completions[0].text == "Hello "
    assert result.completions[0].stop_reason == "###"


def test_a_restored_request_without_options_keeps_no_stages_at_its_next_chunk(registry):
    processor = RequestProcessor(registry)
    run(processor, ParsedPrompt(request_id="r", model="bytes", prompt_token_ids=ids("Hi")))
    run(processor, tokens(1, "Hello"))
    restored = RequestProcessor(registry)
    restored.restore("r", processor.snapshot("r"))
    run(restored, tokens(2, " there"))
    assert _state(restored).stages is NO_PLAN
