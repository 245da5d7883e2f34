"""Fast Mixture-of-Experts token permute / unpermute for JAX (XLA FFI kernels, CPU and CUDA).

The Flax modules live in the submodules `jax_moe_permute.nnx` and `jax_moe_permute.linen`
(imported on demand: flax stays optional)."""

from . import reference
from .layer import moe_mlp
from .ops import PermuteResult, moe_permute, moe_unpermute
from .routing import RouterAux, Routing, balance_bias, route

__all__ = ["PermuteResult", "RouterAux", "Routing", "balance_bias", "moe_mlp", "moe_permute", "moe_unpermute",
           "reference", "route"]
__version__ = "0.1.0"
