"""The few places where jax versions differ for us, kept in one module.

- Varying manual axes (shard_map's `check_vma`): jax 0.10 spells an aval's set of varying axes
  `aval.manual_axis_type.varying`, earlier releases `aval.vma`; `pcast(..., to="varying")`
  replaced `pvary`; explicit-sharding avals carry an output sharding.
- Partitioning our kernel calls (`custom_partitioning` inside a primitive's lowering) needs the
  device assignment at lowering time, which jax fixes only for primitives it knows need it.
- Flax NNX intermediates: flax 0.12.6 added `nnx.capture` and deprecated `Module.sow` outside it
  (a DeprecationWarning on every such call); earlier 0.12 releases have only that outside form,
  which stores sown values as module attributes.
"""

from __future__ import annotations

import jax
from jax import core
from jax.sharding import PartitionSpec


def varying_axes(aval) -> frozenset:
    """The manual mesh axes along which values of `aval` vary (empty outside shard_map)."""
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def shaped_like(avals, shape, dtype) -> core.ShapedArray:
    """An output aval of `shape` and `dtype` for a primitive whose operands are `avals`.

    It varies along every manual axis any operand varies along (the operands of one bind
    share that set: `pvary_to_match` makes them), and under explicit sharding it is sharded
    like the leading (batch) axis of the first operand of full batch extent, replicated on
    every other axis."""
    template = max(avals, key=lambda a: len(varying_axes(a)))
    if not hasattr(template, "manual_axis_type"):
        return core.ShapedArray(tuple(shape), dtype, vma=varying_axes(template))
    batched = next(a for a in avals if a.shape[0] == max(b.shape[0] for b in avals))
    spec = batched.sharding.spec
    lead = spec[0] if len(spec) else None
    sharding = template.sharding.update(spec=PartitionSpec(lead, *(None,) * (len(shape) - 1)))
    return template.update(shape=tuple(shape), dtype=dtype, weak_type=False, sharding=sharding)


def _pvary(x, axes):
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, tuple(axes), to="varying")
    return jax.lax.pvary(x, tuple(axes))


def pvary_to_match(*xs):
    """Marks each array varying along the union of all their varying manual axes, so that one
    primitive bind sees operands of equal type under shard_map(check_vma=True). Outside
    shard_map, and for arrays already varying along all of them, it returns them unchanged."""
    sets = [varying_axes(jax.typeof(x)) for x in xs]
    union = frozenset().union(*sets)
    return tuple(x if s == union else _pvary(x, sorted(union - s)) for x, s in zip(xs, sets))


def lowers_for_many_devices(ctx) -> bool:
    """Whether the computation a lowering rule emits into will be SPMD-partitioned over more
    than one device. `custom_partitioning` needs a known device assignment there, which a
    single-device jit of jax 0.10 does not fix at lowering time."""
    axis_context = getattr(ctx.module_context, "axis_context", None)
    num_devices = getattr(axis_context, "num_devices", None)
    if num_devices is not None:  # jit over a sharding context
        return num_devices > 1
    mesh = getattr(axis_context, "mesh", None)  # inside shard_map
    return mesh is not None and mesh.size > 1


def lowers_per_device(ctx) -> bool:
    """Whether every device runs the computation a lowering rule emits into as a program of its
    own, so that a custom call needs no partitioning rule: one device, or a shard_map manual over
    every axis of its mesh."""
    axis_context = getattr(ctx.module_context, "axis_context", None)
    mesh, manual = getattr(axis_context, "mesh", None), getattr(axis_context, "manual_axes", None)
    if mesh is not None and manual is not None:
        return set(mesh.axis_names) <= set(manual)
    return not lowers_for_many_devices(ctx)


def require_devices_at_lowering(*primitives) -> None:
    """Marks primitives whose lowering emits `custom_partitioning`: jax must then fix the
    device assignment before lowering, as it does for `custom_partitioning` itself (the
    outer/inner primitive pattern of Transformer Engine's JAX extension does the same).
    jax exposes no public hook for this."""
    try:
        from jax._src import dispatch
    except ImportError:  # pragma: no cover - a jax without it partitions no custom call of ours
        return
    registry = getattr(dispatch, "prim_requires_devices_during_lowering", None)
    if registry is not None:
        registry.update(primitives)


def nnx_sow(module, variable_type, name, value) -> None:
    """`module.sow(variable_type, name, value)` while `module` runs under `nnx.capture`, else nothing.

    `nnx.capture` (flax >= 0.12.6) gives each module it captures from a `__captures__` attribute,
    what `Module.sow` itself tests. Outside it a sow would warn (flax >= 0.12.6) and store the
    value as a module attribute, growing the model's state on every call (a jitted training
    step then retraces each step), so a plain call sows nothing. flax < 0.12.6 has no
    `nnx.capture`: nothing is ever sown there."""
    if hasattr(module, "__captures__"):
        module.sow(variable_type, name, value)
