"""The seven topic names of one pipeline deployment.

A module of its own, free of argparse and the admin client, because every room needs the names
(the worker's settings, the commands, the demo, bench) while only `detok topics ensure` needs to
create topics.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Kafka's own topic-name rule: legal characters, at most 249 of them.
TopicName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9._-]{1,249}$")]


class TopicNames(BaseModel):
    """The seven topic names of one pipeline deployment."""

    model_config = ConfigDict(frozen=True)

    input: TopicName = "detok.tokens"
    deltas: TopicName = "detok.deltas"
    completions: TopicName = "detok.completions"
    metrics: TopicName = "detok.metrics"
    dead_letters: TopicName = "detok.dead-letters"
    changelog: TopicName = "detok.state-changelog"
    # Stop signals for engines: requests the worker ended before their finish event.
    control: TopicName = "detok.control"

    @model_validator(mode="after")
    def _names_are_distinct(self) -> TopicNames:
        # Two roles on one topic (say changelog == input) would feed state records to the
        # decoder; refuse such a configuration before anything is created.
        names = list(self.model_dump().values())
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"each topic role needs its own topic; shared: {duplicates}")
        return self

    @classmethod
    def with_prefix(cls, prefix: str) -> TopicNames:
        """One deployment's own set (`PREFIX.tokens`, ...), e.g. a demo run's or a test's."""
        return cls(
            input=f"{prefix}.tokens",
            deltas=f"{prefix}.deltas",
            completions=f"{prefix}.completions",
            metrics=f"{prefix}.metrics",
            dead_letters=f"{prefix}.dead-letters",
            changelog=f"{prefix}.state-changelog",
            control=f"{prefix}.control",
        )

    @property
    def all(self) -> tuple[str, ...]:
        """Every topic, in role order."""
        return tuple(self.model_dump().values())

    @property
    def compacted(self) -> tuple[str, ...]:
        return (self.completions, self.changelog)
