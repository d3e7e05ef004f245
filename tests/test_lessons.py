"""Every lesson runs to the end in its quick mode: a lesson that breaks fails CI."""
import subprocess
import sys
from pathlib import Path

import pytest

LESSONS = sorted((Path(__file__).resolve().parents[1] / "lessons").glob("[0-9][0-9]_*.py"))


def test_lessons_have_distinct_numbers_in_reading_order():
    numbers = [int(p.name[:2]) for p in LESSONS]
    assert numbers[:2] == [1, 2] and len(set(numbers)) == len(numbers)


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.name for p in LESSONS])
def test_lesson_runs_quick(lesson):
    res = subprocess.run([sys.executable, str(lesson), "--quick"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("\n") > 5  # it narrated
