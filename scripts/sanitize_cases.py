"""Small cases for compute-sanitizer (scripts/sanitize.sh): invalid and duplicate ids, T=0,
odd H, expert_map, align_size, every permute path (warp-routed, counted, ranked in one launch,
tiled, radix sort), forward and backward, unpermute's backward on a row map with shared
rows, unpermute with a residual, the router kernel (each scoring, T=0/1, odd E, groups, K=E,
vmap). route_tokens' fused kernel: scripts/sanitize_router_cases.py."""

import jax
import jax.numpy as jnp
import numpy as np

import jax_moe_permute as jmp


def run(T, H, E, K, dtype=jnp.bfloat16, with_map=False, align_size=1, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    hidden = jax.random.normal(k[0], (T, H)).astype(dtype)
    ids = jax.random.randint(k[1], (T, K), -2, E + 2)  # invalid ids and duplicates
    weights = jax.random.uniform(k[2], (T, K))
    L = max(1, E // 2)
    expert_map = jnp.where(jax.random.uniform(k[3], (E,)) < 0.5, -1, jnp.arange(E) % L) if with_map else None

    def forward(h, w):
        res = jmp.moe_permute(h, ids, E, expert_map=expert_map, num_local_experts=L if with_map else None,
                              align_size=align_size)
        return jmp.moe_unpermute(res.hidden, res.row_map, w, out_dtype=jnp.float32), res

    def backward(h, w, ct):
        _, pullback = jax.vjp(lambda a, b: forward(a, b)[0], h, w)
        return pullback(ct)

    out, res = jax.jit(forward)(hidden, weights)
    grads = jax.jit(backward)(hidden, weights, jax.random.normal(k[3], out.shape))
    # Host copies of our kernels' outputs only: initcheck flags every uninitialised byte read.
    arrays = [np.asarray(x) for x in (out, *res, *grads)]
    return [a.shape for a in arrays]


CASES = [
    dict(T=0, H=8, E=4, K=2),
    dict(T=1, H=7, E=3, K=8),
    dict(T=4, H=4096, E=16, K=8, with_map=True),  # 32 entries routed by one warp, unused rows
    dict(T=60, H=1030, E=40, K=6, with_map=True),  # up to 2048 entries: rows counted by each block
    dict(T=37, H=33, E=5, K=3, align_size=4),
    dict(T=64, H=64, E=16, K=4, with_map=True, align_size=8),
    dict(T=700, H=24, E=64, K=4, with_map=True),  # more than 2048 entries: the tiled sort
    dict(T=1024, H=8, E=512, K=8, align_size=2),  # larger tiles, several per offsets thread; 16-byte rows
    dict(T=700, H=1, E=64, K=4, with_map=True, dtype=jnp.float32),  # tiled, 4-byte rows: a thread per entry
    dict(T=300, H=8, E=2100, K=8, align_size=2),  # more than 1023 local experts: the radix sort
    dict(T=600, H=16, E=8, K=6, align_size=16, dtype=jnp.float32),
    dict(T=9, H=1, E=2, K=3, dtype=jnp.float16),
    dict(T=5, H=40, E=6, K=2),  # unpermute of K <= 2 on a small grid
]

def run_shared_rows(T=40, R=30, H=24, K=3):
    """unpermute's backward on a row map with shared, empty and invalid rows."""
    k = jax.random.split(jax.random.PRNGKey(3), 4)
    x, w = jax.random.normal(k[0], (R, H)).astype(jnp.bfloat16), jax.random.uniform(k[1], (T, K))
    rm = jax.random.randint(k[2], (T, K), -2, R + 2)
    ct = jax.random.normal(k[3], (T, H))
    grads = jax.jit(jax.grad(lambda a, b: jnp.vdot(ct, jmp.moe_unpermute(a, rm, b, out_dtype=jnp.float32)),
                             argnums=(0, 1)))(x, w)
    return [np.asarray(g).shape for g in grads]


def run_residual(T, H, K, R, dtype=jnp.bfloat16, batch=None):
    """unpermute with a residual in its launch (unpermute_add); under vmap with an unbatched residual."""
    k = jax.random.split(jax.random.PRNGKey(T + H), 4)
    lead = () if batch is None else (batch,)
    x = jax.random.normal(k[0], lead + (R, H)).astype(dtype)
    rm = jax.random.randint(k[1], lead + (T, K), -1, R + 1)
    w = jax.random.uniform(k[2], lead + (T, K))
    residual = jax.random.normal(k[3], (T, H)).astype(dtype)
    op = lambda a, m, b: jmp.moe_unpermute(a, m, b, residual=residual)
    out = jax.jit(op if batch is None else jax.vmap(op))(x, rm, w)
    return np.asarray(out).shape


def run_router(T, E, K, dtype=jnp.float32, seed=0, **kw):
    """route's kernel forward and its gradient (the JVP is jnp; the forward runs the kernel again)."""
    k = jax.random.split(jax.random.PRNGKey(seed), 2)
    logits = (jax.random.normal(k[0], (T, E)) * 2).astype(dtype)
    if kw.pop("with_bias", False):
        kw["bias"] = jax.random.normal(k[1], (E,)) * 0.3
    r = jax.jit(lambda z: jmp.route(z, K, **kw)[:2])(logits)
    grad = jax.jit(jax.grad(lambda z: jnp.sum(jmp.route(z, K, **kw).weights ** 2)))(logits)
    return [np.asarray(x).shape for x in (*r, grad)]


ROUTER_CASES = [
    dict(T=0, E=8, K=2),
    dict(T=1, E=7, K=3, scoring="sigmoid"),
    dict(T=33, E=129, K=129, dtype=jnp.bfloat16),  # K = E, five experts per lane
    dict(T=9, E=60, K=6, scoring="sigmoid", with_bias=True, renormalize=False, routed_scaling_factor=2.5),
    dict(T=70, E=256, K=8, scoring="sigmoid", with_bias=True, num_groups=8, topk_groups=4),  # DeepSeek-V3
    dict(T=5, E=1024, K=3, dtype=jnp.float16, num_groups=1024, topk_groups=3),  # largest E and staging
]


if __name__ == "__main__":
    for case in CASES:
        print(case, run(**case))
    print("shared rows", run_shared_rows())
    print("shared rows, one launch, 2 groups of entries", run_shared_rows(H=1000, K=10))
    print("shared rows, token pass, 2 groups of entries", run_shared_rows(T=260, R=3000, H=1000, K=10))
    # vmapped: one launch for the batch
    h = jax.random.normal(jax.random.PRNGKey(1), (3, 20, 16)).astype(jnp.bfloat16)
    ids = jax.random.randint(jax.random.PRNGKey(2), (3, 20, 2), -1, 9)
    for align in (1, 4):
        vmapped = jax.jit(jax.vmap(lambda a, i: jmp.moe_permute(a, i, 8, align_size=align)))
        jax.block_until_ready(vmapped(h, ids))
        jax.block_until_ready(vmapped(h[:, :3], ids[:, :3]))
    for case in [dict(T=5, H=40, K=2, R=9), dict(T=700, H=24, K=4, R=2800), dict(T=33, H=7, K=3, R=50, dtype=jnp.float16),
                 dict(T=70, H=64, K=8, R=500, batch=3)]:
        print("residual", case, run_residual(**case))
    for case in ROUTER_CASES:
        print("router", case, run_router(**case))
    vmapped_router = jax.jit(jax.vmap(lambda z, b: jmp.route(z, 2, scoring="sigmoid", bias=b)[:2]))
    jax.block_until_ready(vmapped_router(jax.random.normal(jax.random.PRNGKey(4), (3, 11, 12)),
                                         jax.random.normal(jax.random.PRNGKey(5), (3, 12))))
    print("SANITIZE CASES DONE")
