"""The stage profile runs end to end at a tiny shape (CPU, interpreter): stages, rows, report. No timings checked."""

import json

from benchmarks import profile_stages


def test_profile_stages_reports_every_stage_of_both_paths(tmp_path):
    code = profile_stages.main(
        ["--device", "cpu", "--shape", "tiny", "--n", "64", "--mask", "0.25", "--repeats", "1", "--out", str(tmp_path)]
    )
    assert code == 0
    rows = {r["path"]: r for r in map(json.loads, (tmp_path / "stages.jsonl").read_text().splitlines())}
    assert set(rows) == {"three-matmul", "two-pass", "gemm-floor"}  # each measured in a process of its own
    assert rows["three-matmul"]["path_taken"] == ["three-matmul"] and rows["two-pass"]["path_taken"] == ["two-pass"]
    assert {"logits GEMM", "row stats", "token stage", "d(logits)", "grad_hidden GEMM", "grad_weight GEMM"} <= set(
        rows["three-matmul"]["stages_ms"]
    )
    assert {"forward sweep", "token stage", "backward d(logits)", "grad_hidden GEMM", "grad_weight GEMM"} <= set(
        rows["two-pass"]["stages_ms"]
    )
    for row in rows.values():
        assert row["status"] == "ok" and row["ms_total"] > 0
        assert (row["shape"], row["n"], row["dtype"], row["mask_fraction"]) == ("tiny", 64, "fp32", 0.25)
    for name in ("three-matmul", "two-pass"):
        row = rows[name]
        assert all(ms >= 0 for ms in row["stages_ms"].values())
        assert sum(row["stages_ms"].values()) <= row["ms_total"] * 1.01
    text = (tmp_path / "stages.md").read_text()
    assert "| three-matmul | logits GEMM |" in text and "GEMM floor (three" in text and "peak MiB" in text
    # each product stage with its rate, from its own time: 2 N_valid D V FLOP
    row = rows["three-matmul"]
    ms = row["stages_ms"]["grad_hidden GEMM"]
    rate = f"{2 * row['valid_rows'] * row['d'] * row['v'] / ms / 1e9:.3g}"
    assert f"| three-matmul | grad_hidden GEMM | {ms:.2f} | {ms / row['ms_total']:.0%} | {rate} | — |" in text
    assert row["valid_rows"] == int(64 * 0.75) and row["dh_slices"] == 1  # 25% of 64 masked; CPU: one product


def test_a_part_cut_short_is_reported_and_the_others_still_run(tmp_path):
    argv = ["--device", "cpu", "--shape", "tiny", "--n", "64", "--repeats", "1", "--out", str(tmp_path)]
    code = profile_stages.main([*argv, "--paths", "two-pass,gemm-floor", "--part-timeout-s", "0.5"])
    assert code == 1
    rows = [json.loads(line) for line in (tmp_path / "stages.jsonl").read_text().splitlines()]
    assert [(r["path"], r["status"]) for r in rows] == [
        ("two-pass", "failed: timed out"),
        ("gemm-floor", "failed: timed out"),
    ]
    text = (tmp_path / "stages.md").read_text()
    assert "| two-pass | failed: timed out |" in text and "GEMM floor: failed: timed out." in text
