"""Tables: alignment, percent formatting, the shares and occupancy tables."""

import pytest
from pagedkv.sim import reports


def _result(token_states=0.5):
    rest = (1.0 - token_states) / 4
    return {
        "token_states": token_states,
        "reserved": rest,
        "internal_fragmentation": rest,
        "external_fragmentation": rest,
        "free": rest,
        "mean_resident_requests": 12.5,
        "peak_resident_requests": 20,
        "generated_tokens_per_step": 11.0,
        "preemptions": 3,
        "finished_requests": 100,
        "steps": 900,
    }


def test_format_table_aligns_numbers_right_and_text_left():
    text = reports.format_table(["name", "value"], [["a", 1], ["long name", 12345]], title="T", note="n")
    lines = text.splitlines()
    assert lines[0] == "T" and lines[-1] == "n"
    assert lines[1].startswith("name") and lines[3].endswith("     1") and lines[4].endswith("12,345")
    assert lines[3].startswith("a        ")


def test_format_table_rejects_ragged_rows():
    with pytest.raises(ValueError):
        reports.format_table(["a", "b"], [[1]])


def test_percent():
    assert reports.percent(0.204) == "20.4 %"
    assert reports.percent(1.0, 0) == "100 %"


def test_shares_table_with_published_column():
    text = reports.shares_table(
        {"vLLM": _result(0.9), "Orca (Max)": _result(0.2)}, published_token_states={"vLLM": 0.963}
    )
    assert "96.3 %" in text and "90.0 %" in text and "published token states" in text
    assert text.splitlines()[-1].rstrip().endswith("-")


def test_occupancy_table_reports_waste_as_everything_but_tokens_and_free():
    text = reports.occupancy_table({"paged": _result(0.6)})
    assert "60.0 %" in text and "30.0 %" in text and "12.50" in text
