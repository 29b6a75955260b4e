"""Shared test plumbing: where the real tokenizer files are, and how their absence is handled.

The real tokenizer files live in `../shared/tokenizers/` beside the clone. CI always has them, so
there a missing file is a failure; a developer's clone may not, so there it is a skip with a reason.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from hypothesis import settings

from workers.local import broker

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


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under pytest-xdist, fetch the Kafka jars once, in the controller, before its worker
    processes start: each worker's session starts its own broker, and on a fresh clone they would
    all find no jars at once and run Maven into the same lib/ folder together.

    A fetch that fails is left to each session's broker start to report (a skip locally, a
    failure in CI), as without xdist.
    """
    config = session.config
    if getattr(config.option, "dist", "no") == "no" or hasattr(config, "workerinput"):
        return
    with contextlib.suppress(broker.BrokerError):
        broker.fetch_jars()


@pytest.hookimpl(trylast=True)  # after pytest-xdist's, which adds a test's xdist_group to its id
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the modules with slow tests first (those outside integration/, single long CPU-bound
    tests, before the integration ones), then the other integration modules, then the rest,
    each module's tests in their own order.

    Under pytest-xdist the long tests then start at once instead of being handed out last and
    leaving one worker process busy while the others wait; run serially, only the order of the
    modules changes (a module's tests stay together, so its module-scoped fixtures still start
    once).
    """
    _check_xdist_groups(config, items)
    rank: dict[str, tuple[int, bool]] = {}
    for item in items:
        integration = item.get_closest_marker("integration") is not None
        slow = item.get_closest_marker("slow") is not None
        mine = (0 if slow else 1 if integration else 2, integration)
        module = item.nodeid.split("::", 1)[0]
        rank[module] = min(rank.get(module, mine), mine)
    items.sort(key=lambda item: rank[item.nodeid.split("::", 1)[0]])  # stable: order kept


def _check_xdist_groups(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under `--dist loadgroup`, fail at collection if pytest-xdist could not put a test's
    xdist_group into its id (it cannot on pytest 9.2): the tests sharing a module's cluster would
    otherwise be spread over every process, each starting a cluster of its own."""
    if not getattr(config.option, "loadgroup", False):  # set in xdist worker processes
        return
    lost = [i.nodeid for i in items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if lost:
        raise pytest.UsageError(
            f"pytest-xdist's --dist loadgroup did not group {lost[0]} (and {len(lost) - 1} more):"
            " this pytest/pytest-xdist pair ignores xdist_group; see pyproject.toml"
        )
