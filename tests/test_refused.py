"""Every refused configuration (``tests/refused.py``) fails with its error type, at construction or at the
fit's set-up before any training step, with a message naming the argument; docs/faults.md lists them all."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.refused import CASES, Refused, message_of, table

FAULTS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "faults.md"


@pytest.mark.parametrize("case", CASES, ids=[case.code for case in CASES])
def test_refused_with_a_message_naming_the_argument(case: Refused):
    message = message_of(case)  # raises AssertionError if accepted, the error itself if of another type
    assert case.argument in message, message


def test_at_least_forty_refused_configurations_are_listed():
    assert len(CASES) >= 40
    assert len({case.code for case in CASES}) == len(CASES)


def test_the_docs_table_is_the_one_the_cases_print():
    """The table of docs/faults.md (*Refused configurations*); regenerate it with ``python -m tests.refused``
    when a case or a message changes, and paste it over the old one."""
    assert table() in FAULTS_PAGE.read_text()
