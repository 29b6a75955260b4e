"""Shared test plumbing: where the real tokenizer files are, and how their absence is handled.

The real tokenizer files live in `../shared/tokenizers/` beside the clone. CI always has them, so
there a missing file is a failure; a developer's clone may not, so there it is a skip with a reason.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DIR = Path(os.environ.get("DETOK_SHARED_DIR", REPO_ROOT.parent / "shared"))
REAL_TOKENIZERS = ("gpt2", "llama-spm", "olmo2-dolma2", "qwen2-from-tiktoken", "bert-base-uncased")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# Hypothesis' per-example deadline (200 ms) is a timing assertion: on a shared 2-core machine a
# property test's example sometimes takes longer for reasons that have nothing to do with the code
# (another process's JIT, GC, a broker starting), and the test then fails on timing alone. Speed is
# measured by bench/ scripts; tests assert behaviour only.
settings.register_profile("detok", deadline=None)
settings.load_profile("detok")


def missing_resource(reason: str) -> None:
    """Fail in CI (where every resource must exist), skip elsewhere."""
    if IN_CI:
        pytest.fail(f"{reason} (CI must have it)")
    pytest.skip(reason)


def real_tokenizer_path(name: str) -> Path:
    path = SHARED_DIR / "tokenizers" / name / "tokenizer.json"
    if not path.is_file():
        missing_resource(f"real tokenizer file not found: {path}")
    return path
