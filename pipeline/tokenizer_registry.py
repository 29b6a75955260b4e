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
        ids = token_ids if isinstance(token_ids, list) else list(token_ids)
        # `max` first (C speed): a 500k-id prompt is checked without a Python loop per id.
        if not ids or max(ids) < limit:
            return None
        return next(i for i in ids if i >= limit)


def resolve_tokenizer_file(path: Path) -> tuple[Path, int | None]:
    """A tokenizer.json path, or a model folder holding one (and maybe a config.json).

    Raises TokenizerSpecError for a missing tokenizer file and for a config.json that cannot be
    read or whose `vocab_size` is not a positive integer: checked here, at start-up, because a
    wrong size would otherwise fail the first prompt of that model, and again after every restart.
    """
    if not path.is_dir():
        if not path.is_file():
            raise TokenizerSpecError(f"no tokenizer file at {path}")
        return path, None
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise TokenizerSpecError(f"no tokenizer file at {tokenizer_file}")
    config = path / "config.json"
    if not config.is_file():
        return tokenizer_file, None
    return tokenizer_file, _configured_vocab_size(config)


def _configured_vocab_size(config: Path) -> int | None:
    """`vocab_size` of a model's config.json, if it has one."""
    try:
        settings = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise TokenizerSpecError(f"cannot read model config {config}: {error}") from error
    if not isinstance(settings, dict):
        raise TokenizerSpecError(f"model config {config} is not a JSON object")
    vocab_size = settings.get("vocab_size")
    if vocab_size is None:
        return None
    # bool is an int in Python; `true` is no vocabulary size.
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        raise TokenizerSpecError(
            f"model config {config}: vocab_size must be a positive integer, got {vocab_size!r}"
        )
    return vocab_size


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
        if not sep or not name or not value.isdigit() or int(value) < 1:
            raise TokenizerSpecError(f"expected MODEL=N with N >= 1, got {spec!r}")
        sizes[name] = int(value)
    return sizes
