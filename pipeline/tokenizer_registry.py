"""Model name -> loaded tokenizer, from local files only.

Workers decode for many models at once; events name the model, and the registry is the one place
that turns that name into a `tokenizers.Tokenizer`. Nothing is ever fetched from a hub at run time:
a worker that silently downloads is a worker whose behaviour depends on the network.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer


class UnknownModelError(LookupError):
    """An event named a model this worker has no tokenizer for."""

    def __init__(self, model: str, known: Iterable[str]) -> None:
        self.model = model
        names = ", ".join(sorted(known)) or "none"
        super().__init__(f"unknown model {model!r}; this worker has tokenizers for: {names}")


class TokenizerSpecError(ValueError):
    """A `MODEL=PATH` spec is malformed or names no readable tokenizer."""


@dataclass(frozen=True)
class ModelTokenizer:
    """A loaded tokenizer and what we know of its model's vocabulary.

    `model_vocab_size` is the embedding size (e.g. Qwen2's 151,936 against a 151,646-id
    tokenizer). Prompt ids below it are legal even when the tokenizer cannot map them; ids at or
    above it cannot come from the model and are rejected as out of range. None means unknown: then
    only the u32 range is enforced.
    """

    name: str
    tokenizer: Tokenizer
    path: Path
    model_vocab_size: int | None = None

    @property
    def tokenizer_vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def first_out_of_range(self, token_ids: Iterable[int]) -> int | None:
        """The first id the model itself could not have produced, if any."""
        if self.model_vocab_size is None:
            return None
        limit = max(self.model_vocab_size, self.tokenizer_vocab_size)
        return next((i for i in token_ids if i >= limit), None)


def resolve_tokenizer_file(path: Path) -> tuple[Path, int | None]:
    """A tokenizer.json path, or a model folder holding one (and maybe a config.json)."""
    if path.is_dir():
        tokenizer_file = path / "tokenizer.json"
        config = path / "config.json"
        vocab_size = None
        if config.is_file():
            vocab_size = json.loads(config.read_text(encoding="utf-8")).get("vocab_size")
        path = tokenizer_file
    else:
        vocab_size = None
    if not path.is_file():
        raise TokenizerSpecError(f"no tokenizer file at {path}")
    return path, vocab_size


class TokenizerRegistry:
    """The models a worker serves. Loading happens once, at registration."""

    def __init__(self) -> None:
        self._models: dict[str, ModelTokenizer] = {}

    def register(
        self, name: str, path: str | Path, *, model_vocab_size: int | None = None
    ) -> ModelTokenizer:
        tokenizer_file, configured_vocab = resolve_tokenizer_file(Path(path))
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # tokenizers raises plain Exception on a bad file
            raise TokenizerSpecError(f"cannot load tokenizer {tokenizer_file}: {error}") from error
        entry = ModelTokenizer(
            name=name,
            tokenizer=tokenizer,
            path=tokenizer_file,
            model_vocab_size=model_vocab_size or configured_vocab,
        )
        self._models[name] = entry
        return entry

    def get(self, name: str) -> ModelTokenizer:
        try:
            return self._models[name]
        except KeyError:
            raise UnknownModelError(name, self._models) from None

    def __contains__(self, name: object) -> bool:
        return name in self._models

    @property
    def names(self) -> list[str]:
        return sorted(self._models)

    @classmethod
    def from_specs(
        cls, specs: Iterable[str], model_vocab_sizes: Mapping[str, int] | None = None
    ) -> TokenizerRegistry:
        """Build from CLI specs `MODEL=PATH` (PATH: a tokenizer.json or a model folder)."""
        registry = cls()
        vocab_sizes = dict(model_vocab_sizes or {})
        for spec in specs:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise TokenizerSpecError(f"expected MODEL=PATH, got {spec!r}")
            registry.register(name, path, model_vocab_size=vocab_sizes.pop(name, None))
        if vocab_sizes:
            raise TokenizerSpecError(
                f"model vocab size given for unknown models: {sorted(vocab_sizes)}"
            )
        return registry


def parse_vocab_size_specs(specs: Iterable[str]) -> dict[str, int]:
    """CLI specs `MODEL=N` -> {model: N}."""
    sizes = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep or not name or not value.isdigit():
            raise TokenizerSpecError(f"expected MODEL=N, got {spec!r}")
        sizes[name] = int(value)
    return sizes
