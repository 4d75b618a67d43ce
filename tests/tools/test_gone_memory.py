"""tools/gone_memory.py: the gone table's bytes per entry, against a baseline in
the same run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tools import load_tool

gone_memory = load_tool("gone_memory")
GONE = Path(__file__).resolve().parents[2] / "kvfs" / "evict" / "gone.py"


def test_the_table_is_measured_full_and_against_its_baseline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a baseline that keeps every ghost whole: the tool must see it as such
    whole = tmp_path / "whole.py"
    whole.write_text(
        GONE.read_text().replace("def _narrow(", "def _narrow_unused(", 1)
        + "\n\ndef _narrow(ghost, base=0):\n    return None\n"
    )
    assert (
        gone_memory.main(
            [
                "--most",
                "3000",
                "--clock-from",
                "20,32",
                "--times",
                "1",
                "--baseline-file",
                str(whole),
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert [row["clock_from"] for row in out["rows"]] == ["2**20", "2**32"]
    for row in out["rows"]:
        this, base = row["this"], row["baseline"]
        assert this["kept"] == base["kept"] == 3000  # full: the bound, one table
        assert this["kept_whole"] == 0  # narrow past 2**32 as before it
        assert base["kept_whole"] == 3000
        assert 0 < this["bytes_per_entry"] < base["bytes_per_entry"]
        assert this["put_us"] > 0 and base["pop_us"] > 0
