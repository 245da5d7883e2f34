"""The expert-parallel benchmark (`bench --ops ep`) runs end to end on 8 CPU devices (a fresh
process) and on this process's devices, with rows that follow from their own numbers; the bytes
it charges each dispatch follow docs/parallel.md's table."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jax_moe_permute import bench, bench_ep
from test_parallel import CHILD_ENV, child_env


def check_rows(rows, devices):
    E, K, H, F = bench_ep.MODELS["tiny"]
    assert [r["dispatch"] for r in rows] == list(bench_ep.DISPATCHES)
    for r in rows:
        assert (r["model"], r["D"], r["T"]) == ("tiny", devices, 16)
        for key in ("fwd_us", "fwd_bwd_us", "one_fwd_us", "one_fwd_bwd_us"):
            assert r[key] > 0, key
        assert r["scaling_fwd"] == pytest.approx(r["one_fwd_us"] / r["fwd_us"])
        assert r["scaling_fwd_bwd"] == pytest.approx(r["one_fwd_bwd_us"] / r["fwd_bwd_us"])
        assert r["tokens_per_s_fwd_bwd"] == pytest.approx(devices * 16 / r["fwd_bwd_us"] * 1e6)
        if devices == 1:
            assert r["sent_bytes"] == 0 and r["link_TBps"] is None and r["link_us"] is None
        else:
            assert r["link_TBps"] > 0
            assert r["link_us"] == pytest.approx(r["sent_bytes"] / r["link_TBps"] / 1e6)
    if devices > 1:
        gather, data_parallel = rows[0], rows[2]
        assert gather["sent_bytes"] == gather["sent_bwd_bytes"] == (devices - 1) * 16 * (2 * H * 2 + K * 8)
        assert data_parallel["sent_bwd_bytes"] == 2 * (devices - 1) * 3 * E * H * F * 2 // devices
        for r in rows:
            assert r["link_share_fwd_bwd"] == pytest.approx(
                (r["sent_bytes"] + r["sent_bwd_bytes"]) / r["link_TBps"] / 1e6 / r["fwd_bwd_us"])


@pytest.mark.skipif(bool(os.environ.get(CHILD_ENV)), reason="already inside a multi-device run")
def test_ep_bench_on_8_cpu_devices(tmp_path):
    out = tmp_path / "ep.json"
    cmd = [sys.executable, "-m", "jax_moe_permute.bench", "--ops", "ep", "--model", "tiny", "--tokens", "16",
           "--iterations", "2", "--json", str(out)]
    result = subprocess.run(cmd, cwd=tmp_path, env=child_env(8), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = json.loads(out.read_text())
    check_rows(rows, 8)
    E, K, H, F = bench_ep.MODELS["tiny"]
    assert not rows[1]["ragged"]  # XLA:CPU: the dense all_to_all, K times the gather's row bytes
    assert rows[1]["sent_bytes"] == 7 * 16 * K * 2 * H * 2 + 7 * E * 4


def test_ep_bench_on_this_process(tmp_path):
    out = tmp_path / "ep.json"
    assert bench.main(["--ops", "ep", "--model", "tiny", "--tokens", "16", "--iterations", "2",
                       "--json", str(out)]) == 0
    check_rows(json.loads(out.read_text()), jax.device_count())


def test_ragged_bytes_count_the_entries_leaving_each_device():
    D, E, H = 2, 4, 8  # device 0 holds experts 0, 1; device 1 holds 2, 3
    ids = np.array([[0, 2], [3, 1], [-1, 4],    # device 0's tokens: 2 entries leave (ids 2, 3); -1, 4 are dropped
                    [2, 0], [3, 2], [1, 0]])    # device 1's: 3 leave (0, 0, 1)
    sent = bench_ep.sent_bytes("all_to_all", ids, D, E, H, 16, 2, ragged=True)
    assert sent == (3 * 2 * H * 2 + (D - 1) * E * 4,) * 2  # the busiest device's rows, there and back; mirrored
    assert bench_ep.sent_bytes("all_to_all", ids, 1, E, H, 16, 2, ragged=True) == (0, 0)


def test_data_parallel_bytes_are_the_ids_and_the_weight_gradients():
    D, E, H, F, K = 4, 8, 16, 12, 2
    ids = np.zeros((D * 5, K), np.int32)
    fwd, bwd = bench_ep.sent_bytes("data_parallel", ids, D, E, H, F, 2, ragged=False)
    assert fwd == (D - 1) * 5 * K * 4 + 2 * (D - 1) * E * 4 // D  # ids gathered; mean probabilities all-reduced
    assert bwd == 2 * (D - 1) * 3 * E * H * F * 2 // D  # ring all-reduce of the w_in and w_out gradients
