"""Flax NNX MoE layer: router, routed experts on our permute / grouped GEMM / unpermute, optional
shared experts, and expert parallelism under jax.shard_map. Thin over routing.py and layer.py.

Importing this module imports flax; `import jax_moe_permute` alone does not.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from . import _compat, layer, routing
from .routing import RouterAux

_expert_init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1,
                                                 batch_axis=(0,))
_dense_init = nnx.initializers.lecun_normal()


class RouterBias(nnx.Variable):
    """DeepSeek-V3's selection bias (`e_score_correction_bias`): not a Param, so optimisers and
    `nnx.grad(..., wrt=nnx.Param)` leave it alone; `MoE.update_router_bias` moves it."""


class MoE(nnx.Module):
    """A Mixture-of-Experts MLP: y = sum_k w_k * Expert_{id_k}(x) (+ shared experts(x)).

    Computes what Hugging Face's MixtralSparseMoeBlock (softmax, renormalize=True),
    Qwen3MoeSparseMoeBlock (softmax, renormalize=norm_topk_prob) and DeepseekV3MoE (sigmoid,
    router_bias, num_groups/topk_groups, routed_scaling_factor, num_shared_experts) compute from
    the same weights; docs/layer.md maps their tensors onto these variables:

      router      [H, E]        nnx.Param
      w_in        [E, H, 2F]    nnx.Param (columns [gate | up]); [E, H, F] for "gelu" / "relu"
      w_out       [E, F, H]     nnx.Param
      router_bias [E]           RouterBias (sigmoid scoring only): selection only, not trained
      shared_w_in [H, 2SF], shared_w_out [SF, H]   nnx.Param (num_shared_experts S > 0)

    Parameters carry sharding metadata (`nnx.with_partitioning`): expert_axis on the expert
    dimension of w_in / w_out, everything else replicated. With mesh and expert_axis the routed
    experts run expert-parallel through `jax_moe_permute.parallel.moe_ep` under jax.shard_map.

    The router's aux values (`RouterAux`: load_balance_loss, router_z_loss, tokens_per_expert)
    come back either way:
      y, aux = model(x, return_aux=True)                  # aux: a RouterAux of this call
      y, inter = nnx.capture(model, nnx.Intermediate)(x)  # flax >= 0.12.6: sown as nnx.Intermediate
    (inter["load_balance_loss"] is a tuple, one value per call, under the layer's path in a larger
    model). Only a call under nnx.capture sows: flax 0.12.6+ deprecates `Module.sow` outside
    it, so a plain `model(x)` stores nothing on the module and warns nothing.
    `dtype` is the computation dtype (default: x's and the params' promoted dtype);
    `param_dtype` the parameters'. Router math is float32. `token_rounding` (a
    `jax_moe_permute.TokenRounding`, opt-in) rounds each expert's entries to whole GEMM tiles
    (see `route`).
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_size: int,
        num_experts: int,
        top_k: int,
        *,
        rngs: nnx.Rngs,
        activation: str = "swiglu",
        scoring: str = "softmax",
        renormalize: bool = True,
        num_groups: Optional[int] = None,
        topk_groups: Optional[int] = None,
        routed_scaling_factor: float = 1.0,
        token_rounding: Optional[routing.TokenRounding] = None,
        num_shared_experts: int = 0,
        dtype=None,
        param_dtype=jnp.float32,
        mesh: Optional[jax.sharding.Mesh] = None,
        expert_axis: Optional[str] = None,
    ):
        layer.check_module_args("MoE", hidden_size, ffn_size, num_experts, top_k, activation, scoring, num_groups,
                          topk_groups, num_shared_experts, mesh, expert_axis, token_rounding)
        self.hidden_size, self.ffn_size, self.num_experts, self.top_k = hidden_size, ffn_size, num_experts, top_k
        self.activation, self.scoring, self.renormalize = activation, scoring, renormalize
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.routed_scaling_factor = routed_scaling_factor
        self.token_rounding = token_rounding
        self.num_shared_experts = num_shared_experts
        self.dtype, self.param_dtype = dtype, param_dtype
        self.mesh, self.expert_axis = mesh, expert_axis

        H, F, E = hidden_size, ffn_size, num_experts
        width = 2 * F if layer.ACTIVATIONS[activation][1] else F

        def param(init, shape, sharding):
            # Placed on the mesh at creation when there is one; otherwise the metadata is kept
            # for nnx.get_partition_spec (flax shards eagerly only with a mesh to shard on).
            init = nnx.with_partitioning(init, sharding, mesh=mesh, eager_sharding=mesh is not None)
            return nnx.Param(init(rngs.params(), shape, param_dtype))

        self.router = param(_dense_init, (H, E), (None, None))
        self.w_in = param(_expert_init, (E, H, width), (expert_axis, None, None))
        self.w_out = param(_expert_init, (E, F, H), (expert_axis, None, None))
        if scoring == "sigmoid":
            self.router_bias = RouterBias(jnp.zeros((E,), jnp.float32), out_sharding=(None,), mesh=mesh,
                                          eager_sharding=mesh is not None)
        if num_shared_experts:
            SF = num_shared_experts * F
            self.shared_w_in = param(_dense_init, (H, width // F * SF), (None, None))
            self.shared_w_out = param(_dense_init, (SF, H), (None, None))

    def __call__(self, x: jax.Array, *, return_aux: bool = False):
        """x [..., H] -> y [..., H] in the computation dtype; (y, RouterAux) with return_aux."""
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"MoE: x's last dimension must be hidden_size ({self.hidden_size}), got shape {x.shape}")
        lead = x.shape[:-1]
        dtype = self.dtype or jnp.promote_types(x.dtype, self.param_dtype)
        x2 = x.reshape(-1, self.hidden_size).astype(dtype)
        bias = self.router_bias[...] if self.scoring == "sigmoid" else None
        r = routing.route_tokens(x2, self.router[...], self.top_k, scoring=self.scoring,
                                 renormalize=self.renormalize, bias=bias, num_groups=self.num_groups,
                                 topk_groups=self.topk_groups, routed_scaling_factor=self.routed_scaling_factor,
                                 token_rounding=self.token_rounding)
        for name, value in r.aux._asdict().items():
            _compat.nnx_sow(self, nnx.Intermediate, name, value)
        w_in, w_out = self.w_in[...].astype(dtype), self.w_out[...].astype(dtype)
        if self.mesh is not None:
            y = layer.expert_parallel(x2, r.weights, r.ids, w_in, w_out, activation=self.activation,
                                num_experts=self.num_experts, mesh=self.mesh, expert_axis=self.expert_axis)
        else:
            y = layer.moe_mlp(x2, r.weights, r.ids, w_in, w_out, activation=self.activation)
        if self.num_shared_experts:
            y = y + layer.shared_mlp(x2, self.shared_w_in[...].astype(dtype), self.shared_w_out[...].astype(dtype),
                               self.activation)
        y = y.reshape(*lead, self.hidden_size)
        return (y, r.aux) if return_aux else y

    def update_router_bias(self, tokens_per_expert: jax.Array, rate: float = 1e-3) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing step on router_bias (sigmoid scoring only),
        outside the gradient: see `jax_moe_permute.balance_bias`."""
        if self.scoring != "sigmoid":
            raise ValueError("MoE.update_router_bias: the layer has no router_bias (scoring must be 'sigmoid')")
        self.router_bias[...] = routing.balance_bias(self.router_bias[...], tokens_per_expert, rate)


__all__ = ["MoE", "RouterAux", "RouterBias"]
