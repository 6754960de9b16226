"""Every number the prose quotes (three or more significant digits) is printed by a cell of its notebook or read from
a results file that notebook loads (tools/prose_numbers.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import prose_numbers  # noqa: E402


@pytest.mark.parametrize("notebook", prose_numbers.all_notebooks(), ids=lambda p: p.name)
def test_prose_numbers_are_printed(notebook):
    assert prose_numbers.missing(notebook) == []


def test_the_check_rounds_as_the_prose_quotes():
    shown = prose_numbers.printed_numbers("tok/s 21,512.3, ratio 0.61483, 1.8x")
    assert prose_numbers.shows(shown, "21,500")  # rounded to hundreds
    assert prose_numbers.shows(shown, "21,512")
    assert prose_numbers.shows(shown, "61.5")  # a fraction quoted in percent
    assert prose_numbers.shows(shown, "0.615")
    assert not prose_numbers.shows(shown, "21,600")
    assert not prose_numbers.shows(shown, "0.616")
    assert prose_numbers.significant("1,000") == 1 and prose_numbers.significant("0.0715") == 3
    found = [m.group(1) + (m.group(2) or "") for m in prose_numbers.NUMBER.finditer("21,500-22,400 at 7.31/2.15")]
    assert found == ["21,500", "22,400", "7.31", "2.15"]
    assert not prose_numbers.NUMBER.findall("commit 347f42a, SmolLM2-135M, Qwen3-0.6B, h200")
