"""Flax Linen MoE layer: the same arguments, variables and math as `jax_moe_permute.nnx.MoE`.

Importing this module imports flax; `import jax_moe_permute` alone does not.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from . import layer, routing

_expert_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1,
                                                batch_axis=(0,))
_dense_init = nn.initializers.lecun_normal()

ROUTER_STATE = "router_state"  # collection of the non-trainable router_bias


class MoE(nn.Module):
    """A Mixture-of-Experts MLP: y = sum_k w_k * Expert_{id_k}(x) (+ shared experts(x)).

    Variables (collection "params" unless noted), boxed with `nn.with_partitioning` (expert_axis
    on the expert dimension of w_in / w_out):

      router      [H, E]
      w_in        [E, H, 2F] (columns [gate | up]); [E, H, F] for "gelu" / "relu"
      w_out       [E, F, H]
      router_bias [E] in collection "router_state" (sigmoid scoring only): selection only, not
                  trained; move it with `jax_moe_permute.balance_bias` between steps
      shared_w_in [H, 2SF], shared_w_out [SF, H] (num_shared_experts S > 0)

    Sows load_balance_loss, router_z_loss and tokens_per_expert into "intermediates". See
    `jax_moe_permute.nnx.MoE` for the arguments; docs/layer.md for the Hugging Face mapping.
    """

    hidden_size: int
    ffn_size: int
    num_experts: int
    top_k: int
    activation: str = "swiglu"
    scoring: str = "softmax"
    renormalize: bool = True
    num_groups: Optional[int] = None
    topk_groups: Optional[int] = None
    routed_scaling_factor: float = 1.0
    token_rounding: Optional[routing.TokenRounding] = None
    num_shared_experts: int = 0
    dtype: Any = None
    param_dtype: Any = jnp.float32
    mesh: Optional[jax.sharding.Mesh] = None
    expert_axis: Optional[str] = None

    def __post_init__(self):
        layer.check_module_args("MoE", self.hidden_size, self.ffn_size, self.num_experts, self.top_k, self.activation,
                                self.scoring, self.num_groups, self.topk_groups, self.num_shared_experts, self.mesh,
                                self.expert_axis, self.token_rounding)
        super().__post_init__()

    def _param(self, name, init, shape, names):
        return self.param(name, nn.with_partitioning(init, names, self.mesh), shape, self.param_dtype)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., H] -> [..., H] in the computation dtype."""
        H, F, E, axis = self.hidden_size, self.ffn_size, self.num_experts, self.expert_axis
        if x.shape[-1] != H:
            raise ValueError(f"MoE: x's last dimension must be hidden_size ({H}), got shape {x.shape}")
        width = 2 * F if layer.ACTIVATIONS[self.activation][1] else F
        router = self._param("router", _dense_init, (H, E), (None, None))
        w_in = self._param("w_in", _expert_init, (E, H, width), (axis, None, None))
        w_out = self._param("w_out", _expert_init, (E, F, H), (axis, None, None))
        bias = None
        if self.scoring == "sigmoid":
            bias = self.variable(ROUTER_STATE, "router_bias", jnp.zeros, (E,), jnp.float32).value

        lead = x.shape[:-1]
        dtype = self.dtype or jnp.promote_types(x.dtype, self.param_dtype)
        x2 = x.reshape(-1, H).astype(dtype)
        r = routing.route_tokens(x2, router, self.top_k, scoring=self.scoring,
                                 renormalize=self.renormalize, bias=bias, num_groups=self.num_groups,
                                 topk_groups=self.topk_groups, routed_scaling_factor=self.routed_scaling_factor,
                                 token_rounding=self.token_rounding)
        for name, value in r.aux._asdict().items():
            self.sow("intermediates", name, value)
        w_in, w_out = w_in.astype(dtype), w_out.astype(dtype)
        if self.mesh is not None:
            y = layer.expert_parallel(x2, r.weights, r.ids, w_in, w_out, activation=self.activation,
                                      num_experts=E, mesh=self.mesh, expert_axis=axis)
        else:
            y = layer.moe_mlp(x2, r.weights, r.ids, w_in, w_out, activation=self.activation)
        if self.num_shared_experts:
            SF = self.num_shared_experts * F
            shared_in = self._param("shared_w_in", _dense_init, (H, width // F * SF), (None, None))
            shared_out = self._param("shared_w_out", _dense_init, (SF, H), (None, None))
            y = y + layer.shared_mlp(x2, shared_in.astype(dtype), shared_out.astype(dtype), self.activation)
        return y.reshape(*lead, H)


__all__ = ["MoE", "ROUTER_STATE"]
