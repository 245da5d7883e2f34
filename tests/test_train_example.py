"""examples/train_moe_lm.py --tiny runs end to end on CPU and every model learns (the MoE, the
MoE with token rounding, the dense MLP)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")
pytest.importorskip("matplotlib")  # the loss-curve PNG

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_example_tiny(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_moe_lm.py"), "--tiny",
                           "--token-rounding", "128", "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "val" in proc.stdout and (tmp_path / "train_moe_lm.png").stat().st_size > 0
    results = json.loads((tmp_path / "train_moe_lm.json").read_text())["results"]
    for name in ("moe", "moe_rounded", "dense"):
        curve = [loss for _, loss in results[name]["curve"]]
        # from ln(256) = 5.5 nats (uniform bytes) down well past the unigram entropy of source code
        assert curve[0] > 5.0 and curve[-1] < 3.0, (name, curve)
        assert results[name]["val_bpc"] < 4.5, (name, results[name]["val_bpc"])
