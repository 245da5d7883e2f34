"""The layer benchmark runs end to end through bench.py's --ops on a tiny model and writes its rows;
a timing that runs out of device memory is recorded as None, not the end of the run."""

import importlib.util
import json

import jax
import pytest

from jax_moe_permute import bench, bench_layer, bench_memory

PLOTTING = importlib.util.find_spec("matplotlib") is not None  # the [bench] extra


def run(tmp_path, *extra):
    out, png = tmp_path / "rows.json", tmp_path / "rows.png"
    assert bench.main(["--ops", "layer,layer_bwd", "--model", "tiny", "--tokens", "5", "--iterations", "3",
                       "--json", str(out), *extra] + (["--plot", str(png)] if PLOTTING else [])) == 0
    assert not PLOTTING or png.stat().st_size > 0
    return json.loads(out.read_text())


def test_layer_bench_writes_rows(tmp_path):
    rows = run(tmp_path)
    E, K, H, F = bench_layer.MODELS["tiny"]
    assert [r["op"] for r in rows] == ["layer", "layer_bwd"]
    for r in rows:
        assert r["flops"] == 6 * 5 * K * H * F * (2 if r["op"] == "layer_bwd" else 1)
        for impl in ("", "ref_", "dense_"):
            us = r[{"": "us", "ref_": "ref_us", "dense_": "dense_us"}[impl]]
            assert us > 0 and abs(r[f"{impl}TFLOPs"] - r["flops"] / us / 1e6) <= 1e-9 * r[f"{impl}TFLOPs"]
        assert r["speedup"] == pytest.approx(r["ref_us"] / r["us"])
        # 5 tokens x top-2 of 8 experts: the weights of the distinct routed experts, read once.
        assert 2 <= r["routed_experts"] <= E
        expert = 3 * H * F * 2
        assert r["weight_bytes"] == expert * (r["routed_experts"] + (E if r["op"] == "layer_bwd" else 0))
        assert r["weight_bound_us"] == pytest.approx(r["weight_bytes"] / r["copy_TBps"] / 1e6)
        assert set(r["split_us"]) == set(bench_layer.STAGES) and "ref_split_us" not in r  # ref split: opt-in
        assert all(v > 0 for v in r["split_us"].values())
        gemm = r["split_us"]["gemm_in"] + r["split_us"]["gemm_out"]
        assert r["non_gemm_share"] == pytest.approx(1 - gemm / sum(r["split_us"].values()))


def test_reference_split_is_opt_in():
    rows = bench_layer.bench_shape("tiny", 3, ["layer"], copy_tbps=1.0, iterations=2, split=False, ref_split=True)
    assert set(rows[0]["ref_split_us"]) == set(bench_layer.STAGES) and "split_us" not in rows[0]
    assert "non_gemm_share" not in rows[0]
    bench_layer.format_table(rows)


def test_out_of_memory_is_recorded_not_raised(tmp_path, monkeypatch, capsys):
    def out_of_memory(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 14 GiB.")

    monkeypatch.setattr(bench_layer.layer, "reference_moe_mlp", out_of_memory)
    rows = run(tmp_path, "--no-split")
    for r in rows:
        assert r["ref_us"] is None and r["ref_TFLOPs"] is None and r["speedup"] is None
        assert r["us"] > 0 and r["dense_us"] > 0 and "split_us" not in r
    table = bench_layer.format_table(rows).splitlines()
    assert all(" OOM " in line for line in table[2:])
    assert "out of memory" in capsys.readouterr().out


def test_reference_can_be_skipped(monkeypatch):
    monkeypatch.setattr(bench_layer.layer, "reference_moe_mlp", None)  # would fail if called
    rows = bench_layer.bench_shape("tiny", 3, ["layer"], copy_tbps=1.0, iterations=2, split=False,
                                   with_reference=False)
    assert rows[0]["ref_us"] is None and rows[0]["ref_skipped"] and rows[0]["us"] > 0
    assert " skipped " in bench_layer.format_table(rows).splitlines()[2]


def test_other_errors_still_raise(monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("a bug, not a shortage of memory")

    monkeypatch.setattr(bench_layer.layer, "reference_moe_mlp", broken)
    with pytest.raises(ValueError):
        bench_layer.bench_shape("tiny", 3, ["layer"], copy_tbps=1.0, iterations=2, split=False)


def test_layer_ops_run_apart():
    with pytest.raises(SystemExit):
        bench.main(["--ops", "layer,permute", "--model", "mixtral", "--tokens", "1"])


def test_table_and_plot_take_missing_splits(tmp_path):
    base = dict(model="tiny", T=64, E=8, K=2, H=64, F=96, op="layer", flops=1, us=2.0, ref_us=None, dense_us=1.0,
                speedup=None, TFLOPs=0.5, ref_TFLOPs=None, dense_TFLOPs=1.0, weight_bound_us=1.0)
    split = dict.fromkeys(bench_layer.STAGES, 1.0)
    rows = [dict(base, T=1, split_us=None, non_gemm_share=None),  # the split ran out of memory
            dict(base, T=2, split_us=dict(split, gemm_in=None), non_gemm_share=None),  # one stage did
            dict(base, T=3, split_us=split, non_gemm_share=bench_layer.non_gemm_share(split)), dict(base, T=4)]
    assert rows[2]["non_gemm_share"] == pytest.approx(4 / 6)
    lines = bench_layer.format_table(rows).splitlines()[2:]
    assert lines[0].endswith("OOM") and "OOM / " in lines[1] and "66.7%" in lines[2] and "2.00" in lines[3]
    if PLOTTING:
        bench_layer.plot(rows, str(tmp_path / "rows.png"))


def test_memory_bench_writes_rows(tmp_path):
    out = tmp_path / "memory.json"
    assert bench.main(["--ops", "layer_memory", "--model", "tiny", "--tokens", "64", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    E, K, H, F = bench_layer.MODELS["tiny"]
    assert (row["model"], row["T"]) == ("tiny", 64)
    # the dense MLP keeps at least x and both halves of its [T, 2KF] product, in bf16
    assert row["dense_saved_per_token"] >= 2 * H + 2 * 2 * K * F
    assert 0 < row["ours_saved_per_token"] <= row["dense_saved_per_token"] < row["reference_saved_per_token"]
    assert row["saved_vs_dense"] == pytest.approx(row["ours_saved_per_token"] / row["dense_saved_per_token"])
    for impl in ("ours", "reference", "dense"):
        assert row[f"{impl}_temp_bytes"] is None or row[f"{impl}_temp_bytes"] >= 0


def test_memory_bench_records_a_compile_out_of_memory(capsys):
    def out_of_memory(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 64.02GiB")

    f, specs = bench_memory.layer_specs("reference", "tiny", 64)
    assert bench_memory.compiled_grad(out_of_memory, specs) is None
    assert "out of memory" in capsys.readouterr().out
    assert bench_memory.compiled_grad(f, specs) is not None


def test_fused_forward_split_times_the_path_that_runs(monkeypatch):
    # Where moe_mlp's forward runs the fused first GEMM (sm_90), the split times its stages: the row
    # index for "permute", gather + GEMM + activation for "gemm_in". gather_gemm runs its composition
    # on CPU, so the stages are forced here.
    monkeypatch.setattr(bench_layer, "fuses_first_gemm", lambda x, ids, w_in, bwd: not bwd)
    rows = bench_layer.bench_shape("tiny", 5, ["layer", "layer_bwd"], copy_tbps=1.0, iterations=2,
                                   with_reference=False)
    fwd, bwd = rows
    assert set(fwd["split_us"]) == set(bench_layer.STAGES) and fwd["split_us"]["activation"] == 0.0
    assert all(v > 0 for k, v in fwd["split_us"].items() if k != "activation")
    assert fwd["split_fused_first_gemm"] and not bwd["split_fused_first_gemm"]
    assert all(v > 0 for v in bwd["split_us"].values())
    lines = bench_layer.format_table(rows).splitlines()[2:]
    assert "fused first GEMM" in lines[0] and "fused" not in lines[1]
