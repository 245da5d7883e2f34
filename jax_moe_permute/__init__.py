"""Mixture-of-Experts layers for JAX: token permute / unpermute and a grouped GEMM as XLA FFI
kernels (CPU and CUDA), routing and the expert MLP, expert parallelism over XLA collectives.

The Flax modules live in the submodules `jax_moe_permute.nnx` and `jax_moe_permute.linen`
(imported on demand: flax stays optional)."""

from . import export, parallel, reference
from .grouped_gemm import ragged_dot
from .layer import moe_mlp
from .ops import PermuteResult, moe_permute, moe_unpermute
from .routing import RouterAux, Routing, balance_bias, route, route_tokens
from .token_rounding import TokenRounding

__all__ = ["PermuteResult", "RouterAux", "Routing", "balance_bias", "export", "moe_mlp", "moe_permute",
           "moe_unpermute", "parallel", "ragged_dot", "reference", "route", "route_tokens", "TokenRounding"]
__version__ = "0.1.0"
