"""Every command and flag the README and the docs/ pages show still works as shown, and every
relative link in them leads somewhere.

The judge is the `detok` parser itself (`workers.cli.build_parser`), as in
tests/unit/test_kubernetes_manifests.py for the manifests' arguments: a `detok ...` line of a
fenced code block is parsed as a user would type it (from the repository root, so the example
files it names exist), and a `detok ...` command written inline in the prose must name a real
subcommand and only flags that subcommand has. Abbreviated flags count as unknown (argparse
would accept `--partition` for `--partitions`, so a renamed flag could hide behind its prefix).
Nothing runs: parsing has no side effects beyond reading whether an input file exists.
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from workers.cli import build_parser

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"`(detok [^`]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A value the reader fills in (`<API key>`, `.../admin.properties`): its command is checked for
# its subcommand and flags only, since a made-up value may not parse (a file that must exist).
PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.")
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")


@dataclass(frozen=True)
class Command:
    page: Path
    line: int
    words: tuple[str, ...]  # after `detok`
    fenced: bool  # from a code block (parsed whole) or written inline in the prose

    @property
    def label(self) -> str:
        return f"{self.page.relative_to(REPO_ROOT)}:{self.line} detok {' '.join(self.words)}"


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def fenced_commands(page: Path) -> list[Command]:
    """The `detok ...` lines of the page's code blocks, continuation lines joined, comments and
    leading `VAR=value` assignments dropped."""
    text = page.read_text()
    found = []
    for block in FENCE.finditer(text):
        first_line = line_of(text, block.start(1))
        logical: list[tuple[int, str]] = []  # (first line number, the line with its continuations)
        pending: tuple[int, str] | None = None
        for number, raw in enumerate(block.group(1).splitlines(), start=first_line):
            start, text_so_far = pending or (number, "")
            if raw.rstrip().endswith("\\"):
                pending = (start, text_so_far + raw.rstrip()[:-1] + " ")
                continue
            logical.append((start, text_so_far + raw))
            pending = None
        for number, line in logical:
            words = shlex.split(line, comments=True)
            while words and ENV_ASSIGNMENT.match(words[0]):
                words = words[1:]
            if words and Path(words[0]).name == "detok":
                found.append(Command(page, number, tuple(words[1:]), fenced=True))
    return found


def inline_commands(page: Path) -> list[Command]:
    """`detok ...` written in the prose's inline code, usage-style brackets dropped."""
    text = page.read_text()
    outside_fences = FENCE.sub(lambda block: "\n" * block.group(0).count("\n"), text)
    found = []
    for match in INLINE.finditer(outside_fences):
        words = match.group(1).replace("[", " ").replace("]", " ").split()[1:]
        found.append(
            Command(page, line_of(outside_fences, match.start()), tuple(words), fenced=False)
        )
    return found


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def strict(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The parser with abbreviations refused, here and in every subcommand."""
    parser.allow_abbrev = False
    for child in subcommands(parser).values():
        strict(child)
    return parser


def flag_problems(words: tuple[str, ...], parser: argparse.ArgumentParser) -> list[str]:
    """What is wrong with the subcommand and flags of `detok <words>`: an unknown subcommand,
    or a flag the subcommand reached does not have (spelled out in full)."""
    if not words or words[0] not in subcommands(parser):
        return [f"no such command: detok {' '.join(words[:1])}"]
    path = ["detok"]
    problems = []
    for word in words:
        children = subcommands(parser)
        if word in children and not word.startswith("-"):
            parser = children[word]
            path.append(word)
            continue
        if word.startswith("-") and len(word) > 1:
            flag = word.split("=", 1)[0].rstrip(",.;:)")
            if flag not in parser._option_string_actions:
                problems.append(f"{' '.join(path)} has no flag {flag}")
    if subcommands(parser):
        problems.append(f"{' '.join(path)} needs a subcommand: {sorted(subcommands(parser))}")
    return problems


def all_commands() -> list[Command]:
    return [c for page in PAGES for c in (*fenced_commands(page), *inline_commands(page))]


def check(command: Command, capsys: pytest.CaptureFixture[str]) -> list[str]:
    parser = strict(build_parser())
    problems = flag_problems(command.words, parser)
    placeholder = any(PLACEHOLDER.search(word) for word in command.words)
    if problems or not command.fenced or placeholder:
        return problems
    try:
        parser.parse_args(list(command.words))
    except SystemExit:  # argparse's usage error: its message is on stderr
        return [capsys.readouterr().err.strip().splitlines()[-1]]
    return []


@pytest.mark.parametrize("command", all_commands(), ids=lambda c: c.label)
def test_every_shown_command_parses(
    command: Command, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO_ROOT)  # the commands are shown as run from a clone's root
    assert check(command, capsys) == []


def test_the_pages_show_the_pipeline() -> None:
    """The extraction finds the README's pipeline, so an empty parametrization cannot pass."""
    shown = {c.words[:2] for c in fenced_commands(REPO_ROOT / "README.md")}
    for words in [("run", "--tokenizer"), ("broker", "start"), ("worker", "--tokenizer")]:
        assert words in shown
    assert any(not c.fenced for c in all_commands())


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("detok worker --no-such-flag 1", "detok worker has no flag --no-such-flag"),
        ("detok topics ensure --partition 4", "detok topics ensure has no flag --partition"),
        ("detok brokers start", "no such command: detok brokers"),
        ("detok broker", "detok broker needs a subcommand"),
        ("detok collect --timeout 5", "the following arguments are required: --output"),
        ("detok replay --input examples/missing.jsonl", "no such file"),
    ],
)
def test_a_wrong_command_is_caught(
    line: str,
    problem: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"Try:\n\n```sh\n{line}  # a comment\n```\n\nand `{line}` inline.\n")
    monkeypatch.chdir(REPO_ROOT)
    (fenced,) = fenced_commands(page)
    (inline,) = inline_commands(page)
    assert problem in " ".join(check(fenced, capsys))
    if "required" not in problem and "no such file" not in problem:
        assert problem in " ".join(check(inline, capsys))


def github_anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#+ (.+)$", text, re.MULTILINE):
        anchor = github_anchor(heading)
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_relative_link_leads_to_a_file_and_heading(page: Path) -> None:
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target}: no such heading")
    assert broken == []


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = REPO_ROOT / "README.md"
    linked = {(readme.parent / t.partition("#")[0]).resolve() for t in links(readme)}
    assert [p.name for p in PAGES[1:] if p.resolve() not in linked] == []
