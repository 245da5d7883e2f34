"""Fast Mixture-of-Experts token permute / unpermute for JAX (XLA FFI kernels, CPU and CUDA)."""

from . import reference
from .grouped_gemm import ragged_dot
from .ops import PermuteResult, moe_permute, moe_unpermute

__all__ = ["PermuteResult", "moe_permute", "moe_unpermute", "ragged_dot", "reference"]
__version__ = "0.1.0"
