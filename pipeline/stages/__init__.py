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
from pipeline.stages.base import NO_PLAN, Plan, StageConfig, StageKind, TextStage
from pipeline.stages.chat import Chat
from pipeline.stages.logprobs import Logprobs
from pipeline.stages.stop_strings import StopStrings
from pipeline.tokenizer_registry import ModelTokenizer
from schemas.fast_events import ParsedPrompt

KINDS: tuple[type[StageKind], ...] = (StopStrings, Chat, Logprobs)


class Stages:
    """The stage kinds of one processor, and each request's stages chosen by them."""

    def __init__(self, config: StageConfig) -> None:
        self.kinds = tuple(kind(config) for kind in KINDS)  # type: ignore[call-arg]
        # The kinds that take fields from a prompt (a request's open calls only these).
        self.openers = tuple(
            kind.opened for kind in self.kinds if type(kind).opened is not StageKind.opened
        )
        # Plans of stages that are their kinds (no state of their own): shared by requests.
        self.plans: dict[tuple[TextStage, ...], Plan] = {(): NO_PLAN}

    def opened(self, event: ParsedPrompt, model: ModelTokenizer) -> dict[str, Any]:
        """The state fields a request's stages take from its prompt event."""
        fields: dict[str, Any] = {}
        for opened in self.openers:
            fields.update(opened(event, model))
        return fields

    def of(self, request_id: str, state: ActiveRequest, entry: Work | None = None) -> Plan:
        """The request's stages, in order, as a plan; kept on the state once no kind can
        change its answer (a request's first ids decide its logprobs), so a request without
        options pays one attribute test per chunk."""
        plan = state.stages
        if plan is not None:
            return plan
        made = [(kind, kind.choose(request_id, state, entry)) for kind in self.kinds]
        chosen = tuple(stage for _, stage in made if stage is not None)
        plan = self.plans.get(chosen)
        if plan is None:
            plan = Plan(chosen)
            if all(stage is kind for kind, stage in made if stage is not None):
                self.plans[chosen] = plan
        if all(kind.settled(state, entry) for kind in self.kinds):
            state.stages = plan
        return plan


__all__ = ["KINDS", "NO_PLAN", "Plan", "StageConfig", "Stages", "TextStage"]
