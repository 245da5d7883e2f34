"""The benchmark runs end to end and writes the documented JSON rows."""

import json

from jax_moe_permute import bench


def test_bench_writes_rows(tmp_path):
    out = tmp_path / "rows.json"
    assert bench.main(["--model", "mixtral", "--tokens", "1,3", "--ops", ",".join(bench.OPS), "--iterations", "3",
                       "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 2 * len(bench.OPS)
    for row in rows:
        assert {"model", "T", "H", "E", "K", "op", "us", "ref_us", "TBps", "copy_TBps"} <= row.keys()
        assert row["us"] > 0 and row["ref_us"] > 0 and row["copy_TBps"] > 0
        if row["op"] not in bench.ROUTED_OPS:
            assert row["bytes"] == bench.op_bytes(row["op"], row["T"], row["H"], row["K"], 2)
        else:  # the rows of routed tokens read, at least T*K rows written
            assert row["bytes"] >= row["T"] * row["H"] * row["K"] * 2
        assert abs(row["TBps"] - row["bytes"] / row["us"] / 1e6) <= 1e-9 * row["TBps"]
