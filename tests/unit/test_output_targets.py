"""Outputs that are not regular files (issue 32 item 11): `detok run --output` and `detok collect
--output` wrote a temporary file and renamed it over the output, so a FIFO or a device node became
a regular file (run as root, `--output /dev/null` replaced the real `/dev/null`). They are written
in place now; a regular file is still replaced whole, through a symbolic link."""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from schemas.events import Completion
from tests.unit.small_tokenizers import byte_level
from tests.unit.test_run_command import detok_run, generation, read_jsonl
from workers.formats.parquet import read_completions
from workers.io.replay import write_completions

# A bound on the wait for the reader of a FIFO, never a timing under test.
READER_BOUND_S = 60.0


@pytest.fixture
def tokenizer_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokenizer.json"
    byte_level().save(str(path))
    return path


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "in.jsonl"
    lines = [generation("a", "Q:", " one"), generation("b", "Q:", " two"), "not json"]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


class FifoReader:
    """A FIFO in a temporary directory and a thread reading it to its end."""

    def __init__(self, path: Path) -> None:
        os.mkfifo(path)
        self.path = path
        self.data = b""
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with self.path.open("rb") as handle:
            self.data = handle.read()

    def received(self) -> bytes:
        self.thread.join(READER_BOUND_S)
        assert not self.thread.is_alive(), "the FIFO's writer never closed it"
        return self.data

    def release(self) -> None:
        """Let a reader still waiting for a writer (the test failed first) see an end."""
        if self.thread.is_alive():
            with contextlib.suppress(OSError):
                os.close(os.open(self.path, os.O_WRONLY | os.O_NONBLOCK))


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[FifoReader]:
    reader = FifoReader(tmp_path / "out.fifo")
    yield reader
    reader.release()


def test_run_writes_jsonl_into_a_fifo_and_leaves_it_a_fifo(
    tmp_path: Path, tokenizer_file: Path, source: Path, fifo: FifoReader
) -> None:
    dead = tmp_path / "dead.jsonl"
    code = detok_run(f"bytes={tokenizer_file}", source, fifo.path, "--dead-letter", str(dead))
    assert code == 0
    lines = fifo.received().decode().splitlines()
    assert [line.count('"request_id"') for line in lines] == [1, 1]
    assert '" one"' in lines[0] and '" two"' in lines[1]
    assert stat.S_ISFIFO(fifo.path.lstat().st_mode)
    assert [letter["line"] for letter in read_jsonl(dead)] == [3]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_run_writes_parquet_into_a_fifo(
    tmp_path: Path, tokenizer_file: Path, source: Path, fifo: FifoReader
) -> None:
    """pyarrow's own file seeks, which a FIFO cannot: the writer opens the output itself."""
    code = detok_run(f"bytes={tokenizer_file}", source, fifo.path, "--output-format", "parquet",
                     "--dead-letter", str(tmp_path / "dead.jsonl"))  # fmt: skip
    assert code == 0
    received = tmp_path / "received.parquet"
    received.write_bytes(fifo.received())
    assert [(c.request_id, c.text) for c in read_completions(received)] == [
        ("a", " one"),
        ("b", " two"),
    ]
    assert stat.S_ISFIFO(fifo.path.lstat().st_mode)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_collect_writes_into_a_fifo(tmp_path: Path, fifo: FifoReader, fmt: str) -> None:
    """`detok collect` writes through the same `write_completions`."""
    completions = {
        name: Completion(request_id=name, model="m", text=name * 2, status="ok",
                         prompt_tokens=1, generated_tokens=2)
        for name in ("x", "y")
    }  # fmt: skip
    assert write_completions(fifo.path, completions, fmt) == []
    data = fifo.received()
    if fmt == "parquet":
        received = tmp_path / "received.parquet"
        received.write_bytes(data)
        assert [c.text for c in read_completions(received)] == ["xx", "yy"]
    else:
        assert [line.count('"request_id"') for line in data.decode().splitlines()] == [1, 1]
    assert stat.S_ISFIFO(fifo.path.lstat().st_mode)


def test_run_into_a_character_device_of_its_own_leaves_the_device(
    tmp_path: Path, tokenizer_file: Path, source: Path
) -> None:
    """A null device made in the temporary directory (needs CAP_MKNOD): what the old code did to
    it, it would have done to `/dev/null`."""
    device = tmp_path / "null"
    try:
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD (root)")
    code = detok_run(f"bytes={tokenizer_file}", source, device,
                     "--dead-letter", str(tmp_path / "dead.jsonl"))  # fmt: skip
    assert code == 0
    status = device.lstat()
    assert stat.S_ISCHR(status.st_mode) and status.st_rdev == os.makedev(1, 3)


@pytest.mark.parametrize("dead_letters", ["file", "/dev/null"])
def test_run_into_dev_null_leaves_dev_null_a_character_device(
    tmp_path: Path, tokenizer_file: Path, source: Path, dead_letters: str
) -> None:
    """Both outputs may be /dev/null (one character device twice truncates or mixes nothing)."""
    before = os.lstat("/dev/null")
    assert stat.S_ISCHR(before.st_mode)
    dead = str(tmp_path / "dead.jsonl") if dead_letters == "file" else dead_letters
    code = detok_run(f"bytes={tokenizer_file}", source, "/dev/null", "--dead-letter", dead)
    assert code == 0
    after = os.lstat("/dev/null")
    assert stat.S_ISCHR(after.st_mode)
    assert (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)


def test_a_symbolic_link_to_a_regular_file_keeps_the_link_and_replaces_the_file(
    tmp_path: Path, tokenizer_file: Path, source: Path
) -> None:
    """A rename beside the link replaced the link with a regular file (and, for `/dev/stdout`
    redirected to a file, wrote into `/dev`); the file it names is replaced whole instead."""
    (tmp_path / "results").mkdir()
    target = tmp_path / "results" / "out.jsonl"
    target.write_text("old\n", encoding="utf-8")
    link = tmp_path / "out.jsonl"
    link.symlink_to(target)
    code = detok_run(f"bytes={tokenizer_file}", source, link,
                     "--dead-letter", str(tmp_path / "dead.jsonl"))  # fmt: skip
    assert code == 0
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert [c["request_id"] for c in read_jsonl(target)] == ["a", "b"]
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["out.jsonl"]


def test_a_special_output_without_a_dead_letter_file_is_a_usage_error(
    tmp_path: Path, tokenizer_file: Path, source: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default dead-letter file sits beside the output: beside /dev/null that is /dev
    (written into as root, refused otherwise); the run says to name one instead. Shown on a null
    device of the test's own (CAP_MKNOD), whose directory can be checked, and on /dev/null."""
    device = tmp_path / "null"
    try:
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD (root)")
    for output in (device, Path("/dev/null")):
        assert detok_run(f"bytes={tokenizer_file}", source, output) == 2
        assert "--dead-letter" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "null", "tokenizer.json"]
    assert stat.S_ISCHR(device.lstat().st_mode)
    assert not Path("/dev/null.dead-letters.jsonl").exists()
