"""Tokenizer specs are checked at start-up: a model folder's config.json either gives a usable
vocabulary size or the command stops with a TokenizerSpecError naming the file (issue 16 #18)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.tokenizer_registry import (
    TokenizerRegistry,
    TokenizerSpecError,
    parse_vocab_size_specs,
)
from tests.unit.small_tokenizers import byte_level


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    byte_level().save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_config_vocab_size_gives_the_model_vocabulary(model_dir: Path) -> None:
    (model_dir / "config.json").write_text('{"vocab_size": 300}')
    entry = TokenizerRegistry.from_specs([f"bytes={model_dir}"]).get("bytes")
    assert entry.model_vocab_size == 300


@pytest.mark.parametrize(
    ("config", "complaint"),
    [
        ('{"vocab_size": 30', "cannot read model config"),
        ("[1, 2]", "not a JSON object"),
        ('{"vocab_size": "151936"}', "vocab_size must be a positive integer, got '151936'"),
        ('{"vocab_size": 0}', "vocab_size must be a positive integer"),
        ('{"vocab_size": true}', "vocab_size must be a positive integer"),
        ('{"vocab_size": 1.5}', "vocab_size must be a positive integer"),
    ],
)
def test_a_broken_config_is_a_spec_error_at_start_up(
    model_dir: Path, config: str, complaint: str
) -> None:
    (model_dir / "config.json").write_text(config)
    with pytest.raises(TokenizerSpecError, match="config.json") as error:
        TokenizerRegistry.from_specs([f"bytes={model_dir}"])
    assert complaint in str(error.value)


def test_a_config_without_vocab_size_leaves_it_unknown(model_dir: Path) -> None:
    (model_dir / "config.json").write_text('{"model_type": "gpt2"}')
    assert (
        TokenizerRegistry.from_specs([f"bytes={model_dir}"]).get("bytes").model_vocab_size is None
    )


def test_a_folder_without_tokenizer_json_is_a_spec_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerSpecError, match="no tokenizer file"):
        TokenizerRegistry.from_specs([f"bytes={tmp_path}"])


@pytest.mark.parametrize("spec", ["qwen2=0", "qwen2=-5", "qwen2=many", "=5", "qwen2"])
def test_model_vocab_size_specs_need_a_positive_size(spec: str) -> None:
    with pytest.raises(TokenizerSpecError, match="MODEL=N"):
        parse_vocab_size_specs([spec])
