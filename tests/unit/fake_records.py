"""Consumed Kafka records without a broker: objects with the `confluent_kafka.Message` interface,
so record handling and restore run on generated input exactly as they run on consumed input."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FakeMessage:
    """What `consume()` hands the worker for one record (never an error event)."""

    value_bytes: bytes | None
    key_bytes: bytes | None = None
    header_list: list[tuple[str, bytes | None]] | None = None
    partition_number: int = 0
    offset_number: int = 0
    topic_name: str = "detok.tokens"
    timestamp_ms: int = 1_700_000_000_000

    def value(self) -> bytes | None:
        return self.value_bytes

    def key(self) -> bytes | None:
        return self.key_bytes

    def headers(self) -> list[tuple[str, bytes | None]] | None:
        return self.header_list

    def partition(self) -> int:
        return self.partition_number

    def offset(self) -> int:
        return self.offset_number

    def topic(self) -> str:
        return self.topic_name

    def timestamp(self) -> tuple[int, int]:
        return (1, self.timestamp_ms)  # TIMESTAMP_CREATE_TIME

    def error(self) -> None:
        return None
