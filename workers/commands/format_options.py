"""`--input-format` / `--output-format`, for the commands that read or write files."""

from __future__ import annotations

import argparse


def add_format_options(
    parser: argparse.ArgumentParser,
    *,
    input_formats: tuple[str, ...] = (),
    output_formats: tuple[str, ...] = (),
) -> None:
    """`--input-format` / `--output-format`, for the commands that read or write files."""
    if input_formats:
        parser.add_argument(
            "--input-format",
            choices=input_formats,
            help="default: from the extension (.parquet, else jsonl)",
        )
    if output_formats:
        parser.add_argument(
            "--output-format",
            choices=output_formats,
            help="default: from the extension (.parquet, else jsonl); openai-completion and "
            "openai-batch write OpenAI's Completion objects and Batch output lines",
        )
