"""Azure-format trace reading: the real traces, and every kind of bad input named by file and line."""

import gzip
import hashlib

import numpy as np
import pytest
from pagedkv.errors import InvalidArgumentError
from pagedkv.sim import traces

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _write(tmp_path, body, name="trace.csv"):
    path = tmp_path / name
    path.write_text(body)
    return path


def test_reads_rows_relative_to_the_first_arrival(tmp_path):
    path = _write(
        tmp_path,
        HEADER + "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n\n"
        "2023-11-17 00:00:00,5,1\n",
    )
    workload = traces.read_azure_csv(path)
    assert workload.prompt_tokens.tolist() == [374, 396, 5]
    assert workload.output_tokens.tolist() == [44, 109, 1]
    assert workload.arrival_s[0] == 0.0
    assert workload.arrival_s[1] == pytest.approx(4.314579)
    assert workload.arrival_s[2] == pytest.approx(6 * 3600 - (15 * 60 + 46.68059) + 1e-9 * 0, abs=1e-6)
    assert workload.name == "trace.csv"


def test_numeric_timestamps_and_out_of_order_rows(tmp_path):
    path = _write(tmp_path, "\ufeff" + HEADER + "10.5,100,10\n2.0,200,20\n2.0,300,30\n")
    workload = traces.read_azure_csv(path)
    assert workload.prompt_tokens.tolist() == [200, 300, 100]  # stable: ties keep file order
    assert workload.arrival_s.tolist() == [0.0, 0.0, 8.5]


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nope.csv"
    with pytest.raises(traces.TraceNotFoundError, match="nope.csv.*does not exist") as info:
        traces.read_azure_csv(missing)
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, InvalidArgumentError)


@pytest.mark.parametrize(
    "body, line, pattern",
    [
        ("time,prompt,output\n1,2,3\n", 1, "expected the header"),
        (HEADER + "1,2,3\n1,2\n", 3, "expected 3 comma-separated fields"),
        (HEADER + "1,2,3\n\n1,2,3,4\n", 4, "got 4"),
        (HEADER + "1,2.5,3\n", 2, "must be integers"),
        (HEADER + "1,-2,3\n", 2, "negative length"),
        (HEADER + "1,2,-3\n", 2, "negative length"),
        (HEADER + "1,2,0\n", 2, "at least 1 prompt token and 1 generated"),
        (HEADER + "yesterday,2,3\n", 2, "bad TIMESTAMP"),
        (HEADER + "2023-11-16 25:00:00,2,3\n", 2, "bad TIMESTAMP"),
        (HEADER + "nan,2,3\n", 2, "bad TIMESTAMP"),
    ],
)
def test_malformed_rows_name_file_and_line(tmp_path, body, line, pattern):
    path = _write(tmp_path, body)
    with pytest.raises(traces.TraceError, match=pattern) as info:
        traces.read_azure_csv(path)
    assert f"{path}:{line}:" in str(info.value)


@pytest.mark.parametrize("body, pattern", [("", "empty file"), (HEADER, "no requests")])
def test_empty_traces(tmp_path, body, pattern):
    with pytest.raises(traces.TraceError, match=pattern):
        traces.read_azure_csv(_write(tmp_path, body))


def test_env_override_of_the_traces_folder(tmp_path, monkeypatch):
    _write(tmp_path, HEADER + "0,7,8\n", name="azure_llm_2023_code.csv")
    monkeypatch.setenv("PAGEDKV_TRACES", str(tmp_path))
    assert traces.traces_dir() == tmp_path
    assert traces.read_azure_csv(traces.known_trace_path("azure-code")).prompt_tokens.tolist() == [7]
    with pytest.raises(traces.TraceNotFoundError, match="azure_llm_2023_conv.csv"):
        traces.known_trace_path("azure-conv")
    with pytest.raises(InvalidArgumentError, match="unknown trace"):
        traces.known_trace_path("azure-chat")
    monkeypatch.setenv("PAGEDKV_TRACES", str(tmp_path / "absent"))
    with pytest.raises(traces.TraceNotFoundError, match="PAGEDKV_TRACES"):
        traces.traces_dir()


@pytest.mark.parametrize(
    "short_name, requests, span_s", [("azure-conv", 19366, 3502), ("azure-code", 8819, 3436)]
)
def test_real_traces(short_name, requests, span_s):
    workload = traces.read_azure_csv(traces.known_trace_path(short_name))
    assert len(workload.prompt_tokens) == requests
    assert workload.arrival_s[-1] == pytest.approx(span_s, abs=1.0)
    assert np.all(np.diff(workload.arrival_s) >= 0)
    assert workload.prompt_tokens.min() >= 1 and workload.output_tokens.min() >= 1


def test_the_azure_traces_ship_in_the_package_with_their_attribution():
    data = traces.BUNDLED_TRACES_DIR
    for file_name in traces.KNOWN_TRACES.values():
        assert (data / f"{file_name}.gz").stat().st_size > 10_000, file_name
    attribution = (data / "TRACES.md").read_text(encoding="utf-8")
    assert "CC-BY 4.0" in attribution and "Azure Public Dataset, Microsoft" in attribution


@pytest.fixture
def no_shared_traces(monkeypatch):
    """As after `pip install` outside a checkout: no $PAGEDKV_TRACES, no shared/traces folder."""
    monkeypatch.delenv("PAGEDKV_TRACES", raising=False)
    monkeypatch.setattr(traces, "_repo_roots", lambda: [])


def test_named_traces_fall_back_to_the_bundled_copies(no_shared_traces):
    with pytest.raises(traces.TraceNotFoundError):
        traces.traces_dir()
    path = traces.known_trace_path("azure-code")
    assert path == traces.BUNDLED_TRACES_DIR / "azure_llm_2023_code.csv.gz"
    workload = traces.read_azure_csv(path)
    assert workload.name == "azure_llm_2023_code.csv" and len(workload.prompt_tokens) == 8819
    assert traces.is_azure_trace(path)


# SHA-256 of the published files (the shared copies), uncompressed: the bundled copies are those
# files, byte for byte, only gzip-compressed.
PUBLISHED_SHA256 = {
    "azure_llm_2023_code.csv": "54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6",
    "azure_llm_2023_conv.csv": "2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8",
    "mooncake/conversation_trace.jsonl": "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df",
    "mooncake/synthetic_trace.jsonl": "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131",
}


def test_the_bundled_copies_are_the_published_files():
    assert set(PUBLISHED_SHA256) == {*traces.KNOWN_TRACES.values(), *traces.PREFIX_TRACES.values()}
    for file_name, digest in PUBLISHED_SHA256.items():
        with gzip.open(traces.BUNDLED_TRACES_DIR / f"{file_name}.gz", "rb") as handle:
            assert hashlib.sha256(handle.read()).hexdigest() == digest, file_name


def test_the_mooncake_traces_ship_in_the_package_with_their_license(no_shared_traces):
    license_text = (traces.BUNDLED_TRACES_DIR / "mooncake" / "LICENSE-APACHE").read_text(encoding="utf-8")
    assert "Apache License" in license_text and "Version 2.0" in license_text
    attribution = (traces.BUNDLED_TRACES_DIR / "TRACES.md").read_text(encoding="utf-8")
    assert "Mooncake trace release, Moonshot AI" in attribution and "Apache-2.0" in attribution
    for short_name, requests, mean_input in [
        ("mooncake-conversation", 12031, 12035),
        ("mooncake-synthetic", 3993, 15325),
    ]:
        path = traces.known_trace_path(short_name)
        assert path == traces.BUNDLED_TRACES_DIR / f"{traces.PREFIX_TRACES[short_name]}.gz"
        rows = traces.read_mooncake_jsonl(path)
        assert len(rows) == requests
        assert sum(r.input_tokens for r in rows) / requests == pytest.approx(mean_input, abs=1)
