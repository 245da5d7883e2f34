"""What the compiler makes of our hand-written sm90a wgmma kernels (cpp/gemm/gather_gemm.cu,
grouped_wgrad.cu, down_backward.cu), checked where nvcc and CUTLASS's headers are installed, GPU or not: ptxas must
not serialise their wgmma (it does so silently, with an info line, when a branch splits a batch:
2-3x slower), nor spill registers. Both are performance defects that every test of results passes."""

import os
import re
import shutil
import subprocess

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNITS = ["gather_gemm.cu", "grouped_wgrad.cu", "down_backward.cu"]


def cutlass_include():
    try:
        import cutlass_library
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
    return path if os.path.isdir(path) else None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.skipif(cutlass_include() is None, reason="needs CUTLASS's headers (the nvidia-cutlass package)")
@pytest.mark.skipif(not os.path.isdir(os.path.join(ROOT, "cpp", "gemm")), reason="needs the source tree")
@pytest.mark.parametrize("unit", UNITS)
def test_wgmma_not_serialized_and_no_spills(unit, tmp_path):
    cpp = os.path.join(ROOT, "cpp")
    cmd = ["nvcc", "-std=c++17", "-O3", "-DNDEBUG", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
           f"-I{cpp}", f"-I{os.path.join(cpp, 'gemm')}", f"-I{cutlass_include()}", f"-I{jax.ffi.include_dir()}",
           "-Xptxas", "-v", "-c", os.path.join(cpp, "gemm", unit), "-o", str(tmp_path / "unit.o")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    log = out.stdout + out.stderr
    assert "serialized" not in log, [line for line in log.splitlines() if "serialized" in line][:2]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert spills and all(s == ("0", "0") for s in spills), spills
