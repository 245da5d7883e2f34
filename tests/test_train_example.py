"""examples/train_moe_lm.py --tiny runs end to end on CPU and every model learns (the MoE, the
MoE with token rounding, the dense MLP); with --data-parallel over two CPU devices it trains as
on one."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")
pytest.importorskip("matplotlib")  # the loss-curve PNG

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(out, *args, **env_vars):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env_vars)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_moe_lm.py"), "--tiny", *args,
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_train_example_tiny(tmp_path):
    proc = run_example(tmp_path, "--token-rounding", "128")
    assert "val" in proc.stdout and (tmp_path / "train_moe_lm.png").stat().st_size > 0
    results = json.loads((tmp_path / "train_moe_lm.json").read_text())["results"]
    for name in ("moe", "moe_rounded", "dense"):
        curve = [loss for _, loss in results[name]["curve"]]
        # from ln(256) = 5.5 nats (uniform bytes) down well past the unigram entropy of source code
        assert curve[0] > 5.0 and curve[-1] < 3.0, (name, curve)
        assert results[name]["val_bpc"] < 4.5, (name, results[name]["val_bpc"])


def test_train_example_data_parallel(tmp_path):
    """The batch split over two CPU devices (Explicit mesh axis): the same losses as on one device,
    to float32 rounding (the gradients' all-reduce adds in another order)."""
    two_cpus = dict(JAX_PLATFORMS="cpu",
                    XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2")
    results = {}
    for name, args in (("one", ()), ("split", ("--data-parallel",))):
        run_example(tmp_path / name, "--steps", "20", *args, **two_cpus)
        results[name] = json.loads((tmp_path / name / "train_moe_lm.json").read_text())
    assert results["split"]["config"]["data_parallel_devices"] == 2
    for model in ("moe", "dense"):
        one, split = results["one"]["results"][model], results["split"]["results"][model]
        assert [s for s, _ in one["curve"]] == [s for s, _ in split["curve"]]
        for (_, a), (_, b) in zip(one["curve"], split["curve"]):
            assert abs(a - b) < 1e-4, (model, one["curve"], split["curve"])
        assert abs(one["val_bpc"] - split["val_bpc"]) < 1e-4, (model, one["val_bpc"], split["val_bpc"])
        assert split["curve"][-1][1] < split["curve"][0][1] - 1.0, (model, split["curve"])  # it learns
