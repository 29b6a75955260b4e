"""Text stages: what a request's options do to its text (`base.TextStage`), and the one place
a request's stages are chosen (`Stages`).

`KINDS` lists the stage modules in the order a chunk's text goes through them: stop strings
first (they decide what text there is, as vLLM's detokenizer stops before its serving layer
parses), then chat outputs (reasoning and tool calls split from what stop strings release),
logprobs last (their entries are per token, on the text as decoded). Adding a stage is
its module, its snapshot field in `pipeline.request_state._ActiveFields`, and its line here.
"""

from __future__ import annotations

from typing import Any

from pipeline.request_state import ActiveRequest
from pipeline.requests.work import Work
from pipeline.stages.base import StageConfig, StageKind, TextStage
from pipeline.stages.chat import Chat
from pipeline.stages.logprobs import Logprobs
from pipeline.stages.stop_strings import StopStrings
from pipeline.tokenizer_registry import ModelTokenizer
from schemas.fast_events import ParsedPrompt

KINDS: tuple[type[StageKind], ...] = (StopStrings, Chat, Logprobs)

NO_STAGES: tuple[TextStage, ...] = ()


class Stages:
    """The stage kinds of one processor, and each request's stages chosen by them."""

    def __init__(self, config: StageConfig) -> None:
        self.kinds = tuple(kind(config) for kind in KINDS)  # type: ignore[call-arg]

    def opened(self, event: ParsedPrompt, model: ModelTokenizer) -> dict[str, Any]:
        """The state fields a request's stages take from its prompt event."""
        fields: dict[str, Any] = {}
        for kind in self.kinds:
            fields.update(kind.opened(event, model))
        return fields

    def of(
        self, request_id: str, state: ActiveRequest, entry: Work | None = None
    ) -> tuple[TextStage, ...]:
        """The request's stages, in order; kept on the state once no kind can change its
        answer (a request's first ids decide its logprobs), so a request without options
        pays one attribute test per chunk."""
        stages = state.stages
        if stages is not None:
            return stages
        chosen = tuple(
            stage
            for kind in self.kinds
            if (stage := kind.choose(request_id, state, entry)) is not None
        )
        if all(kind.settled(state, entry) for kind in self.kinds):
            state.stages = chosen or NO_STAGES
        return chosen or NO_STAGES


__all__ = ["KINDS", "NO_STAGES", "StageConfig", "Stages", "TextStage"]
