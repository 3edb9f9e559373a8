"""Evaluation half of `jaxdecode.looping`: the interpreter that re-traces a jaxpr with each run of
calls replaced by one `lax.scan`, and the `Packed` pytree for pre-stacked arguments."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import source_info_util  # private: public jax cannot set an equation's name stack
from jax.extend import core as jcore

from jaxdecode.inplace import RefEvaluator, StackedCall, StackedDot, StackedRef, output_aliases
from jaxdecode.looping_find import Run, StructuralKeys, callee_name, callee_of, find_runs, sub_jaxprs
from jaxdecode.looping_report import SkipReport

# --- JAX-version shims: the private name-stack API and the bind-params convention. -------------


def _eqn_context(eqn: jcore.JaxprEqn, name_stack=None):
    """Re-enter `eqn`'s context (as `jax.core.eval_jaxpr` does), under `name_stack` if given."""
    relative = eqn.source_info.name_stack if name_stack is None else name_stack
    stack = contextlib.ExitStack()
    stack.enter_context(
        source_info_util.user_context(
            eqn.source_info.traceback, name_stack=source_info_util.current_name_stack() + relative
        )
    )
    stack.enter_context(eqn.ctx.manager)
    return stack


def _bind(eqn: jcore.JaxprEqn, params: dict[str, Any], args: Sequence[Any]) -> list[Any]:
    bind_params = eqn.primitive.get_bind_params(params)
    if isinstance(bind_params, tuple):  # jax < 0.5 returned (subfuns, params)
        subfuns, bind_params = bind_params
        out = eqn.primitive.bind(*subfuns, *args, **bind_params)
    else:
        out = eqn.primitive.bind(*args, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


# ------------------------------------------------------------------------------------------------


class _Slice:
    """Row `index` of a stacked `[L, ...]` array, kept lazy so a run can take the whole stack."""

    __slots__ = ("stack", "index", "name_stack")

    def __init__(self, stack, index: int, name_stack=None):
        self.stack, self.index, self.name_stack = stack, index, name_stack


def _materialize(value):
    """A value itself; for a `_Slice`, its row, sliced under the scope of the run that made it."""
    if not isinstance(value, _Slice):
        return value
    if value.name_stack is None:
        return lax.index_in_dim(value.stack, value.index, keepdims=False)
    name_stack = source_info_util.current_name_stack() + value.name_stack
    with source_info_util.user_context(None, name_stack=name_stack):
        return lax.index_in_dim(value.stack, value.index, keepdims=False)


def _as_stack(values: list[Any]):
    """The `[n, ...]` stack of `values`; free when they are rows 0..n-1 of one stack."""
    first = values[0]
    if (
        isinstance(first, _Slice)
        and first.stack.shape[0] == len(values)
        and all(isinstance(v, _Slice) and v.stack is first.stack and v.index == k for k, v in enumerate(values))
    ):
        return first.stack
    return jnp.stack([_materialize(v) for v in values])


class _Analysis:
    """Runs and schedules for a jaxpr and all its sub-jaxprs, each analysed once."""

    def __init__(self):
        self.keys = StructuralKeys()
        self.levels: dict[int, tuple[jcore.Jaxpr, list, list[Run], str]] = {}
        self.skips: list[SkipReport] = []
        self._has_runs: dict[int, bool] = {}

    def analyze(self, jaxpr: jcore.Jaxpr, where: str) -> None:
        if id(jaxpr) in self.levels:
            return
        schedule, runs, skips = find_runs(jaxpr, self.keys, where)
        self.levels[id(jaxpr)] = (jaxpr, schedule, runs, where)
        self.skips += skips
        for eqn in jaxpr.eqns:
            label = f"{eqn.primitive.name}({callee_name(eqn)})" if callee_of(eqn) else eqn.primitive.name
            for key, sub in sub_jaxprs(eqn.params):
                self.analyze(sub, f"{where}/{label}" + ("" if key == "jaxpr" else f".{key}"))

    def runs(self) -> list[tuple[Run, str]]:
        return [(run, where) for _, _, runs, where in self.levels.values() for run in runs]

    def has_runs(self, jaxpr: jcore.Jaxpr) -> bool:
        if id(jaxpr) not in self._has_runs:
            _, schedule, runs, _ = self.levels[id(jaxpr)]
            self._has_runs[id(jaxpr)] = bool(runs) or any(
                self.has_runs(sub) for eqn in schedule if not isinstance(eqn, Run) for _, sub in sub_jaxprs(eqn.params)
            )
        return self._has_runs[id(jaxpr)]


class _Interpreter:
    """Evaluates analysed jaxprs, turning each run into one `lax.scan` (Equinox-style env loop)."""

    def __init__(
        self,
        analysis: _Analysis,
        index_mode: str,
        stacked_dot: StackedDot | None = None,
        stacked_calls: Mapping[str, StackedCall] | None = None,
    ):
        self.analysis, self.index_mode, self.stacked_dot = analysis, index_mode, stacked_dot
        self.stacked_calls = stacked_calls
        self._transformed: dict[int, jcore.Jaxpr] = {}

    def eval(self, jaxpr: jcore.Jaxpr, args: Sequence[Any]) -> list[Any]:
        """Outputs of `jaxpr` at `args` (values may be lazy `_Slice`s, in and out)."""
        env: dict[Any, Any] = dict(zip(jaxpr.all_invars, [*jaxpr.consts, *args]))

        def read(atom):
            return atom.val if isinstance(atom, jcore.Literal) else env[atom]

        for item in self.analysis.levels[id(jaxpr)][1]:
            if isinstance(item, Run):
                env.update(self._run(item, read))
            else:
                outs = self._bind_eqn(item, [_materialize(read(a)) for a in item.invars])
                env.update(zip(item.outvars, outs))
        return [read(a) for a in jaxpr.outvars]

    def transform(self, jaxpr: jcore.Jaxpr) -> jcore.Jaxpr:
        """`jaxpr` with its runs looped, re-traced; the same object when it holds no run."""
        if not self.analysis.has_runs(jaxpr):
            return jaxpr
        if id(jaxpr) not in self._transformed:

            def fun(*args):
                return [_materialize(x) for x in self.eval(jaxpr, args)]

            fun.__name__ = getattr(jaxpr.debug_info, "func_name", None) or "looped"
            specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in jaxpr.in_avals]
            with source_info_util.reset_name_stack():
                self._transformed[id(jaxpr)] = jax.make_jaxpr(fun)(*specs)
        return self._transformed[id(jaxpr)]

    def _bind_eqn(self, eqn: jcore.JaxprEqn, args: list[Any]) -> list[Any]:
        params = self.params(eqn.params)
        with _eqn_context(eqn):
            return _bind(eqn, params, args)

    def params(self, params: dict[str, Any]) -> dict[str, Any]:
        """`params` with each sub-jaxpr replaced by its transformed (same-typed) version."""
        new = dict(params)
        for key, value in params.items():
            if isinstance(value, jcore.Jaxpr):
                new[key] = self.transform(value)
            elif isinstance(value, tuple) and any(isinstance(v, jcore.Jaxpr) for v in value):
                new[key] = tuple(self.transform(v) if isinstance(v, jcore.Jaxpr) else v for v in value)
        return new

    def _run(self, run: Run, read) -> dict[Any, Any]:
        first, n = run.calls[0], run.length
        carry_pos = list(run.carry)
        params = self.params(first.params)
        with _eqn_context(first, run.name_stack):  # the stacking, the index and the scan
            carry0 = [_materialize(read(first.invars[p])) for p in carry_pos]
            shared = {p: _materialize(read(first.invars[p])) for p in run.shared}
            stacks = [_as_stack([read(eqn.invars[p]) for eqn in run.calls]) for p in run.stacked]
            index = jnp.arange(n, dtype=jnp.int32)  # the layer index
        if self.stacked_dot is not None:
            return self._run_in_place(run, params, carry0, shared, stacks, index)

        def body(carry, xs):
            if self.index_mode == "slice":  # xs = (layer index, rows of the stacks)
                _, rows = xs
            else:  # xs = layer index; the stacks are scan constants, read in place at row xs
                rows = [lax.dynamic_index_in_dim(s, xs, keepdims=False) for s in stacks]
            args = [None] * len(first.invars)
            for p, value in [*zip(carry_pos, carry), *shared.items(), *zip(run.stacked, rows)]:
                args[p] = value
            with self._body_context(run):
                outs = _bind(first, params, args)
            return [outs[run.carry[p]] for p in carry_pos], [outs[j] for j in run.ys]

        xs = (index, stacks) if self.index_mode == "slice" else index
        with _eqn_context(first, run.name_stack):
            carry, ys = lax.scan(body, carry0, xs, length=n)
        return self._written(run, carry, dict(zip(run.ys, ys)))

    def _body_context(self, run: Run):
        first = run.calls[0]
        stack = contextlib.ExitStack()
        if run.body_scope:
            stack.enter_context(jax.named_scope(run.body_scope))
        stack.enter_context(_eqn_context(first, first.source_info.name_stack[:0]))
        return stack

    def _written(self, run: Run, carry: list[Any], ys: dict[int, Any]) -> dict[Any, Any]:
        written: dict[Any, Any] = {}
        for k, eqn in enumerate(run.calls):
            written.update((eqn.outvars[j], _Slice(y, k, run.name_stack)) for j, y in ys.items())
        last = run.calls[-1]
        written.update((last.outvars[run.carry[p]], c) for p, c in zip(run.carry, carry))
        return written

    def _run_in_place(self, run: Run, params, carry0, shared, stacks, index) -> dict[Any, Any]:
        """The scan of `_run` whose body reads stacked inputs in place (see `jaxdecode.inplace`).

        The layer's jaxpr is evaluated with each stacked input a `StackedRef`; stacks that alias a
        per-call output (a KV cache) travel in the scan carry and are updated at row i in place.
        """
        first = run.calls[0]
        callee = params["jaxpr"]
        aliases = output_aliases(callee, run.stacked, run.ys)  # stacked position -> output
        alias_ps = list(aliases)
        stack_of = dict(zip(run.stacked, stacks))
        n_carry = len(run.carry)

        def bind(eqn, args):
            with _eqn_context(eqn):
                return _bind(eqn, eqn.params, args)

        evaluator = RefEvaluator(self.stacked_dot, bind, _eqn_context, self.stacked_calls)

        def body(carry, _):
            # The layer index rides in the carry rather than in xs: a scanned `arange` becomes a
            # dynamic slice per step, which XLA on the GPU runs as an async fusion on a second stream
            # (a cross-stream wait of ~4 µs per layer before the first kernel that reads it).
            i, carry = carry[0], carry[1:]
            carried, alias_stacks = carry[:n_carry], dict(zip(alias_ps, carry[n_carry:]))
            evaluator.start(alias_stacks, i)
            args = [None] * len(first.invars)
            for p, value in [*zip(run.carry, carried), *shared.items()]:
                args[p] = value
            for p in run.stacked:
                args[p] = StackedRef(alias_stacks[p], i, p) if p in aliases else StackedRef(stack_of[p], i)
            with self._body_context(run):
                outs = evaluator.eval(callee, args)
                new_carry = [evaluator.row(outs[run.carry[p]]) for p in run.carry]
                new_stacks = [evaluator.write_back(p, outs[aliases[p]]) for p in alias_ps]
                ys = [evaluator.row(outs[j]) for j in run.ys if j not in aliases.values()]
            return [i + 1, *new_carry, *new_stacks], ys

        with _eqn_context(first, run.name_stack):
            init = [jnp.zeros((), index.dtype), *carry0, *(stack_of[p] for p in alias_ps)]
            carry, ys = lax.scan(body, init, None, length=run.length)
            carry = carry[1:]
        by_output = dict(zip([j for j in run.ys if j not in aliases.values()], ys))
        by_output.update((aliases[p], s) for p, s in zip(alias_ps, carry[n_carry:]))
        return self._written(run, carry[:n_carry], by_output)


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
        out: list[Any] = [None] * (sum(map(len, self.layout.groups)) + len(self.layout.rest))
        for stack, group in zip(self.stacks, self.layout.groups):
            for k, i in enumerate(group):
                out[i] = _Slice(stack, k) if lazy else stack[k]
        for value, i in zip(self.rest, self.layout.rest):
            out[i] = value
        return out

    def unpack(self):
        """The original pytree (each stack split into its per-layer leaves)."""
        return jax.tree_util.tree_unflatten(self.layout.treedef, self.leaves())


def _stack_spec(specs):
    return jax.ShapeDtypeStruct((len(specs), *specs[0].shape), specs[0].dtype)
