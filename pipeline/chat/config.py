"""Which chat-output parsers each model has: the `--reasoning-parser MODEL=NAME` and
`--tool-parser MODEL=NAME` settings, checked once at start-up.

Names are checked here, against the format tables, so a worker refuses an unknown parser before
it joins a group (exit 2, naming the valid ones); the formats themselves are resolved per model
by the request pipeline, which has the model's tokenizer (`mistral` depends on its vocabulary).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from pipeline.chat.formats import REASONING_FORMATS, TOOL_FORMATS, UnknownParserError, _known


@dataclass(frozen=True)
class ChatParsers:
    """Model name -> parser name, for reasoning and for tool calls. Empty: no parsing at all
    (the default; a request of a model in neither map pays nothing for the feature)."""

    reasoning: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    tools: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        for name in self.reasoning.values():
            _known("reasoning", name, REASONING_FORMATS)
        for name in self.tools.values():
            _known("tool", name, TOOL_FORMATS)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.tools)

    @classmethod
    def from_specs(cls, reasoning: Iterable[str] = (), tools: Iterable[str] = ()) -> ChatParsers:
        """From `MODEL=NAME` specs (the flags' values). Raises `UnknownParserError` for an
        unknown name and `ValueError` for a spec that is not `MODEL=NAME` or names a model
        twice."""
        return cls(
            MappingProxyType(_parse(reasoning, "--reasoning-parser")),
            MappingProxyType(_parse(tools, "--tool-parser")),
        )

    def check_models(self, models: Iterable[str]) -> None:
        """Raises `ValueError` naming a parser's model that is not configured (a typo there
        would silently leave that model's requests unparsed)."""
        known = set(models)
        flags = (("--reasoning-parser", self.reasoning), ("--tool-parser", self.tools))
        for flag, mapping in flags:
            for model in mapping:
                if model not in known:
                    raise ValueError(
                        f"{flag} {model}={mapping[model]}: no tokenizer is configured for model "
                        f"{model!r}; configured: {', '.join(sorted(known)) or 'none'}"
                    )


def _parse(specs: Iterable[str], flag: str) -> Mapping[str, str]:
    parsed: dict[str, str] = {}
    for spec in specs:
        model, sep, name = spec.partition("=")
        if not sep or not model or not name:
            raise ValueError(f"{flag} {spec!r}: expected MODEL=NAME")
        if model in parsed:
            raise ValueError(f"{flag}: model {model!r} is given twice")
        parsed[model] = name
    return parsed


__all__ = ["ChatParsers", "UnknownParserError"]
