"""The Flax modules (nnx.MoE, linen.MoE) against a dense reference built from their own variables:
Mixtral / Qwen3-MoE / DeepSeek-V3 configurations, forward and gradients w.r.t. input and every
parameter, leading dims, bf16, nnx transforms, aux values (return_aux, nnx.capture, no
DeprecationWarning on a plain call), partitioning metadata, expert parallelism
on a 4-device CPU mesh (in a subprocess), bad arguments."""

import functools
import json
import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
from flax import nnx  # noqa: E402
import flax.linen as nn  # noqa: E402

import jax_moe_permute as jmp  # noqa: E402
from jax_moe_permute import linen as jmp_linen  # noqa: E402
from jax_moe_permute import nnx as jmp_nnx  # noqa: E402
from conftest import random_float  # noqa: E402
from test_layer import dense_moe  # noqa: E402

HIGHEST = jax.lax.Precision.HIGHEST
# Routing of the three Hugging Face blocks (small sizes): keyword arguments of MoE.
CONFIGS = {
    "mixtral": dict(),
    "qwen3": dict(renormalize=False),
    "deepseek": dict(scoring="sigmoid", num_groups=4, topk_groups=2, routed_scaling_factor=2.5, num_shared_experts=2),
}
H, F, E, K = 16, 12, 8, 2


def reference(params, x, kw):
    """The block's math from its variables: float32 router, route, dense experts, shared MLP."""
    return _reference(params, x, tuple(sorted(kw.items())))


@functools.partial(jax.jit, static_argnums=2)  # one compile per shape, not one per eager op
def _reference(params, x, kw):
    kw = dict(kw)
    x2 = x.reshape(-1, H)
    logits = jnp.dot(x2, params["router"], precision=HIGHEST)
    r = jmp.route(logits, K, scoring=kw.get("scoring", "softmax"), renormalize=kw.get("renormalize", True),
                  bias=params.get("router_bias"), num_groups=kw.get("num_groups"), topk_groups=kw.get("topk_groups"),
                  routed_scaling_factor=kw.get("routed_scaling_factor", 1.0))
    y = dense_moe(x2, r.weights, r.ids, params["w_in"], params["w_out"])
    if "shared_w_in" in params:
        gate, up = jnp.split(jnp.dot(x2, params["shared_w_in"], precision=HIGHEST), 2, axis=-1)
        y = y + jnp.dot(jax.nn.silu(gate) * up, params["shared_w_out"], precision=HIGHEST)
    return y.reshape(x.shape)


def nnx_params(model):
    params = {k: v[...] for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    params = {k[0]: v for k, v in params.items()}
    if hasattr(model, "router_bias"):
        params["router_bias"] = model.router_bias[...]
    return params


def make_nnx(name, **extra):
    m = jmp_nnx.MoE(H, F, E, K, rngs=nnx.Rngs(0), **CONFIGS[name], **extra)
    if hasattr(m, "router_bias"):  # a non-zero bias, so that it matters
        m.router_bias[...] = random_float((E,), jnp.float32, 0.1)
    return m


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_nnx_forward_and_grads(name):
    m = make_nnx(name)
    x = random_float((2, 5, H), jnp.float32)
    params = nnx_params(m)
    close(nnx.jit(lambda m, x: m(x))(m, x), reference(params, x, CONFIGS[name]))
    ct = random_float(x.shape, jnp.float32)

    def loss(m, x):
        return jnp.sum(m(x) * ct)

    g_model, g_x = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(m, x)
    trainable = {k: v for k, v in params.items() if k != "router_bias"}
    ref_p, ref_x = jax.grad(lambda p, x: jnp.sum(reference({**params, **p}, x, CONFIGS[name]) * ct), (0, 1))(
        trainable, x)
    close(g_x, ref_x, 1e-4)
    got = {k[0]: v[...] for k, v in nnx.to_flat_state(g_model)}
    assert set(got) == set(trainable)  # router_bias is not a Param: no gradient
    for k in trainable:
        close(got[k], ref_p[k], 1e-4)


def reference_aux(params, x, kw):
    """The RouterAux that routing computes from the layer's router (and bias) for x."""
    logits = jnp.dot(x.reshape(-1, H), params["router"], precision=HIGHEST)
    return jmp.route(logits, K, scoring=kw.get("scoring", "softmax"), renormalize=kw.get("renormalize", True),
                     bias=params.get("router_bias"), num_groups=kw.get("num_groups"),
                     topk_groups=kw.get("topk_groups"),
                     routed_scaling_factor=kw.get("routed_scaling_factor", 1.0)).aux


def check_aux(aux, expected, tokens):
    assert set(aux) == set(jmp.RouterAux._fields)
    np.testing.assert_array_equal(aux["tokens_per_expert"], expected.tokens_per_expert)
    assert int(jnp.sum(aux["tokens_per_expert"])) == tokens * K
    close(aux["load_balance_loss"], expected.load_balance_loss)
    close(aux["router_z_loss"], expected.router_z_loss)
    assert float(aux["load_balance_loss"]) > 0 and float(aux["router_z_loss"]) > 0


HAS_CAPTURE = hasattr(nnx, "capture")  # flax >= 0.12.6


@pytest.mark.parametrize("name", list(CONFIGS))
def test_nnx_plain_call_no_deprecation_warning(name):
    """flax 0.12.6+ warns on every Module.sow outside nnx.capture: a plain call must not sow."""
    m = make_nnx(name)
    x = random_float((2, 3, H), jnp.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        # flax < 0.12.6 on jax 0.10 warns about its own jax.core use on every call: not ours
        warnings.filterwarnings("ignore", r"jax\.core\.\w+ is deprecated", DeprecationWarning)
        y = m(x)
        close(nnx.jit(lambda m, x: m(x))(m, x), y)
        y2, aux = m(x, return_aux=True)
        if HAS_CAPTURE:
            nnx.capture(m, nnx.Intermediate)(x)
    close(y2, y)
    assert isinstance(aux, jmp.RouterAux)
    # nothing stored on the module by any of those calls (so a jitted step's state stays put)
    assert len(nnx.to_flat_state(nnx.state(m, nnx.Intermediate))) == 0


def test_nnx_leading_dims_and_aux():
    """Aux values come back from return_aux=True and from nnx.capture, equal to what routing
    computes; a single token [H] works too."""
    kw = CONFIGS["deepseek"]
    m = make_nnx("deepseek")
    x = random_float((3, 2, 4, H), jnp.float32)
    params = nnx_params(m)
    expected = reference_aux(params, x, kw)
    y, aux = nnx.jit(lambda m, x: m(x, return_aux=True))(m, x)
    close(y, reference(params, x, kw))
    check_aux(aux._asdict(), expected, 24)
    close(nnx.jit(lambda m, x: m(x))(m, x[0, 0, 0]), y[0, 0, 0])  # a single token [H]
    if not HAS_CAPTURE:  # flax < 0.12.6: return_aux only
        return
    y_c, inter = nnx.jit(lambda m, x: nnx.capture(m, nnx.Intermediate)(x))(m, x)
    close(y_c, y)
    sown = {k[0]: v.get_value() for k, v in nnx.to_flat_state(inter)}
    assert all(len(v) == 1 for v in sown.values())  # one sown value per call
    check_aux({k: v[0] for k, v in sown.items()}, expected, 24)


@pytest.mark.skipif(not HAS_CAPTURE, reason="nnx.capture: flax >= 0.12.6")
def test_nnx_capture_in_a_model():
    """Two layers in a model: nnx.capture gives each its own aux under its path."""
    class Two(nnx.Module):
        def __init__(self):
            self.a, self.b = make_nnx("mixtral"), make_nnx("qwen3")

        def __call__(self, x):
            return self.b(self.a(x))

    model = Two()
    x = random_float((5, H), jnp.float32)
    y, inter = nnx.capture(model, nnx.Intermediate)(x)
    close(y, model(x))
    h = model.a(x)
    for path, name, inp in (("a", "mixtral", x), ("b", "qwen3", h)):
        sown = {k: v.get_value()[0] for k, v in inter[path].items()}
        check_aux(sown, reference_aux(nnx_params(getattr(model, path)), inp, CONFIGS[name]), 5)


def test_nnx_router_bias_update():
    m = make_nnx("deepseek")
    before = m.router_bias[...]
    m.update_router_bias(jnp.array([9, 1, 1, 1, 1, 1, 1, 1]), rate=0.01)
    close(m.router_bias[...] - before, [-0.01] + [0.01] * 7)
    with pytest.raises(ValueError, match="router_bias"):
        make_nnx("mixtral").update_router_bias(jnp.ones(E))


def test_nnx_partitioning_metadata():
    """Without a mesh the sharding names are metadata only (on a mesh: the subprocess test)."""
    m = make_nnx("deepseek")
    specs = nnx.get_partition_spec(nnx.state(m))
    assert specs["w_in"].get_value() == jax.sharding.PartitionSpec(None, None, None)
    assert m.w_out.get_metadata()["out_sharding"] == (None, None, None)
    with pytest.raises(ValueError, match="mesh and expert_axis"):
        jmp_nnx.MoE(H, F, E, K, rngs=nnx.Rngs(0), expert_axis="expert")


@pytest.mark.parametrize("module", ["nnx", "linen"])
def test_bf16(module):
    x = random_float((7, H), jnp.bfloat16)
    if module == "nnx":
        m = jmp_nnx.MoE(H, F, E, K, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, num_shared_experts=1)
        y, params = nnx.jit(lambda m, x: m(x))(m, x), nnx_params(m)
    else:
        m = jmp_linen.MoE(H, F, E, K, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, num_shared_experts=1)
        variables = m.init(jax.random.PRNGKey(0), x)
        y, params = jax.jit(m.apply)(variables, x), nn.unbox(variables)["params"]
    assert y.dtype == jnp.bfloat16 and all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(params))
    ref = reference({k: v.astype(jnp.float32) for k, v in params.items()}, x.astype(jnp.float32), {})
    scale = float(jnp.max(jnp.abs(ref)))
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref), atol=4e-2 * scale, rtol=4e-2)


def test_nnx_scan_and_remat_over_layers():
    """A stack of layers created with nnx.vmap, applied by nnx.scan with nnx.remat: equals the loop."""
    layers = 3

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return jmp_nnx.MoE(H, F, E, K, rngs=rngs)

    stack = create(nnx.Rngs(0))

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    @nnx.remat
    def apply(layer, x):
        return x + layer(x)

    x = random_float((6, H), jnp.float32)
    y = nnx.jit(apply)(stack, x)
    expected = x
    params = {k[0]: v[...] for k, v in nnx.to_flat_state(nnx.state(stack, nnx.Param))}
    for i in range(layers):
        expected = expected + reference({k: v[i] for k, v in params.items()}, expected, {})
    close(y, expected, 1e-4)
    g = nnx.jit(nnx.grad(lambda s, x: apply(s, x).sum()))(stack, x)
    assert all(bool(jnp.all(jnp.isfinite(v[...]))) for _, v in nnx.to_flat_state(g))


def test_linen_scan_and_remat_over_layers():
    """nn.scan of nn.remat over Linen layers (the boxed parameters' new axis named, docs/layer.md):
    equals the loop over the stacked parameters, and the gradient is finite."""
    layers = 3

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return x + jmp_linen.MoE(H, F, E, K)(x), None

    stack = nn.scan(nn.remat(Block), variable_axes={"params": 0, "intermediates": 0}, split_rngs={"params": True},
                    length=layers, metadata_params={nn.PARTITION_NAME: "layers"})()
    x = random_float((6, H), jnp.float32)
    variables = stack.init(jax.random.PRNGKey(0), x, None)
    assert nn.get_partition_spec(variables)["params"]["MoE_0"]["w_in"] == jax.sharding.PartitionSpec(
        "layers", None, None, None)
    y = jax.jit(stack.apply)(variables, x, None)[0]
    params = nn.unbox(variables)["params"]["MoE_0"]
    expected = x
    for i in range(layers):
        expected = expected + reference({k: v[i] for k, v in params.items()}, expected, {})
    close(y, expected, 1e-4)
    g = jax.jit(jax.grad(lambda v: stack.apply(v, x, None)[0].sum()))(variables)
    assert all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(g))


@pytest.mark.parametrize("name", ["qwen3", "deepseek"])
def test_linen_matches_nnx(name):
    kw = CONFIGS[name]
    m = make_nnx(name)
    params = nnx_params(m)
    lm = jmp_linen.MoE(H, F, E, K, **kw)
    x = random_float((2, 3, H), jnp.float32)
    variables = lm.init(jax.random.PRNGKey(1), x)
    assert nn.get_partition_spec(variables)["params"]["w_in"] == jax.sharding.PartitionSpec(None, None, None)
    variables = {"params": {k: v for k, v in params.items() if k != "router_bias"}}
    if "router_bias" in params:
        variables[jmp_linen.ROUTER_STATE] = {"router_bias": params["router_bias"]}
    y, state = jax.jit(functools.partial(lm.apply, mutable=["intermediates"]))(variables, x)
    close(y, nnx.jit(lambda m, x: m(x))(m, x))
    assert set(state["intermediates"]) == {"load_balance_loss", "router_z_loss", "tokens_per_expert"}
    g = jax.jit(jax.grad(lambda p: lm.apply({**variables, "params": p}, x).sum()))(variables["params"])
    g_ref = jax.jit(jax.grad(lambda p: reference({**params, **p}, x, kw).sum()))(variables["params"])
    for k in g:
        close(g[k], g_ref[k], 1e-4)


@pytest.mark.parametrize("kw,match", [
    (dict(top_k=9), "top_k"),
    (dict(activation="tanh"), "activation"),
    (dict(num_shared_experts=-1), "num_shared_experts"),
    (dict(mesh=jax.sharding.AbstractMesh((3,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,)),
          expert_axis="expert"), "num_experts"),
    (dict(mesh=jax.sharding.AbstractMesh((2,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,)),
          expert_axis="model"), "expert_axis"),
])
def test_bad_arguments(kw, match):
    args = dict(hidden_size=H, ffn_size=F, num_experts=E, top_k=K) | kw
    with pytest.raises(ValueError, match=match):
        jmp_nnx.MoE(**args, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=match):
        jmp_linen.MoE(**args)
    m = jmp_nnx.MoE(H, F, E, K, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="hidden_size"):
        m(jnp.ones((3, H + 1)))


EP_SCRIPT = textwrap.dedent("""
    import json, jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    from flax import nnx
    import flax.linen as nn
    from jax_moe_permute import nnx as jmp_nnx, linen as jmp_linen
    assert len(jax.devices()) == 4
    mesh = jax.make_mesh((4,), ("expert",), axis_types=(jax.sharding.AxisType.AXIS_TYPE,))
    if mesh.axis_types[0] == jax.sharding.AxisType.Explicit:
        jax.set_mesh(mesh)  # explicit sharding's context: jax requires it for eager ops on sharded arrays
    kw = dict(scoring="sigmoid", num_groups=4, topk_groups=2, routed_scaling_factor=2.5, num_shared_experts=1)
    out = {}
    ep = jmp_nnx.MoE(16, 12, 8, 2, rngs=nnx.Rngs(0), mesh=mesh, expert_axis="expert", **kw)
    one = jmp_nnx.MoE(16, 12, 8, 2, rngs=nnx.Rngs(0), **kw)
    ep.router_bias[...] = jnp.linspace(-0.1, 0.1, 8)
    nnx.update(one, jax.device_get(nnx.state(ep)))
    out["w_in_sharding"] = list(ep.w_in[...].sharding.spec)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 7, 16))  # 14 tokens: padded to 16 over 4 devices
    diff = lambda a, b: max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in
                            zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    out["forward"] = diff(nnx.jit(lambda m, x: m(x))(ep, x), one(x))
    lm = jmp_linen.MoE(16, 12, 8, 2, mesh=mesh, expert_axis="expert", **kw)
    variables = {"params": {k[0]: v[...] for k, v in nnx.to_flat_state(nnx.state(one, nnx.Param))},
                 "router_state": {"router_bias": one.router_bias[...]}}
    out["linen_forward"] = diff(jax.jit(lm.apply)(variables, x), one(x))
    try:
        loss = lambda m, x: jnp.sum(m(x) ** 2)
        grad = nnx.grad(loss, argnums=(0, 1))
        out["grad"] = diff(nnx.jit(grad)(ep, x), grad(one, x))
    except Exception as e:
        out["grad_error"] = f"{type(e).__name__}: {e}"[:2000]
    print("RESULT", json.dumps(out))
""")


@pytest.fixture(scope="module", params=["Auto", "Explicit"])
def ep_result(request):
    pytest.importorskip("jax_moe_permute.parallel", reason="needs jax_moe_permute.parallel")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    script = EP_SCRIPT.replace("AXIS_TYPE", request.param)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_expert_parallel_forward(ep_result):
    assert ep_result["w_in_sharding"] == ["expert", None, None]
    assert ep_result["forward"] <= 1e-5 and ep_result["linen_forward"] <= 1e-5


def test_expert_parallel_grad(ep_result):
    assert "grad_error" not in ep_result, ep_result.get("grad_error")
    assert ep_result["grad"] <= 1e-4
