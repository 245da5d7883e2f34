"""The layer benchmark runs end to end through bench.py's --ops on a tiny model and writes its rows."""

import importlib.util
import json

import pytest

from jax_moe_permute import bench, bench_layer


def test_layer_bench_writes_rows(tmp_path):
    out, png = tmp_path / "rows.json", tmp_path / "rows.png"
    plotting = importlib.util.find_spec("matplotlib") is not None  # the [bench] extra
    assert bench.main(["--ops", "layer,layer_bwd", "--model", "tiny", "--tokens", "5", "--iterations", "3",
                       "--json", str(out)] + (["--plot", str(png)] if plotting else [])) == 0
    rows = json.loads(out.read_text())
    E, K, H, F = bench_layer.MODELS["tiny"]
    assert [r["op"] for r in rows] == ["layer", "layer_bwd"]
    assert not plotting or png.stat().st_size > 0
    for r in rows:
        assert r["flops"] == 6 * 5 * K * H * F * (2 if r["op"] == "layer_bwd" else 1)
        for impl in ("", "ref_", "dense_"):
            us = r[{"": "us", "ref_": "ref_us", "dense_": "dense_us"}[impl]]
            assert us > 0 and abs(r[f"{impl}TFLOPs"] - r["flops"] / us / 1e6) <= 1e-9 * r[f"{impl}TFLOPs"]
        assert set(r["split_us"]) == set(bench_layer.STAGES) == set(r["ref_split_us"])
        assert all(v > 0 for v in r["split_us"].values())


def test_layer_ops_run_apart():
    with pytest.raises(SystemExit):
        bench.main(["--ops", "layer,permute", "--model", "mixtral", "--tokens", "1"])
