"""The stage profile runs end to end at a tiny shape (CPU, interpreter): stages, rows, report. No timings checked."""

import json

from benchmarks import profile_stages


def test_profile_stages_reports_every_stage_of_both_paths(tmp_path):
    code = profile_stages.main(
        ["--device", "cpu", "--shape", "tiny", "--n", "64", "--mask", "0.25", "--repeats", "1", "--out", str(tmp_path)]
    )
    assert code == 0
    rows = {r["path"]: r for r in map(json.loads, (tmp_path / "stages.jsonl").read_text().splitlines())}
    assert set(rows) == {"three-matmul", "two-pass"}
    assert rows["three-matmul"]["path_taken"] == ["three-matmul"] and rows["two-pass"]["path_taken"] == ["two-pass"]
    assert {"logits GEMM", "row stats", "token stage", "d(logits)", "grad_hidden GEMM", "grad_weight GEMM"} <= set(
        rows["three-matmul"]["stages_ms"]
    )
    assert {"forward sweep", "token stage", "backward d(logits)", "grad_hidden GEMM", "grad_weight GEMM"} <= set(
        rows["two-pass"]["stages_ms"]
    )
    for row in rows.values():
        assert row["ms_total"] > 0 and row["floor_ms"] > 0
        assert all(ms >= 0 for ms in row["stages_ms"].values())
        assert sum(row["stages_ms"].values()) <= row["ms_total"] * 1.01
        assert (row["shape"], row["n"], row["dtype"], row["mask_fraction"]) == ("tiny", 64, "fp32", 0.25)
    text = (tmp_path / "stages.md").read_text()
    assert "| three-matmul | logits GEMM |" in text and "GEMM floor" in text and "peak MiB" in text
