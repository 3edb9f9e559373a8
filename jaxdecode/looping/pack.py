"""Stacks and their rows: `Packed` arguments (per-layer leaves stacked once to `[L, ...]`), their
`PackLayout`, and `LazyRow`, a row of a stack not yet sliced so that a run can take the whole stack."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import source_info_util  # private: public jax cannot set an equation's name stack


class LazyRow:
    """Row `index` of a stacked `[L, ...]` array, kept lazy so a run can take the whole stack."""

    __slots__ = ("stack", "index", "name_stack")

    def __init__(self, stack, index: int, name_stack=None):
        self.stack, self.index, self.name_stack = stack, index, name_stack


def materialize(value):
    """A value itself; for a `LazyRow`, its row, sliced under the scope of the run that made it."""
    if not isinstance(value, LazyRow):
        return value
    if value.name_stack is None:
        return lax.index_in_dim(value.stack, value.index, keepdims=False)
    name_stack = source_info_util.current_name_stack() + value.name_stack
    with source_info_util.user_context(None, name_stack=name_stack):
        return lax.index_in_dim(value.stack, value.index, keepdims=False)


def as_stack(values: list[Any]):
    """The `[n, ...]` stack of `values`; free when they are rows 0..n-1 of one stack."""
    first = values[0]
    if (
        isinstance(first, LazyRow)
        and first.stack.shape[0] == len(values)
        and all(isinstance(v, LazyRow) and v.stack is first.stack and v.index == k for k, v in enumerate(values))
    ):
        return first.stack
    return jnp.stack([materialize(v) for v in values])


def stack_spec(specs):
    """The `jax.ShapeDtypeStruct` of the `[n, ...]` stack of `specs` (what `jnp.stack` would give)."""
    return jax.ShapeDtypeStruct((len(specs), *specs[0].shape), specs[0].dtype)


@dataclasses.dataclass(frozen=True)
class PackLayout:
    """How one argument's leaves are packed: `groups[g]` are the leaf indices stacked into stack g."""

    treedef: Any
    groups: tuple[tuple[int, ...], ...]
    rest: tuple[int, ...]  # leaf indices passed through unchanged


@jax.tree_util.register_pytree_node_class
class Packed:
    """An argument (or output) with its per-layer leaves stacked: `stacks[g]` is `[L, ...]`."""

    def __init__(self, stacks: tuple, rest: tuple, layout: PackLayout):
        self.stacks, self.rest, self.layout = tuple(stacks), tuple(rest), layout

    def tree_flatten(self):
        return (self.stacks, self.rest), self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        return cls(*children, layout)

    @classmethod
    def pack(cls, tree, layout: PackLayout, stack=jnp.stack) -> Packed:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if treedef != layout.treedef:
            raise ValueError(f"cannot pack: tree structure {treedef} differs from the plan's {layout.treedef}")
        return cls([stack([leaves[i] for i in g]) for g in layout.groups], [leaves[i] for i in layout.rest], layout)

    def leaves(self, lazy: bool = False) -> list[Any]:
        """The per-layer leaves in the original order; with `lazy`, stacked ones as `LazyRow`s."""
        out: list[Any] = [None] * (sum(map(len, self.layout.groups)) + len(self.layout.rest))
        for stack, group in zip(self.stacks, self.layout.groups):
            for k, i in enumerate(group):
                out[i] = LazyRow(stack, k) if lazy else stack[k]
        for value, i in zip(self.rest, self.layout.rest):
            out[i] = value
        return out

    def unpack(self):
        """The original pytree (each stack split into its per-layer leaves)."""
        return jax.tree_util.tree_unflatten(self.layout.treedef, self.leaves())
