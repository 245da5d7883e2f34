"""The benchmark runs end to end and writes the documented JSON rows."""

import json

from jax_moe_permute import bench, bench_timing


def test_bench_writes_rows(tmp_path):
    out = tmp_path / "rows.json"
    assert bench.main(["--model", "mixtral", "--tokens", "1,3", "--ops", ",".join(bench.OPS), "--iterations", "3",
                       "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 2 * len(bench.OPS)
    for row in rows:
        assert {"model", "T", "H", "E", "K", "op", "us", "ref_us", "TBps", "ceil_TBps", "copy_TBps"} <= row.keys()
        assert row["us"] > 0 and row["ref_us"] > 0 and row["copy_TBps"] > 0 and row["ceil_TBps"] > 0
        # "% ceil": against the faster of a warm copy of the op's own bytes and the large copy
        assert row["same_bytes_copy_TBps"] == bench_timing.same_bytes_copy_tbps(row["bytes"], 3)  # once a size
        assert row["ceil_TBps"] == max(row["same_bytes_copy_TBps"], row["copy_TBps"])
        if row["op"] not in bench.ROUTED_OPS:
            assert row["bytes"] == bench.op_bytes(row["op"], row["T"], row["H"], row["K"], 2)
        else:  # the rows of routed tokens read, at least T*K rows written
            assert row["bytes"] >= row["T"] * row["H"] * row["K"] * 2
        assert abs(row["TBps"] - row["bytes"] / row["us"] / 1e6) <= 1e-9 * row["TBps"]


def test_same_bytes_copy_moves_the_bytes_asked():
    x = bench_timing.copy_buffer(1000)
    assert x.size == 125 and x.dtype == "uint32"  # read + write: 8 bytes an element
    y = bench_timing.sign_flip_copy()(x)
    assert (y != x).all() and (bench_timing.sign_flip_copy()(y) == x).all()  # every element rewritten
    assert bench_timing.xla_copy_tbps(1000, 3) > 0 and bench_timing.same_bytes_copy_tbps(1000, 3) > 0
    assert bench_timing.op_ceiling_tbps(1000, 1e9, 3) == 1e9  # never below the large copy


def test_bench_modules_import_no_circle():
    import ast
    import pathlib

    package = pathlib.Path(bench.__file__).parent
    timing = ast.parse((package / "bench_timing.py").read_text())
    imported = {a.name for node in ast.walk(timing) if isinstance(node, (ast.Import, ast.ImportFrom))
                for a in node.names} | {node.module for node in ast.walk(timing) if isinstance(node, ast.ImportFrom)}
    assert not {n for n in imported if n and "bench" in n}
    for name in ("bench_gemm", "bench_layer", "bench_decode"):
        tree = ast.parse((package / f"{name}.py").read_text())
        sources = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        names = {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for a in node.names}
        assert "bench" not in names and not any(s and s.endswith(".bench") for s in sources), name
