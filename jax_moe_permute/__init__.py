"""Mixture-of-Experts layers for JAX: token permute / unpermute and a grouped GEMM as XLA FFI
kernels (CPU and CUDA), expert parallelism over XLA collectives."""

from . import parallel, reference
from .grouped_gemm import ragged_dot
from .ops import PermuteResult, moe_permute, moe_unpermute

__all__ = ["PermuteResult", "moe_permute", "moe_unpermute", "parallel", "ragged_dot", "reference"]
__version__ = "0.1.0"
