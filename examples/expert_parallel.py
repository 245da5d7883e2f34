"""Expert parallelism with `jax_moe_permute.parallel.moe_ep`: tokens and experts sharded over a
mesh axis, the expert MLP as two `jax.lax.ragged_dot`s, a gradient step on every parameter.

    python examples/expert_parallel.py
    # on a CPU-only machine, pretend to have 4 devices:
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python examples/expert_parallel.py
"""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_moe_permute.parallel import moe_ep

NUM_EXPERTS, TOP_K, D_MODEL, D_FF = 8, 2, 64, 128
TOKENS_PER_DEVICE = 32

mesh = jax.make_mesh((jax.device_count(),), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
assert NUM_EXPERTS % mesh.size == 0, "every device holds NUM_EXPERTS / devices experts"


def moe_layer(params, hidden, dispatch):
    """This device's tokens [T, D_MODEL] -> [T, D_MODEL]; params hold this device's expert shards."""
    probs = jax.nn.softmax(hidden @ params["router"])  # router replicated: [T, NUM_EXPERTS]
    topk_weights, topk_ids = jax.lax.top_k(probs, TOP_K)

    def experts(rows, group_sizes):  # rows [R, D_MODEL] grouped by local expert
        h = jax.nn.gelu(jax.lax.ragged_dot(rows, params["w_in"], group_sizes))
        return jax.lax.ragged_dot(h, params["w_out"], group_sizes)

    return moe_ep(hidden, topk_ids, topk_weights, experts, num_experts=NUM_EXPERTS, axis_name="ep",
                  dispatch=dispatch)


def loss_fn(params, hidden, target, dispatch="all_gather"):
    param_specs = {"router": P(), "w_in": P("ep"), "w_out": P("ep")}  # experts split over "ep"
    layer = jax.shard_map(lambda p, h: moe_layer(p, h, dispatch), mesh=mesh,
                          in_specs=(param_specs, P("ep")), out_specs=P("ep"))
    return jnp.mean((hidden + layer(params, hidden) - target) ** 2)


def main():
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    tokens = TOKENS_PER_DEVICE * mesh.size
    params = {
        "router": jax.random.normal(k[0], (D_MODEL, NUM_EXPERTS)) / D_MODEL**0.5,
        "w_in": jax.random.normal(k[1], (NUM_EXPERTS, D_MODEL, D_FF)) / D_MODEL**0.5,
        "w_out": jax.random.normal(k[2], (NUM_EXPERTS, D_FF, D_MODEL)) / D_FF**0.5,
    }
    params = {name: jax.device_put(x, NamedSharding(mesh, P() if name == "router" else P("ep")))
              for name, x in params.items()}
    tokens_sharding = NamedSharding(mesh, P("ep"))
    hidden = jax.device_put(jax.random.normal(k[3], (tokens, D_MODEL)), tokens_sharding)
    target = jax.device_put(jax.random.normal(k[4], (tokens, D_MODEL)), tokens_sharding)

    step = jax.jit(jax.value_and_grad(loss_fn), static_argnames="dispatch")
    loss, grads = step(params, hidden, target)
    loss_a2a, grads_a2a = step(params, hidden, target, dispatch="all_to_all")
    for name in params:  # both dispatches compute the same function
        assert jnp.allclose(grads[name], grads_a2a[name], rtol=1e-4, atol=1e-5), name
    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    print(f"{mesh.size} device(s), {NUM_EXPERTS // mesh.size} experts each: loss {loss:.4f} "
          f"(all_to_all {loss_a2a:.4f}), after one SGD step {step(params, hidden, target)[0]:.4f}")


if __name__ == "__main__":
    main()
