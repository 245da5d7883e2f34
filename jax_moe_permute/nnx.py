"""Flax NNX MoE layer: router, routed experts on our permute / grouped GEMM / unpermute, optional
shared experts, and expert parallelism under jax.shard_map. Thin over routing.py and layer.py.

Importing this module imports flax; `import jax_moe_permute` alone does not.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from . import layer, routing
from .routing import RouterAux

_expert_init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1,
                                                 batch_axis=(0,))
_dense_init = nnx.initializers.lecun_normal()


class RouterBias(nnx.Variable):
    """DeepSeek-V3's selection bias (`e_score_correction_bias`): not a Param, so optimisers and
    `nnx.grad(..., wrt=nnx.Param)` leave it alone; `MoE.update_router_bias` moves it."""


def check_module_args(where, hidden_size, ffn_size, num_experts, top_k, activation, scoring, num_groups,
                      topk_groups, num_shared_experts, mesh, expert_axis) -> None:
    """Construction-time checks shared by the NNX and Linen modules."""
    for name, value in (("hidden_size", hidden_size), ("ffn_size", ffn_size), ("num_experts", num_experts),
                        ("top_k", top_k)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {name} must be an int >= 1, got {value!r}")
    if top_k > num_experts:
        raise ValueError(f"{where}: top_k ({top_k}) must be <= num_experts ({num_experts})")
    layer.check_activation(activation, where)
    routing.check_routing_args(num_experts, top_k, scoring, num_groups, topk_groups)
    if not isinstance(num_shared_experts, int) or num_shared_experts < 0:
        raise ValueError(f"{where}: num_shared_experts must be an int >= 0, got {num_shared_experts!r}")
    if (mesh is None) != (expert_axis is None):
        raise ValueError(f"{where}: mesh and expert_axis go together (expert parallelism needs both)")
    if mesh is not None:
        if expert_axis not in mesh.shape:
            raise ValueError(f"{where}: expert_axis {expert_axis!r} is not an axis of mesh {dict(mesh.shape)}")
        if dict(zip(mesh.axis_names, mesh.axis_types))[expert_axis] == jax.sharding.AxisType.Explicit:
            # shard_map would not reshard the tokens and weights onto an Explicit axis
            raise ValueError(f"{where}: expert_axis {expert_axis!r} must be an Auto mesh axis, e.g. "
                             "jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))")
        if num_experts % mesh.shape[expert_axis]:
            raise ValueError(f"{where}: num_experts ({num_experts}) must be divisible by the size of expert_axis "
                             f"{expert_axis!r} ({mesh.shape[expert_axis]})")


def expert_parallel(x, weights, ids, w_in, w_out, *, activation, num_experts, mesh, expert_axis):
    """The routed experts with tokens and experts both split over `expert_axis`: each device
    runs `jax_moe_permute.parallel.moe_ep` on its token shard with its w_in/w_out shard.
    x [T, H], weights/ids [T, K] (global), w_in [E, H, .], w_out [E, F, H] -> [T, H]."""
    from jax.sharding import PartitionSpec as P

    from . import parallel

    T = x.shape[0]
    n = mesh.shape[expert_axis]
    pad = -T % n
    if pad:  # token count not divisible by the axis: zero rows with zero gates contribute nothing
        x = jnp.pad(x, ((0, pad), (0, 0)))
        weights = jnp.pad(weights, ((0, pad), (0, 0)))
        ids = jnp.pad(ids, ((0, pad), (0, 0)))

    def local(x, weights, ids, w_in, w_out):
        expert_fn = lambda rows, group_sizes: layer.expert_mlp(rows, group_sizes, w_in, w_out, activation)
        return parallel.moe_ep(x, ids, weights, expert_fn, num_experts=num_experts, axis_name=expert_axis)

    tokens, experts = P(expert_axis, None), P(expert_axis, None, None)
    specs = (tokens, tokens, tokens, experts, experts)
    args = (x, weights, ids, w_in, w_out)
    out = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=tokens)(*args)
    return out[:T]


def shared_mlp(x, w_in, w_out, activation):
    """The always-on shared experts: a dense MLP, x [T, H] @ w_in [H, 2SF] -> act -> @ w_out."""
    return layer.apply_activation(x @ w_in, activation) @ w_out


def router_logits(x, router):
    """[T, H] @ [H, E] in float32 at full precision (router math is float32 whatever the input)."""
    return jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


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

    Each call sows (nnx.Intermediate) load_balance_loss, router_z_loss and tokens_per_expert.
    `dtype` is the computation dtype (default: x's and the params' promoted dtype);
    `param_dtype` the parameters'. Router math is float32.
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
        num_shared_experts: int = 0,
        dtype=None,
        param_dtype=jnp.float32,
        mesh: Optional[jax.sharding.Mesh] = None,
        expert_axis: Optional[str] = None,
    ):
        check_module_args("MoE", hidden_size, ffn_size, num_experts, top_k, activation, scoring, num_groups,
                          topk_groups, num_shared_experts, mesh, expert_axis)
        self.hidden_size, self.ffn_size, self.num_experts, self.top_k = hidden_size, ffn_size, num_experts, top_k
        self.activation, self.scoring, self.renormalize = activation, scoring, renormalize
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.routed_scaling_factor = routed_scaling_factor
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

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., H] -> [..., H] in the computation dtype."""
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"MoE: x's last dimension must be hidden_size ({self.hidden_size}), got shape {x.shape}")
        lead = x.shape[:-1]
        dtype = self.dtype or jnp.promote_types(x.dtype, self.param_dtype)
        x2 = x.reshape(-1, self.hidden_size).astype(dtype)
        bias = self.router_bias[...] if self.scoring == "sigmoid" else None
        r = routing.route(router_logits(x2, self.router[...]), self.top_k, scoring=self.scoring,
                          renormalize=self.renormalize, bias=bias, num_groups=self.num_groups,
                          topk_groups=self.topk_groups, routed_scaling_factor=self.routed_scaling_factor)
        for name, value in r.aux._asdict().items():
            self.sow(nnx.Intermediate, name, value)
        w_in, w_out = self.w_in[...].astype(dtype), self.w_out[...].astype(dtype)
        if self.mesh is not None:
            y = expert_parallel(x2, r.weights, r.ids, w_in, w_out, activation=self.activation,
                                num_experts=self.num_experts, mesh=self.mesh, expert_axis=self.expert_axis)
        else:
            y = layer.moe_mlp(x2, r.weights, r.ids, w_in, w_out, activation=self.activation)
        if self.num_shared_experts:
            y = y + shared_mlp(x2, self.shared_w_in[...].astype(dtype), self.shared_w_out[...].astype(dtype),
                               self.activation)
        return y.reshape(*lead, self.hidden_size)

    def update_router_bias(self, tokens_per_expert: jax.Array, rate: float = 1e-3) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing step on router_bias (sigmoid scoring only),
        outside the gradient: see `jax_moe_permute.balance_bias`."""
        if self.scoring != "sigmoid":
            raise ValueError("MoE.update_router_bias: the layer has no router_bias (scoring must be 'sigmoid')")
        self.router_bias[...] = routing.balance_bias(self.router_bias[...], tokens_per_expert, rate)


__all__ = ["MoE", "RouterAux", "RouterBias"]
