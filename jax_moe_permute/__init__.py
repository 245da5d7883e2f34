"""Fast Mixture-of-Experts token permute / unpermute for JAX (XLA FFI kernels, CPU and CUDA)."""

from . import parallel, reference
from .ops import PermuteResult, moe_permute, moe_unpermute

__all__ = ["PermuteResult", "moe_permute", "moe_unpermute", "parallel", "reference"]
__version__ = "0.1.0"
