"""`kernel_loop` and `LoopPlan`: analyse a function once, then pack its arguments and run it looped.

The plan ties the other modules together: `find.Analysis` finds the runs, the plan decides which
per-layer leaves `pack` stacks into `Packed` arguments, `rewrite.Interpreter` evaluates the looped
function, and `report` describes the result. The rules are in the `jaxdecode.looping` docstring
and docs/looping.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.extend import core as jcore

from jaxdecode.looping.find import Analysis, Run, callee_of, side_effects
from jaxdecode.looping.inplace import StackedCall, StackedDot
from jaxdecode.looping.pack import Packed, PackLayout, as_stack, materialize, stack_spec
from jaxdecode.looping.report import InputReport, LoopReport, RunReport, aval_str
from jaxdecode.looping.rewrite import Interpreter

INDEX_MODES = ("slice", "whole")


def layer(fn: Callable | None = None, *, static_argnums=(), static_argnames=()):
    """Mark `fn` as a layer: a call boundary the pass can see (it is `jax.jit`, never inlined)."""
    if fn is None:
        return functools.partial(layer, static_argnums=static_argnums, static_argnames=static_argnames)
    return jax.jit(fn, static_argnums=static_argnums, static_argnames=static_argnames)


def _peel(jaxpr: jcore.Jaxpr) -> jcore.Jaxpr:
    """Look through jit calls that wrap the whole function (`kernel_loop(jax.jit(step), ...)`)."""
    while (
        len(jaxpr.eqns) == 1
        and not jaxpr.consts
        and jaxpr.eqns[0].primitive.name == "jit"
        and callee_of(jaxpr.eqns[0]) is not None
        and not side_effects(jaxpr.eqns[0])
        and list(jaxpr.eqns[0].invars) == list(jaxpr.invars)
        and list(jaxpr.eqns[0].outvars) == list(jaxpr.outvars)
    ):
        jaxpr = jaxpr.eqns[0].params["jaxpr"]
    return jaxpr


def _labels(jaxpr: jcore.Jaxpr, names: str, count: int, default: str) -> list[str]:
    found = getattr(jaxpr.debug_info, names, None)
    return list(found) if found and len(found) == count else [f"{default}{i}" for i in range(count)]


class LoopPlan:
    """The looped version of a function, how its arguments are packed, and a report.

    Attributes:
      report: `LoopReport`; `str(report)` is the text `jaxdecode loop-report` prints.
      layouts: argnum -> `PackLayout` for each packed argument.
      packed_outputs: out_index -> argnum whose layout that output subtree is packed with.
    """

    def __init__(
        self,
        fn: Callable,
        args: tuple,
        index_mode: str,
        packed_argnums: tuple[int, ...] | None,
        packed_outputs: Mapping[int, int],
        stacked_dot: StackedDot | None = None,
        stacked_calls: Mapping[str, StackedCall] | None = None,
        lone_calls: bool | None = None,
    ):
        if index_mode not in INDEX_MODES:
            raise ValueError(f"index_mode must be one of {INDEX_MODES}, got {index_mode!r}")
        if stacked_dot is not None and index_mode != "whole":
            raise ValueError('stacked_dot needs index_mode="whole" (the body must see whole stacks)')
        self.index_mode = index_mode
        self.in_place = stacked_dot is not None
        self._arg_trees = [jax.tree_util.tree_structure(a) for a in args]
        jaxpr, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        self.original_jaxpr = jaxpr
        self._out_shape = out_shape
        self._root = _peel(jaxpr)
        self._analysis = Analysis(lone_calls=self.in_place if lone_calls is None else lone_calls)
        self._analysis.analyze(self._root, getattr(fn, "__name__", "fn"))
        self._interp = Interpreter(self._analysis, index_mode, stacked_dot, stacked_calls)
        self._specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in self._root.in_avals]
        offsets = [0]
        for tree in self._arg_trees:
            offsets.append(offsets[-1] + tree.num_leaves)
        self._arg_offsets = offsets
        self.layouts = self._plan_packing(packed_argnums)
        self.packed_outputs = dict(packed_outputs)
        notes = self._check_packed_outputs()
        self.report = LoopReport(
            [self._run_report(r, w) for r, w in self._analysis.runs()], list(self._analysis.skips), index_mode, notes
        )

    # --- packing -----------------------------------------------------------------------------------
    def _arg_of(self, leaf: int) -> tuple[int, int]:
        for a in range(len(self._arg_trees)):
            if leaf < self._arg_offsets[a + 1]:
                return a, leaf - self._arg_offsets[a]
        raise IndexError(leaf)

    def _plan_packing(self, packed_argnums) -> dict[int, PackLayout]:
        """Group the top-level leaves that root-level runs read per call into stacks."""
        leaf_of = {v: i for i, v in enumerate(self._root.invars)}
        groups: dict[int, list[tuple[int, ...]]] = {}
        used: set[int] = set()
        self._packed_inputs: dict[tuple[int, int], int] = {}  # (id(run), position) -> argnum
        for run in self._analysis.levels[id(self._root)][2]:
            for p in run.stacked:
                leaves = [leaf_of.get(eqn.invars[p]) for eqn in run.calls]
                if None in leaves or len(set(leaves)) < len(leaves) or used & set(leaves):
                    continue
                where = [self._arg_of(i) for i in leaves]
                argnum = where[0][0]
                if any(a != argnum for a, _ in where) or (packed_argnums is not None and argnum not in packed_argnums):
                    continue
                groups.setdefault(argnum, []).append(tuple(i for _, i in where))
                used.update(leaves)
                self._packed_inputs[(id(run), p)] = argnum
        layouts = {}
        for argnum, gs in sorted(groups.items()):
            grouped = {i for g in gs for i in g}
            rest = tuple(i for i in range(self._arg_trees[argnum].num_leaves) if i not in grouped)
            layouts[argnum] = PackLayout(self._arg_trees[argnum], tuple(gs), rest)
        return layouts

    def _out_offsets(self) -> list[int]:
        if not isinstance(self._out_shape, (tuple, list)):
            raise ValueError("packed_outputs needs a function that returns a tuple or list")
        offsets = [0]
        for out in self._out_shape:
            offsets.append(offsets[-1] + len(jax.tree_util.tree_leaves(out)))
        return offsets

    def _check_packed_outputs(self) -> list[str]:
        notes = [
            f"argument {a}: {len(l.groups)} stack(s) of {len(l.groups[0])} leaves packed, "
            f"{len(l.rest)} leaves passed through"
            for a, l in self.layouts.items()
        ]
        if not self.packed_outputs or not self.layouts:  # no run of equal calls: nothing is packed
            return notes
        offsets = self._out_offsets()
        from_run = {}  # root outvar -> (run, output position, call number)
        for run in self._analysis.levels[id(self._root)][2]:
            for k, eqn in enumerate(run.calls):
                from_run.update((eqn.outvars[j], (id(run), j, k)) for j in run.ys)
        for o, argnum in self.packed_outputs.items():
            layout = self.layouts.get(argnum)
            tree = jax.tree_util.tree_structure(self._out_shape[o])
            if layout is None or tree != layout.treedef:
                raise ValueError(
                    f"output {o} cannot be packed like argument {argnum}: "
                    + (
                        "that argument is not packed"
                        if layout is None
                        else f"structure {tree} differs from {layout.treedef}"
                    )
                )
            outvars = self._root.outvars[offsets[o] : offsets[o + 1]]
            for g, group in enumerate(layout.groups):
                srcs = [from_run.get(outvars[i]) for i in group]
                direct = (
                    None not in srcs and len({s[:2] for s in srcs}) == 1 and all(s[2] == k for k, s in enumerate(srcs))
                )
                notes.append(
                    f"output {o} stack {g}: "
                    + ("the scan's stacked output (no copy)" if direct else "restacked inside the function (a copy)")
                )
        return notes

    def pack(self, *args) -> tuple:
        """`args` with each packed argument replaced by its `Packed` form (stacks built once)."""
        return tuple(Packed.pack(a, self.layouts[i]) if i in self.layouts else a for i, a in enumerate(args))

    def packed_shapes(self) -> tuple:
        """`pack` applied to the traced argument shapes (`jax.ShapeDtypeStruct` leaves)."""
        specs = (
            self._specs
            if self._root is self.original_jaxpr
            else [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in self.original_jaxpr.in_avals]
        )
        args = [
            jax.tree_util.tree_unflatten(t, specs[self._arg_offsets[i] : self._arg_offsets[i + 1]])
            for i, t in enumerate(self._arg_trees)
        ]
        return tuple(
            Packed.pack(a, self.layouts[i], stack_spec) if i in self.layouts else a for i, a in enumerate(args)
        )

    # --- the looped function -----------------------------------------------------------------------
    def looped(self, *args):
        """The function with its runs looped; packed arguments must come from `pack`."""
        if len(args) != len(self._arg_trees):
            raise TypeError(f"expected {len(self._arg_trees)} arguments, got {len(args)}")
        flat: list[Any] = []
        for i, arg in enumerate(args):
            if i in self.layouts:
                if not isinstance(arg, Packed):
                    raise TypeError(f"argument {i} must be packed: pass plan.pack(...)[{i}]")
                flat += arg.leaves(lazy=True)
            else:
                flat += jax.tree_util.tree_leaves(arg)
        outs = self._interp.eval(self._root, flat)
        if not self.packed_outputs:
            return jax.tree_util.tree_unflatten(
                jax.tree_util.tree_structure(self._out_shape), [materialize(x) for x in outs]
            )
        offsets, result = self._out_offsets(), []
        for o, shape in enumerate(self._out_shape):
            leaves = outs[offsets[o] : offsets[o + 1]]
            argnum = self.packed_outputs.get(o)
            if argnum is None:
                result.append(
                    jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), [materialize(x) for x in leaves])
                )
            else:
                layout = self.layouts[argnum]
                result.append(
                    Packed(
                        [as_stack([leaves[i] for i in g]) for g in layout.groups],
                        [materialize(leaves[i]) for i in layout.rest],
                        layout,
                    )
                )
        return type(self._out_shape)(result)

    def unpack_outputs(self, outputs):
        """`looped`'s outputs in the original function's structure (packed outputs unpacked)."""
        if not self.packed_outputs:
            return outputs
        return type(outputs)(o.unpack() if isinstance(o, Packed) else o for o in outputs)

    @functools.cached_property
    def jaxpr(self) -> jcore.Jaxpr:
        """The jaxpr of `looped` on the packed argument shapes."""
        return jax.make_jaxpr(self.looped)(*self.packed_shapes())

    # --- report ------------------------------------------------------------------------------------
    def _run_report(self, run: Run, where: str) -> RunReport:
        callee = run.calls[0].params["jaxpr"]
        in_labels = _labels(callee, "arg_names", len(callee.invars), "in")
        out_labels = _labels(callee, "result_paths", len(callee.outvars), "out")
        at_root = any(r is run for r in self._analysis.levels[id(self._root)][2])
        inputs = []
        for p, (label, aval) in enumerate(zip(in_labels, callee.in_avals)):
            if p in run.carry:
                kind, source = "carried", f"from output {run.carry[p]} ({out_labels[run.carry[p]]})"
            elif p in run.shared:
                kind, source = "shared", "closed over by the scan body"
            else:
                kind = "stacked"
                argnum = self._packed_inputs.get((id(run), p))
                source = (
                    f"packed: argument {argnum}"
                    if argnum is not None
                    else "stacked inside the function ("
                    + ("computed inside it or argument not packed)" if at_root else "run is nested)")
                )
                if self.in_place:
                    source += "; body reads row i in place (dots via stacked_dot)"
                elif self.index_mode == "whole":
                    source += "; body takes row i with dynamic_index_in_dim"
            inputs.append(InputReport(p, label, aval_str(aval), kind, source))
        outputs = []
        for j, (label, aval) in enumerate(zip(out_labels, callee.out_avals)):
            carried_into = [p for p, jj in run.carry.items() if jj == j]
            parts = [f"carried into input {carried_into[0]}"] if carried_into else []
            if j in run.ys:
                parts.append(f"per call, stacked [{run.length},...]")
            outputs.append(f"out{j:<3d} {label:40s} {aval_str(aval):16s} " + (", ".join(parts) or "unused"))
        scope = "/".join(s for s in (str(run.name_stack), run.body_scope) if s)
        return RunReport(
            str(run.calls[0].params.get("name", run.calls[0].primitive.name)),
            run.length,
            where,
            scope,
            inputs,
            outputs,
            len(run.hoisted),
            len(run.sunk),
        )


def kernel_loop(
    fn: Callable,
    *args,
    index_mode: str = "slice",
    packed_argnums: tuple[int, ...] | None = None,
    packed_outputs: Mapping[int, int] | None = None,
    stacked_dot: StackedDot | None = None,
    stacked_calls: Mapping[str, StackedCall] | None = None,
    lone_calls: bool | None = None,
) -> LoopPlan:
    """Analyse `fn` at `args` (arrays or `jax.ShapeDtypeStruct`s) and plan its kernel looping.

    Args:
      fn: the function; its layers must be calls (see the module docstring).
      *args: example arguments or their shapes; `fn` is traced once with `jax.make_jaxpr`.
      index_mode: "slice" (the scan slices stacked inputs) or "whole" (the body receives whole
        `[L, ...]` stacks plus the layer index and takes its row with `dynamic_index_in_dim`).
      packed_argnums: arguments whose per-layer leaves `pack` stacks; default all that have some.
      packed_outputs: {out_index: argnum}: return that output subtree packed like that argument.
      stacked_dot: with index_mode="whole", read stacked inputs in place: `x @ W` dots whose
        weight is stacked call `stacked_dot(x [M, K], stack [L, K, N], i, out_dtype)` (it may
        return None: then the dot runs on the row), and stacked inputs that an output updates (a
        KV cache) travel in the scan carry, updated at row i (`jaxdecode.looping.inplace`).
      stacked_calls: with stacked_dot, {call name: hook}: a call of that name inside a looped
        layer goes to `hook(*args)` with its stacked arguments still unread (`StackedRef`s); the
        hook returns the call's outputs, or None to evaluate the call as written.
      lone_calls: a single call of a callee that has a run elsewhere becomes a run of one (a scan of length 1),
        which reaches the in-place kernels; default: only in place (with stacked_dot). Elsewhere it gains nothing,
        and a dataflow compiler would rather keep the call in the section around it (`rdu`).

    Returns:
      A `LoopPlan`: `pack`, `looped`, `unpack_outputs`, `report`, `jaxpr`.
    """
    return LoopPlan(fn, args, index_mode, packed_argnums, packed_outputs or {}, stacked_dot, stacked_calls, lone_calls)
