"""`one_line`: every place that shows an exception to a user shows it the same way."""

from __future__ import annotations

import pytest

from fsdp_exp.errors import one_line

HEADER = "Traceback-like header\n\n  the reason,   spaced\n"


@pytest.mark.parametrize("options, expected", [
    ({}, "Traceback-like header"),
    ({"last": True}, "the reason, spaced"),
    ({"whole": True}, "Traceback-like header the reason, spaced"),
    ({"named": True, "limit": 9}, "ValueError: Traceback"),
    ({"named": True, "whole": True}, "ValueError: Traceback-like header the reason, spaced"),
])
def test_an_exception_is_one_line(options: dict, expected: str) -> None:
    assert one_line(ValueError(HEADER), **options) == expected


def test_an_exception_without_text_is_its_type() -> None:
    assert one_line(KeyboardInterrupt()) == "KeyboardInterrupt"
    assert one_line(RuntimeError("  \n "), named=True) == "RuntimeError"
