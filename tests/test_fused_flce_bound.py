"""benchmarks.fused_flce_bound end to end on the tiny preset (the CPU without a GPU)."""

import math

from benchmarks import fused_flce_bound

NS = (8, 16)
TIMES = ("logits GEMM ms", "dX GEMM ms", "dW GEMM ms", "4-GEMM floor ms", "composition ms", "roofline ms")
RATIOS = ("floor x roofline", "composition x roofline", "floor / composition")


def test_tiny_preset_writes_a_row_per_n(tmp_path):
    argv = ["--shapes", "tiny", "--n", *map(str, NS), "--rep-ms", "1", "--warmup-ms", "1", "--out", str(tmp_path)]
    assert fused_flce_bound.main(argv) == 0

    lines = (tmp_path / "fused_flce_bound.md").read_text().splitlines()
    assert any(line.startswith("20") and f"`{fused_flce_bound.PROG} --shapes tiny" in line for line in lines)
    table = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines if line.startswith("| ")]
    header, rows = table[0], [dict(zip(table[0], cells)) for cells in table[1:]]
    assert tuple(header) == fused_flce_bound.COLUMNS
    assert [int(r["N"]) for r in rows] == list(NS)
    for r in rows:
        values = [float(r[k].split()[0]) for k in TIMES + RATIOS]  # GEMM cells read "ms (x roofline)"
        assert all(math.isfinite(v) and v > 0 for v in values), r
