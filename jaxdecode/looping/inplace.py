"""The in-place interpreter: a looped run's body reads its stacked inputs in place (`stacked_dot=fn`).

In `index_mode="whole"` a scan body receives whole `[L, ...]` stacks and the layer index `i`. The
plain body takes row `i` of every stack with `dynamic_index_in_dim` and calls the layer; on a GPU
XLA then copies each weight matrix out of its stack before the matmul (an extra read and write of
every weight per token). This module instead evaluates the layer's jaxpr with a small interpreter
in which a stacked input is a lazy `StackedRef(stack, i)`:

- the rhs of a `dot_general` with a plain contraction (`[..., K] x [K, N]`, no batch dimensions)
  goes to the hook, `stacked_dot(x [M, K], stack [L, K, N], i, out_dtype) -> y [M, N] | None`,
  which can read `stack[i]` in place (e.g. `kernels.flat_gemm(x, stack, i)`); `None` means "no
  kernel for this one", and the dot runs as written on the materialized row;
- a `dynamic_update_slice` or a `scatter` (what `vmap` makes of a per-sequence update) into a row
  of a stack held in the scan carry (a KV cache) writes into the stack at `[i, ...]`, so the update
  stays in place and the row is never copied out and back;
- a call (`jit`) named in `stacked_calls` goes to its hook, `hook(*args) -> outputs | None`, whose
  arguments keep their refs (e.g. the model's `sdpa` to `kernels.decode_attention` with the
  stacked cache and the layer index); `None` means "evaluate the call as written". A hook that
  writes a carried stack returns `StackedRef(new stack, i, origin)` for it (the model's `qkv_attend`:
  the epilogue kernel writes the new cache rows);
- other calls that receive a ref are evaluated inline by the same interpreter, so a weight
  passed through a helper function still reaches its dot;
- any other consumer materializes the row once with `lax.dynamic_index_in_dim` (norm weights,
  biases);
- a `stacked_dot` hook may return a `SplitSum` (a GEMM's split-K partial sums, not yet added): a
  hook marked with `takes_split_sums` gets it and sums the partials inside its own kernel (the o
  projection's into the residual add and norm, `hooks.kernel_split_residual_norm`); every
  other consumer gets the sum.

Nothing is bound with hand-built params: each equation is re-bound with its own primitive and
params, and the replacements are public `lax` calls or the hook.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.extend import core as jcore

from jaxdecode.looping.find import callee_name, callee_of, side_effects

# stacked_dot(x [M, K], stack [L, K, N], index int32[], out_dtype) -> y [M, N] of out_dtype (or a `SplitSum`
# of it), or None
StackedDot = Callable[[jax.Array, jax.Array, jax.Array, Any], "jax.Array | None"]
# stacked_calls[name](*args) -> the call's outputs (a list), or None; args may be `StackedRef`s
StackedCall = Callable[..., "list[jax.Array] | None"]


class StackedRef:
    """Row `index` of `stack` [L, ...], not yet read. `origin` names the carried stack it updates."""

    __slots__ = ("stack", "index", "origin")

    def __init__(self, stack, index, origin=None):
        self.stack, self.index, self.origin = stack, index, origin

    @property
    def aval(self):
        return jax.ShapeDtypeStruct(self.stack.shape[1:], self.stack.dtype)


class SplitSum:
    """Σ over axis 0 of `partials` [splits, M, N] f32, rounded to `dtype` and shaped `shape`: a GEMM's
    output whose split-K partial sums are not yet added. `value()` adds them (once)."""

    __slots__ = ("partials", "shape", "dtype", "_value")

    def __init__(self, partials, shape, dtype):
        if partials.ndim != 3 or int(np.prod(shape, dtype=int)) != partials.shape[1] * partials.shape[2]:
            raise ValueError(f"SplitSum takes partials [splits, M, N] of the output {shape}, got {partials.shape}")
        self.partials, self.shape, self.dtype, self._value = partials, tuple(shape), np.dtype(dtype), None

    @property
    def aval(self):
        return jax.ShapeDtypeStruct(self.shape, self.dtype)

    def reshaped(self, shape) -> SplitSum:
        return SplitSum(self.partials, shape, self.dtype)

    def value(self):
        if self._value is None:
            self._value = self.partials.sum(axis=0).astype(self.dtype).reshape(self.shape)  # [*shape]
        return self._value


_LAZY = (StackedRef, SplitSum)


def takes_split_sums(hook: StackedCall) -> StackedCall:
    """Marks a hook that takes `SplitSum` arguments; every other hook gets their sums."""
    hook.takes_split_sums = True
    return hook


def _takes_split_sums(hook) -> bool:
    return getattr(hook, "takes_split_sums", False) or getattr(getattr(hook, "func", None), "takes_split_sums", False)


def outside_runs(hook: StackedCall) -> StackedCall:
    """Marks a hook that is also offered the calls outside the looped runs, with plain arrays (the
    output projection after the layers, say); it returns None for those it leaves as written."""
    hook.outside_runs = True
    return hook


def takes_outside_runs(hook) -> bool:
    return getattr(hook, "outside_runs", False) or getattr(getattr(hook, "func", None), "outside_runs", False)


def plain_contraction(eqn: jcore.JaxprEqn) -> bool:
    """`eqn` is `dot_general` of lhs [..., K] with rhs [K, N]: the shape of `x @ W`."""
    if eqn.primitive.name != "dot_general":
        return False
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = (v.aval for v in eqn.invars)
    return not lb and not rb and rhs.ndim == 2 and tuple(rc) == (0,) and tuple(lc) == (lhs.ndim - 1,) and lhs.ndim >= 1


class RefEvaluator:
    """Evaluates one layer's jaxpr with some inputs given as `StackedRef`s (one per scan step).

    `bind(eqn, args)` binds an equation with its own params under the equation's context, and
    `context(eqn)` re-enters that context (the rewrite interpreter supplies both). `latest[origin]`
    is the newest version of each carried stack.
    """

    def __init__(
        self,
        stacked_dot: StackedDot,
        bind: Callable,
        context: Callable,
        stacked_calls: Mapping[str, StackedCall] | None = None,
    ):
        self.stacked_dot, self._bind, self._context = stacked_dot, bind, context
        self.stacked_calls = dict(stacked_calls or {})
        self.latest: dict[Any, Any] = {}
        self._rows: dict[int, Any] = {}

    def row(self, value):
        """A value itself; for a ref, its row (read once per ref and cached); for a `SplitSum`, the sum."""
        if isinstance(value, SplitSum):
            return value.value()
        if not isinstance(value, StackedRef):
            return value
        if id(value) not in self._rows:
            self._rows[id(value)] = (value, lax.dynamic_index_in_dim(value.stack, value.index, keepdims=False))
        return self._rows[id(value)][1]

    def eval(self, jaxpr: jcore.Jaxpr, args: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = dict(zip(jaxpr.all_invars, [*jaxpr.consts, *args]))

        def read(atom):
            return atom.val if isinstance(atom, jcore.Literal) else env[atom]

        for eqn in jaxpr.eqns:
            invals = [read(a) for a in eqn.invars]
            if not any(isinstance(v, _LAZY) for v in invals):
                outs = self._bind(eqn, invals)
            else:
                outs = self._eval_with_refs(eqn, invals)
            env.update(zip(eqn.outvars, outs))
        return [read(a) for a in jaxpr.outvars]

    def _eval_with_refs(self, eqn: jcore.JaxprEqn, invals: list[Any]) -> list[Any]:
        callee = callee_of(eqn)
        if callee is not None and not side_effects(eqn):
            hook = self.stacked_calls.get(callee_name(eqn))
            with self._context(eqn):
                args = (
                    invals
                    if hook is None or _takes_split_sums(hook)
                    else [self.row(v) if isinstance(v, SplitSum) else v for v in invals]
                )
                outs = hook(*args) if hook is not None else None
                if outs is not None:
                    for out in outs:  # a hook that wrote a carried stack in place hands back its ref
                        if isinstance(out, StackedRef) and out.origin is not None:
                            self.latest[out.origin] = out.stack
                    return list(outs)
                return self.eval(callee, invals)  # look through the call: refs reach its dots
        invals = [self.row(v) if isinstance(v, SplitSum) else v for v in invals]  # only hooks take them
        if not any(isinstance(v, StackedRef) for v in invals):
            return self._bind(eqn, invals)
        if plain_contraction(eqn) and isinstance(invals[1], StackedRef) and not isinstance(invals[0], StackedRef):
            y = self._dot(eqn, invals[0], invals[1])
            if y is not None:
                return [y]
        if (
            isinstance(invals[0], StackedRef)
            and invals[0].origin is not None
            and not any(isinstance(v, StackedRef) for v in invals[1:])
        ):
            if eqn.primitive.name == "dynamic_update_slice":
                return [self._update(eqn, invals[0], invals[1], invals[2:])]
            if eqn.primitive.name == "scatter" and eqn.params.get("update_jaxpr") is None:
                return [self._scatter(eqn, invals[0], *invals[1:])]
        return self._bind(eqn, [self.row(v) for v in invals])

    def _dot(self, eqn: jcore.JaxprEqn, x, ref: StackedRef):
        out = eqn.outvars[0].aval
        k, n = ref.stack.shape[1:]
        lead = x.shape[:-1]  # [...]
        with self._context(eqn):
            y = self.stacked_dot(x.reshape(int(np.prod(lead, dtype=int)), k), ref.stack, ref.index, out.dtype)
            if y is None:
                return None
            if isinstance(y, SplitSum) and y.dtype == out.dtype:
                return y.reshaped((*lead, n))  # [..., N], still unsummed
            return self.row(y).astype(out.dtype).reshape(*lead, n)  # [..., N]

    def _update(self, eqn: jcore.JaxprEqn, ref: StackedRef, update, starts):
        """dynamic_update_slice(row i, update, starts) as an in-place write into the carried stack."""
        with self._context(eqn):
            zero = lax.convert_element_type(0, lax.dtype(starts[0]) if starts else np.int32)
            idx = (lax.convert_element_type(ref.index, zero.dtype), *starts)
            stack = lax.dynamic_update_slice(ref.stack, update[None], idx)  # [L, ...]
        new = StackedRef(stack, ref.index, ref.origin)
        self.latest[ref.origin] = stack
        return new

    def _scatter(self, eqn: jcore.JaxprEqn, ref: StackedRef, indices, updates):
        """scatter(row i, indices, updates) as a scatter into the carried stack [L, ...].

        The stack's leading axis becomes one more scattered (inserted) dimension whose index is
        i for every update: the index vectors gain i in front, every operand axis shifts by one.
        """
        dn = eqn.params["dimension_numbers"]
        with self._context(eqn):
            layer = lax.convert_element_type(ref.index, indices.dtype)
            lead = lax.broadcast_in_dim(layer, (*indices.shape[:-1], 1), ())
            indices = lax.concatenate([lead, indices], indices.ndim - 1)  # [..., 1 + index vector]
            shift = lambda dims: tuple(int(d) + 1 for d in dims)  # noqa: E731
            lifted = lax.ScatterDimensionNumbers(
                update_window_dims=tuple(dn.update_window_dims),
                inserted_window_dims=(0, *shift(dn.inserted_window_dims)),
                scatter_dims_to_operand_dims=(0, *shift(dn.scatter_dims_to_operand_dims)),
                operand_batching_dims=shift(dn.operand_batching_dims),
                scatter_indices_batching_dims=tuple(dn.scatter_indices_batching_dims),
            )
            stack = lax.scatter(
                ref.stack,
                indices,
                updates,
                lifted,
                indices_are_sorted=eqn.params["indices_are_sorted"],
                unique_indices=eqn.params["unique_indices"],
                mode=eqn.params["mode"],
            )
        self.latest[ref.origin] = stack
        return StackedRef(stack, ref.index, ref.origin)

    def write_back(self, origin, value):
        """The carried stack `origin` after the step, with row i holding `value`."""
        stack = self.latest[origin]
        if isinstance(value, StackedRef) and value.origin == origin and value.stack is stack:
            return stack  # updated in place already
        return lax.dynamic_update_index_in_dim(stack, self.row(value), self._index, 0)

    def start(self, stacks: dict[Any, Any], index) -> None:
        """Begin a scan step: `stacks` are the carried stacks by origin, `index` the layer index."""
        self.latest, self._rows, self._index = dict(stacks), {}, index


def output_aliases(callee: jcore.Jaxpr, stacked: Sequence[int], ys: Sequence[int]) -> dict[int, int]:
    """{stacked input position: per-call output position} pairs that can share one carried stack.

    An output aliases a stacked input when it has the same shape and dtype and depends on it (a
    KV cache in, the updated cache out). Row i of the carried stack is read before it is written
    and no step touches another row, so after the scan the stack holds every call's output.
    """
    deps: dict[Any, set[int]] = {v: {p} for p, v in enumerate(callee.invars)}
    for eqn in callee.eqns:
        d = set().union(*(deps.get(a, set()) for a in eqn.invars if not isinstance(a, jcore.Literal)))
        deps.update((o, d) for o in eqn.outvars)
    aliases, taken = {}, set()
    for j in ys:
        out = callee.outvars[j]
        if isinstance(out, jcore.Literal):
            continue
        for p in stacked:
            a, b = callee.invars[p].aval, out.aval
            if p not in taken and p in deps.get(out, ()) and a.shape == b.shape and a.dtype == b.dtype:
                aliases[p] = j
                taken.add(p)
                break
    return aliases
