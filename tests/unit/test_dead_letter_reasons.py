"""Every dead-letter reason has its stage and a real exception class, in the one table."""

from __future__ import annotations

import pytest

from pipeline.dead_letter_reasons import REASONS
from schemas.events import DeadLetterReason


def test_every_reason_has_an_entry() -> None:
    assert set(REASONS) == set(DeadLetterReason)


@pytest.mark.parametrize("reason", list(DeadLetterReason))
def test_each_entry_names_a_stage_and_an_exception_class(reason: DeadLetterReason) -> None:
    info = REASONS[reason]
    assert info.stage
    assert isinstance(info.error_class, type) and issubclass(info.error_class, Exception)
    assert info.error_class_name == info.error_class.__name__
