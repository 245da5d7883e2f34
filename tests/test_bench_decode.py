"""The decode benchmark runs end to end (python -m jax_moe_permute.bench --ops decode) on a tiny
model and writes its rows; a profiler failure or a pure-JAX step out of memory is a None, not
the end of the run."""

import importlib.util
import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from jax_moe_permute import bench, bench_decode

PLOTTING = importlib.util.find_spec("matplotlib") is not None  # the [bench] extra
POSITIVE = ("wall_us", "device_us", "bound_bytes", "bound_us", "jit_bound_us", "copy_TBps", "jit_copy_TBps",
            "wall_over_bound", "device_over_bound", "wall_over_jit_bound", "device_over_jit_bound", "argument_bytes")


def test_decode_bench_writes_rows(tmp_path):
    """In a process of its own: on a GPU its profiler trace leaves CUPTI unusable for the CUPTI
    timing (jax's mosaic profiler) of later tests in the same process."""
    out, png = tmp_path / "rows.json", tmp_path / "rows.png"
    run = subprocess.run([sys.executable, "-m", "jax_moe_permute.bench", "--ops", "decode", "--model", "tiny",
                          "--tokens", "3", "--layers", "2", "--steps", "3", "--warmup", "1", "--iterations", "2",
                          "--json", str(out)] + (["--plot", str(png)] if PLOTTING else []),
                         capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    assert not PLOTTING or png.stat().st_size > 0
    rows = json.loads(out.read_text())
    model = bench_decode.MODELS["tiny"]
    assert [(r["T"], r["impl"]) for r in rows] == [(3, "ours"), (3, "stacked"), (3, "pure_jax")]
    for r in rows:
        assert r["status"] == "ok" and r["layers"] == 2
        for key in POSITIVE:
            assert r[key] > 0, key
        for key in ("temp_bytes", "output_bytes", "extra_bytes", "custom_calls", "command_buffers", "body_thunks"):
            assert r[key] >= 0, key
        assert isinstance(r["loop_in_command_buffer"], bool)
        assert model.top_k <= r["routed_experts_per_layer"] <= min(model.experts, r["T"] * model.top_k)
        want = (r["layers"] * r["routed_experts_per_layer"] * bench_decode.expert_bytes(model)
                + r["layers"] * bench_decode.router_bytes(model))
        assert r["bound_bytes"] == pytest.approx(want)
        assert r["bound_us"] == pytest.approx(r["bound_bytes"] / r["copy_TBps"] / 1e6)
        assert r["jit_bound_us"] == pytest.approx(r["bound_bytes"] / r["jit_copy_TBps"] / 1e6)
        assert r["wall_over_bound"] == pytest.approx(r["wall_us"] / r["bound_us"])
        assert r["device_over_jit_bound"] == pytest.approx(r["device_us"] / r["jit_bound_us"])
    theirs = rows[2]
    assert theirs["speedup_wall"] is None
    for ours in rows[:2]:
        assert ours["speedup_wall"] == pytest.approx(theirs["wall_us"] / ours["wall_us"])
        assert ours["speedup_device"] == pytest.approx(theirs["device_us"] / ours["device_us"])
        assert ours["custom_calls"] > 0  # our permute / unpermute kernels
    assert run.stdout.rstrip().endswith(bench_decode.format_table(rows))  # the table comes last


def test_profiler_failure_and_reference_out_of_memory_are_recorded(monkeypatch, capsys):
    def inconsistent(*args, **kwargs):
        raise RuntimeError("Kernel names are not consistent across iterations")

    def out_of_memory(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 14 GiB.")

    monkeypatch.setattr(bench_decode, "device_us", inconsistent)  # the CPU's timing
    monkeypatch.setattr(bench_decode, "trace_profile", inconsistent)  # the GPU's
    monkeypatch.setattr(bench_decode.layer, "reference_moe_mlp", out_of_memory)
    model = bench_decode.MODELS["tiny_grouped"]  # DeepSeek-V3's routing: sigmoid, bias, expert groups
    params = bench_decode.stacked_weights(model, 1)
    assert params["w_in"].shape == (1, model.experts, model.hidden, 2 * model.ffn) and params["bias"].shape == (1, 16)
    assert len({np.asarray(w).tobytes() for w in params["w_in"][0]}) == model.experts  # every expert its own draw
    ours, stacked, ref = bench_decode.bench_point("tiny_grouped", params, 2, copy_tbps=1.0, jit_tbps=0.5, steps=2,
                                                  warmup=0, iterations=2)
    for r in (ours, stacked):
        assert r["status"] == "ok" and r["wall_us"] > 0 and r["wall_over_bound"] > 0
        assert r["device_us"] is None and r["device_over_bound"] is None and r["speedup_wall"] is None
    assert ref["status"] == "OOM" and ref["wall_us"] is None and ref["temp_bytes"] is None
    assert ours["jit_bound_us"] == pytest.approx(2 * ours["bound_us"])
    out = capsys.readouterr().out
    assert "not consistent" in out and "out of memory" in out
    lines = bench_decode.format_table([ours, ref]).splitlines()[2:]  # the stacked step's row as ours
    assert " OOM " in lines[1] and " OOM " not in lines[0]


def test_reference_can_be_skipped(monkeypatch):
    measured = []
    fake = dict(wall_us=4.0, device_us=3.0, temp_bytes=0, output_bytes=0, alias_bytes=0, argument_bytes=1,
                code_bytes=0, extra_bytes=0, custom_calls=2, command_buffers=0, loop_in_command_buffer=False,
                body_thunks=9, body_command_buffer_calls=0)
    monkeypatch.setattr(bench_decode, "measure", lambda impl, *args: measured.append(impl) or fake)
    monkeypatch.setattr(bench_decode, "routed_experts", lambda model, params, xs: [[2, 4]] * len(xs))
    model = bench_decode.MODELS["tiny"]
    params = dict(router=np.zeros((2, model.hidden, model.experts)))  # only its layer count is read
    rows = bench_decode.bench_point("tiny", params, 1, copy_tbps=1.0, jit_tbps=1.0, with_reference=False)
    assert measured == ["ours", "stacked"] and [r["status"] for r in rows] == ["ok", "ok", "skipped"]
    assert rows[0]["routed_experts_per_layer"] == 3
    assert rows[0]["bound_bytes"] == 6 * bench_decode.expert_bytes(model) + 2 * bench_decode.router_bytes(model)
    assert rows[0]["wall_over_bound"] == pytest.approx(4.0 / rows[0]["bound_us"])
    assert " skipped " in bench_decode.format_table(rows).splitlines()[4]


def test_layers_that_fit_leave_headroom():
    model = bench_decode.MODELS["deepseek"]
    per_layer = bench_decode.layer_bytes(model)
    assert per_layer == 256 * 3 * 7168 * 2048 * 2 + 7168 * 256 * 2 + 256 * 4
    limit = 140 * 2**30
    stats = dict(bytes_limit=limit, bytes_in_use=2**30)
    fit = bench_decode.layers_that_fit(model, stats)
    assert fit * per_layer <= limit - 2**30 - bench_decode.HEADROOM_FRACTION * limit < (fit + 1) * per_layer
    assert bench_decode.layers_that_fit(model, dict(bytes_limit=4 * 2**30, bytes_in_use=0)) == 0
    assert bench_decode.layers_that_fit(model, None) is None


HLO = """HloModule step

%command_buffer (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %fusion.1 = f32[4]{0} fusion(f32[4]{0} %p), kind=kLoop, calls=%fused
}

%body (arg: (s32[], f32[4])) -> (s32[], f32[4]) {
  %arg = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element((s32[], f32[4]{0}) %arg), index=0
  %x = f32[4]{0} get-tuple-element((s32[], f32[4]{0}) %arg), index=1
  %cc = f32[4]{0} custom-call(f32[4]{0} %x), custom_call_target="jax_moe_permute.permute"
  %call = f32[4]{0} call(f32[4]{0} %cc), to_apply=%command_buffer
  %next = s32[] add(s32[] %i, s32[] %i)
  ROOT %t = (s32[], f32[4]{0}) tuple(s32[] %next, f32[4]{0} %call)
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %w = (s32[], f32[4]{0}) while((s32[], f32[4]{0}) %init), condition=%cond, body=%body
  ROOT %out = f32[4]{0} get-tuple-element((s32[], f32[4]{0}) %w), index=1
}
"""


def test_hlo_stats_reads_command_buffers():
    stats = bench_decode.hlo_stats(HLO)
    assert stats == dict(custom_calls=1, command_buffers=1, loop_in_command_buffer=False, body_thunks=3,
                         body_command_buffer_calls=1)
    captured = HLO.replace("%command_buffer (p: f32[4])", "%command_buffer.2 (p: f32[4])").replace(
        "ENTRY %main", "%command_buffer (x: f32[4]) -> f32[4] {\n  %w = (s32[], f32[4]{0}) while(%i), body=%body\n}\n\n"
        "ENTRY %main")
    assert bench_decode.hlo_stats(captured)["loop_in_command_buffer"]


def test_decode_runs_apart():
    with pytest.raises(SystemExit):
        bench.main(["--ops", "decode,permute", "--model", "tiny", "--tokens", "1"])


def test_split_steps_cuts_at_the_host_syncs():
    step = [(0, 5, "a"), (7, 3, "b"), (11, 2, "c")]  # gaps of 2 and 1 ns inside a step
    events = [(t + 1000 * i, d, n) for i in range(3) for t, d, n in step]
    parts = bench_decode.split_steps(events[::-1], 3)
    assert [[e[2] for e in p] for p in parts] == [["a", "b", "c"]] * 3
    assert [p[0][0] for p in parts] == [0, 1000, 2000]
    assert bench_decode.split_steps(events[:-1], 3) is None  # unequal steps
    assert bench_decode.split_steps(events, 1) == [sorted(events)]
    assert bench_decode.split_steps(events[:2], 3) is None
