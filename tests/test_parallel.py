"""Expert parallelism: the ops and `moe_ep` inside shard_map, against the single-device result
and a dense einsum reference (every expert computed, one-hot gates), forward and gradients.

The cases run on a mesh over every device jax sees: a plain CPU or a single GPU gives axis size 1.
`test_multidevice` runs this module again in subprocesses on 4 and 8 CPU devices (the device
count is fixed when jax starts, so it cannot change inside this process)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_moe_permute as jmp
from jax_moe_permute import parallel
from conftest import assert_bits_equal, assert_close

CHILD_ENV = "JAX_MOE_PERMUTE_MULTIDEVICE_CHILD"
D = jax.device_count()
# A multi-device child must see the devices its parent asked for (else its collection fails).
assert D == int(os.environ.get(CHILD_ENV, D)), (D, os.environ.get(CHILD_ENV))
AXIS = "ep"
MESH = jax.make_mesh((D,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
HI = jax.lax.Precision.HIGHEST
T_LOCAL, K, H, F = 5, 3, 8, 12  # tokens per device, top-k, model and hidden width
# Inputs from numpy (fresh values per call, never zeros): eager jax.random would compile
# anew for every shape, which dominates these small cases.
_rng = np.random.default_rng(20261201)


def random_float(shape, dtype, scale=1.0):
    return jnp.asarray((_rng.standard_normal(shape) * scale + 0.25).astype(np.float32)).astype(dtype)


def random_ids(T, K, E):
    """Expert ids in [-2, E + 2): invalid ids and duplicates included."""
    return jnp.asarray(_rng.integers(-2, E + 2, (T, K), dtype=np.int32))


def random_expert_map(E, L):
    """Each global expert maps to a local one in [0, L) or to -1 (about half)."""
    local = _rng.integers(-L, L, E)
    return jnp.asarray(np.where(local < 0, -1, local).astype(np.int32))


# "all_to_all" is the ragged exchange where the backend has one, else the dense emulation:
# test the emulation on its own there too.
DISPATCHES = ["all_gather", "all_to_all"] + (
    ["dense_all_to_all"] if jax.default_backend() in parallel.RAGGED_ALL_TO_ALL_BACKENDS else [])


def shard(x, spec=P(AXIS)):
    return jax.device_put(x, NamedSharding(MESH, spec))


def smap(f, in_specs, out_specs, check_vma):
    return jax.jit(jax.shard_map(f, mesh=MESH, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma))


# ---- the expert MLP three ways -------------------------------------------------------------

def expert_mlp(w1, w2):
    """Two ragged_dots over rows grouped by expert: what expert_fn usually is."""
    def run(rows, group_sizes):
        h = jax.nn.gelu(jax.lax.ragged_dot(rows, w1, group_sizes, precision=HI))
        return jax.lax.ragged_dot(h.astype(rows.dtype), w2, group_sizes, precision=HI)
    return run


@jax.jit(static_argnums=(5, 6))
def single_device_moe(hidden, ids, weights, w1, w2, num_experts, align_size=1):
    res = jmp.moe_permute(hidden, ids, num_experts, align_size=align_size)
    return jmp.moe_unpermute(expert_mlp(w1, w2)(res.hidden, res.group_sizes), res.row_map, weights)


@jax.jit(static_argnums=5)
def dense_moe(hidden, ids, weights, w1, w2, num_experts):
    """Every expert on every token, mixed by one-hot gates (invalid ids give a zero gate)."""
    gates = jnp.einsum("tk,tke->te", weights.astype(jnp.float32), jax.nn.one_hot(ids, num_experts), precision=HI)
    h = jax.nn.gelu(jnp.einsum("th,ehf->tef", hidden.astype(jnp.float32), w1.astype(jnp.float32), precision=HI))
    y = jnp.einsum("tef,efo->teo", h, w2.astype(jnp.float32), precision=HI)
    return jnp.einsum("te,teo->to", gates, y, precision=HI).astype(hidden.dtype)


def moe_inputs(num_experts, routing="random", tokens=None, dtype=jnp.float32):
    """Global (all devices') tokens, routing and expert weights; fresh random values."""
    T = D * T_LOCAL if tokens is None else tokens
    hidden = random_float((T, H), dtype)
    ids = random_ids(T, K, num_experts)  # invalid ids and duplicates included
    if routing == "one_device":  # every valid entry to the last device's experts
        L = num_experts // D
        ids = jnp.where((ids >= 0) & (ids < num_experts), num_experts - L + ids % L, ids)
    elif routing == "idle_first":  # device 0 has no tokens: all its ids are invalid
        ids = ids.at[:T_LOCAL].set(-1)
    weights = random_float((T, K), jnp.float32 if dtype == jnp.float32 else dtype)
    w1 = random_float((num_experts, H, F), dtype, scale=0.3)
    w2 = random_float((num_experts, F, H), dtype, scale=0.3)
    return hidden, ids, weights, w1, w2


def ep_forward(num_experts, dispatch, check_vma, align_size=1):
    """[T, H] global tokens -> [T, H] through moe_ep on the mesh (tokens and experts sharded)."""
    def per_device(hidden, ids, weights, w1, w2):
        return parallel.moe_ep(hidden, ids, weights, expert_mlp(w1, w2), num_experts=num_experts, axis_name=AXIS,
                               dispatch=dispatch, align_size=align_size)
    return smap(per_device, (P(AXIS),) * 5, P(AXIS), check_vma)


def loss_and_grads(forward, args, ct):
    """<ct, forward(args)> and its gradient in hidden, weights and both expert weights."""
    loss = lambda *a: jnp.vdot(ct, forward(*a).astype(jnp.float32))  # noqa: E731
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3, 4)))(*args)


def assert_trees_close(a, b):
    """float32 leaves equal up to rounding, relative to each leaf's largest magnitude (sums
    over devices and experts run in another order than in the references)."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        assert x.shape == y.shape
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-5 * max(1.0, float(np.max(np.abs(y), initial=0))))


# ---- moe_ep ------------------------------------------------------------------------------

@pytest.mark.parametrize("dispatch", DISPATCHES)
@pytest.mark.parametrize("routing,align_size,experts_per_device,check_vma", [
    ("random", 1, 2, False), ("random", 4, 3, True), ("one_device", 1, 2, True), ("idle_first", 8, 1, True)])
def test_moe_ep_matches_single_device_and_dense(dispatch, routing, align_size, experts_per_device, check_vma):
    """Random routing (invalid and duplicate ids), every entry to one device's experts, and a
    device without tokens (all its ids invalid); check_vma off once, on otherwise."""
    E = experts_per_device * D
    hidden, ids, weights, w1, w2 = moe_inputs(E, routing)
    forward = ep_forward(E, dispatch, check_vma, align_size)
    out = forward(*map(shard, (hidden, ids, weights, w1, w2)))
    assert out.shape == hidden.shape and out.dtype == hidden.dtype
    assert_close(out, single_device_moe(hidden, ids, weights, w1, w2, E), jnp.float32)
    assert_close(out, dense_moe(hidden, ids, weights, w1, w2, E), jnp.float32)

    ct = random_float(hidden.shape, jnp.float32)
    args = (hidden, ids, weights, w1, w2)
    got = loss_and_grads(forward, tuple(map(shard, args)), ct)
    want = loss_and_grads(lambda h, i, w, a, b: dense_moe(h, i, w, a, b, E), args, ct)
    single = loss_and_grads(lambda h, i, w, a, b: single_device_moe(h, i, w, a, b, E), args, ct)
    assert_trees_close(got, want)
    assert_trees_close(got, single)


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_moe_ep_no_tokens(dispatch):
    """T = 0 on every device: an empty result, and zero gradients for the experts."""
    E = 2 * D
    hidden, ids, weights, w1, w2 = moe_inputs(E, tokens=0)
    forward = ep_forward(E, dispatch, check_vma=True)
    args = tuple(map(shard, (hidden, ids, weights, w1, w2)))
    assert forward(*args).shape == (0, H)
    _, (_, _, g1, g2) = loss_and_grads(forward, args, jnp.zeros((0, H)))
    assert not np.any(np.asarray(g1)) and not np.any(np.asarray(g2))


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_moe_ep_bfloat16(dispatch):
    E = 2 * D
    hidden, ids, weights, w1, w2 = moe_inputs(E, dtype=jnp.bfloat16)
    out = ep_forward(E, dispatch, check_vma=True)(*map(shard, (hidden, ids, weights, w1, w2)))
    assert out.dtype == jnp.bfloat16
    # Partial sums are rounded to bfloat16 once per device before they are added up.
    np.testing.assert_allclose(np.asarray(out, np.float32), single_device_moe(hidden, ids, weights, w1, w2, E)
                               .astype(np.float32), rtol=3e-2, atol=3e-2)
    np.testing.assert_allclose(np.asarray(out, np.float32), dense_moe(hidden, ids, weights, w1, w2, E)
                               .astype(np.float32), rtol=6e-2, atol=6e-2)


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_moe_ep_identity_experts(dispatch):
    """With an identity expert, both dispatches reduce to the weighted sum of the valid slots."""
    E = 2 * D
    hidden, ids, weights, _, _ = moe_inputs(E)

    def per_device(h, i, w):
        return parallel.moe_ep(h, i, w, lambda rows, sizes: rows, num_experts=E, axis_name=AXIS, dispatch=dispatch)
    out = smap(per_device, (P(AXIS),) * 3, P(AXIS), True)(*map(shard, (hidden, ids, weights)))
    valid = (ids >= 0) & (ids < E)
    want = jnp.sum(jnp.where(valid, weights, 0.0), axis=1, keepdims=True) * hidden
    assert_close(out, want, jnp.float32)


@pytest.mark.parametrize("dispatch", ["all_gather", "all_to_all"])
def test_moe_ep_scan_checkpoint_layers(dispatch):
    """A residual stack of MoE layers: lax.scan over layers, each rematerialised, under grad."""
    E, layers = 2 * D, 3
    hidden, ids, weights, _, _ = moe_inputs(E)
    w1 = random_float((layers, E, H, F), jnp.float32, scale=0.3)
    w2 = random_float((layers, E, F, H), jnp.float32, scale=0.3)

    def stack(layer_fn):
        def run(h, i, w, a, b):
            def body(x, ab):
                return x + layer_fn(x, i, w, *ab), None
            return jax.lax.scan(jax.checkpoint(body), h, (a, b))[0]
        return run

    def ep_layer(x, i, w, a, b):
        return parallel.moe_ep(x, i, w, expert_mlp(a, b), num_experts=E, axis_name=AXIS, dispatch=dispatch)

    forward = smap(stack(ep_layer), (P(AXIS), P(AXIS), P(AXIS), P(None, AXIS), P(None, AXIS)), P(AXIS), True)
    reference = stack(lambda x, i, w, a, b: dense_moe(x, i, w, a, b, E))
    ct = random_float(hidden.shape, jnp.float32)
    args = (hidden, ids, weights, w1, w2)
    sharded = tuple(map(shard, args[:3])) + tuple(shard(x, P(None, AXIS)) for x in args[3:])
    assert_trees_close(loss_and_grads(forward, sharded, ct), loss_and_grads(reference, args, ct))


@pytest.mark.parametrize("dispatch", ["all_gather", "all_to_all"])
def test_moe_ep_over_two_mesh_axes(dispatch):
    """axis_name a tuple: the experts spread over both axes of a 2-D mesh."""
    rows = 2 if D % 2 == 0 else 1
    mesh = jax.make_mesh((rows, D // rows), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    E = 2 * D
    args = moe_inputs(E)

    def per_device(h, i, w, a, b):
        return parallel.moe_ep(h, i, w, expert_mlp(a, b), num_experts=E, axis_name=("a", "b"), dispatch=dispatch)
    spec = P(("a", "b"))
    forward = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec))
    ct = random_float(args[0].shape, jnp.float32)
    sharded = [jax.device_put(x, NamedSharding(mesh, spec)) for x in args]
    assert_trees_close(loss_and_grads(forward, sharded, ct), loss_and_grads(lambda *a: dense_moe(*a, E), args, ct))


def test_moe_ep_replicated_tokens():
    """Tokens replicated over the axis (in_specs P()): every device returns the full result and
    the gradient of the replicated input is summed over the devices' uses."""
    E = 2 * D
    hidden, ids, weights, w1, w2 = moe_inputs(E)

    def per_device(h, i, w, a, b):
        return parallel.moe_ep(h, i, w, expert_mlp(a, b), num_experts=E, axis_name=AXIS)
    forward = smap(per_device, (P(), P(), P(), P(AXIS), P(AXIS)), P(AXIS), True)
    out = forward(hidden, ids, weights, shard(w1), shard(w2))  # [D*T, H]: each device's copy of the answer
    want = dense_moe(hidden, ids, weights, w1, w2, E)
    assert_close(out, jnp.tile(want, (D, 1)), jnp.float32)


def test_moe_ep_errors():
    E = 2 * D
    hidden, ids, weights, w1, w2 = moe_inputs(E)

    def call(**kw):
        args = dict(num_experts=E, axis_name=AXIS)
        args.update(kw)
        fn = args.pop("expert_fn", expert_mlp(w1, w2))
        w = args.pop("weights", weights)
        return smap(lambda h, i, ww: parallel.moe_ep(h, i, ww, fn, **args), (P(AXIS),) * 3, P(AXIS), True)(
            *map(shard, (hidden, ids, w)))

    with pytest.raises(ValueError, match="dispatch"):
        call(dispatch="ring")
    with pytest.raises(ValueError, match="expert_fn"):
        call(expert_fn=lambda rows, sizes: rows[:1])
    with pytest.raises(TypeError, match="topk_weights"):
        call(weights=ids)
    if D == 1:
        return  # every num_experts is divisible by 1; the 4- and 8-device runs check the rest
    with pytest.raises(ValueError, match="divisible"):
        call(num_experts=E + 1)


# ---- the ops themselves under shard_map -------------------------------------------------

@pytest.mark.parametrize("check_vma", [False, True])
def test_ops_in_shard_map_match_per_shard(check_vma):
    """moe_permute with an expert_map, then moe_unpermute with weights, on each device's own
    shard: forward and gradients equal the same ops run shard by shard outside shard_map."""
    E, L, A = 3 * D + 1, 3, 4
    hidden, ids = random_float((D * T_LOCAL, H), jnp.float32), random_ids(D * T_LOCAL, K, E)
    weights = random_float((D * T_LOCAL, K), jnp.float32)
    maps = jnp.stack([random_expert_map(E, L) for _ in range(D)])  # a different map per device
    ct = random_float((D * T_LOCAL, H), jnp.float32)
    scale = random_float((1, H), jnp.float32)

    def layer(h, i, w, m, permute=jmp.moe_permute, unpermute=jmp.moe_unpermute):
        res = permute(h, i, E, expert_map=m.reshape(-1), num_local_experts=L, align_size=A)
        rows, row_map = res[0], res[2]
        return unpermute(rows * scale, row_map, w), rows

    def per_device(h, i, w, m):
        out, rows = layer(h, i, w, m)
        return out, rows

    forward = smap(per_device, (P(AXIS),) * 4, (P(AXIS), P(AXIS)), check_vma)
    args = (hidden, ids, weights, maps)
    out, rows = forward(*map(shard, args))
    split = lambda x: jnp.split(x, D)  # noqa: E731
    ref = [layer(*a, permute=jmp.reference.moe_permute, unpermute=jmp.reference.moe_unpermute)
           for a in zip(*map(split, args))]
    assert_bits_equal(rows, jnp.concatenate([r[1] for r in ref]))
    assert_close(out, jnp.concatenate([r[0] for r in ref]), jnp.float32)

    def loss(f):
        return lambda h, w: jnp.vdot(ct, f(h, w))
    got = jax.grad(loss(lambda h, w: forward(h, shard(ids), w, shard(maps))[0]), argnums=(0, 1))(
        shard(hidden), shard(weights))
    want = jax.grad(loss(lambda h, w: jnp.concatenate([
        layer(*a, permute=jmp.reference.moe_permute, unpermute=jmp.reference.moe_unpermute)[0]
        for a in zip(split(h), split(ids), split(w), split(maps))])), argnums=(0, 1))(hidden, weights)
    assert_trees_close(got, want)


@pytest.mark.parametrize("check_vma", [False, True])
def test_expert_mlp_in_shard_map_matches_dense(check_vma):
    """Data parallel (tokens sharded, every expert replicated): permute, two ragged_dots and
    unpermute per device, forward and gradients (weights' summed over devices) against the
    dense einsum reference."""
    E = 5
    hidden, ids, weights, w1, w2 = moe_inputs(E)
    forward = smap(lambda h, i, w, a, b: single_device_moe(h, i, w, a, b, E, align_size=4),
                   (P(AXIS), P(AXIS), P(AXIS), P(), P()), P(AXIS), check_vma)
    args = (hidden, ids, weights, w1, w2)
    sharded = tuple(map(shard, args[:3])) + args[3:]
    assert_close(forward(*sharded), dense_moe(*args, E), jnp.float32)
    ct = random_float(hidden.shape, jnp.float32)
    assert_trees_close(loss_and_grads(forward, sharded, ct),
                       loss_and_grads(lambda *a: dense_moe(*a, E), args, ct))


# ---- the same module on 4 and 8 CPU devices, and the example -------------------------------

def child_env(devices):
    """Environment for a fresh python whose jax sees `devices` CPU devices and imports this
    checkout's package (and conftest)."""
    here = os.path.dirname(os.path.abspath(__file__))
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(jmp.__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{CHILD_ENV: str(devices)})
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, here, env.get("PYTHONPATH")) if p)
    return env


@pytest.mark.skipif(bool(os.environ.get(CHILD_ENV)), reason="already inside a multi-device run")
def test_example_on_4_devices():
    example = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "expert_parallel.py")
    if not os.path.exists(example):
        pytest.skip("examples/ is not next to this tests folder (installed package)")
    result = subprocess.run([sys.executable, example], env=child_env(4), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert result.stdout.startswith("4 device(s), 2 experts each"), result.stdout


# ---- the same module on 4 and 8 CPU devices ---------------------------------------------

@pytest.mark.skipif(bool(os.environ.get(CHILD_ENV)), reason="already inside a multi-device run")
@pytest.mark.parametrize("devices", [4, 8])
def test_multidevice(devices):
    """Runs every test above in a fresh process whose jax sees `devices` CPU devices."""
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist",
           os.path.abspath(__file__)]
    result = subprocess.run(cmd, cwd=here, env=child_env(devices), capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]

