"""The few places where jax versions differ for us, kept in one module.

Varying manual axes (shard_map's `check_vma`): jax 0.10 spells an aval's set of varying axes
`aval.manual_axis_type.varying`, earlier releases `aval.vma`; `pcast(..., to="varying")`
replaced `pvary`.
"""

from __future__ import annotations

import jax
from jax import core


def varying_axes(aval) -> frozenset:
    """The manual mesh axes along which values of `aval` vary (empty outside shard_map)."""
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def shaped_like(avals, shape, dtype) -> core.ShapedArray:
    """An output aval of `shape` and `dtype` varying along every axis any of `avals` varies
    along (the operands of one bind share that set: `pvary_to_match` makes them)."""
    template = max(avals, key=lambda a: len(varying_axes(a)))
    if hasattr(template, "manual_axis_type"):
        return template.update(shape=tuple(shape), dtype=dtype, weak_type=False)
    return core.ShapedArray(tuple(shape), dtype, vma=varying_axes(template))


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
