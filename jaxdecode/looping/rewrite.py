"""The rewrite: `Interpreter` re-traces an analysed jaxpr with each run of calls replaced by one `lax.scan`.

Nothing is bound with hand-built params: every equation is re-bound with its own primitive and params,
each sub-jaxpr replaced by its re-traced, same-typed version. In-place runs (`stacked_dot`) evaluate
the layer with `jaxdecode.looping.inplace.RefEvaluator` inside the scan body.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import source_info_util  # private: public jax cannot set an equation's name stack
from jax.extend import core as jcore

from jaxdecode.looping.find import Analysis, Run, callee_name, callee_of, side_effects
from jaxdecode.looping.inplace import (
    RefEvaluator,
    StackedCall,
    StackedDot,
    StackedRef,
    output_aliases,
    takes_outside_runs,
)
from jaxdecode.looping.pack import LazyRow, as_stack, materialize

# --- binding an equation: the private name-stack API and the bind-params convention. -----------


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
    out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(params))
    return list(out) if eqn.primitive.multiple_results else [out]


# ------------------------------------------------------------------------------------------------


class Interpreter:
    """Evaluates analysed jaxprs, turning each run into one `lax.scan` (Equinox-style env loop)."""

    def __init__(
        self,
        analysis: Analysis,
        index_mode: str,
        stacked_dot: StackedDot | None = None,
        stacked_calls: Mapping[str, StackedCall] | None = None,
    ):
        self.analysis, self.index_mode, self.stacked_dot = analysis, index_mode, stacked_dot
        self.stacked_calls = stacked_calls
        self._transformed: dict[int, jcore.Jaxpr] = {}

    def eval(self, jaxpr: jcore.Jaxpr, args: Sequence[Any]) -> list[Any]:
        """Outputs of `jaxpr` at `args` (values may be lazy `LazyRow`s, in and out)."""
        env: dict[Any, Any] = dict(zip(jaxpr.all_invars, [*jaxpr.consts, *args]))

        def read(atom):
            return atom.val if isinstance(atom, jcore.Literal) else env[atom]

        for item in self.analysis.levels[id(jaxpr)][1]:
            if isinstance(item, Run):
                env.update(self._run(item, read))
            else:
                args = [materialize(read(a)) for a in item.invars]
                outs = self._outside_hook(item, args) or self._bind_eqn(item, args)
                env.update(zip(item.outvars, outs))
        return [read(a) for a in jaxpr.outvars]

    def transform(self, jaxpr: jcore.Jaxpr) -> jcore.Jaxpr:
        """`jaxpr` with its runs looped, re-traced; the same object when it holds no run."""
        if not self.analysis.has_runs(jaxpr):
            return jaxpr
        if id(jaxpr) not in self._transformed:

            def fun(*args):
                return [materialize(x) for x in self.eval(jaxpr, args)]

            fun.__name__ = getattr(jaxpr.debug_info, "func_name", None) or "looped"
            specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in jaxpr.in_avals]
            with source_info_util.reset_name_stack():
                self._transformed[id(jaxpr)] = jax.make_jaxpr(fun)(*specs)
        return self._transformed[id(jaxpr)]

    def _outside_hook(self, eqn: jcore.JaxprEqn, args: list[Any]) -> list[Any] | None:
        """The outputs of a hook marked `outside_runs` for a call outside every run, or None."""
        hook = (self.stacked_calls or {}).get(callee_name(eqn)) if callee_of(eqn) is not None else None
        if hook is None or not takes_outside_runs(hook) or side_effects(eqn):
            return None
        with _eqn_context(eqn):
            return hook(*args)

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
            carry0 = [materialize(read(first.invars[p])) for p in carry_pos]
            shared = {p: materialize(read(first.invars[p])) for p in run.shared}
            stacks = [as_stack([read(eqn.invars[p]) for eqn in run.calls]) for p in run.stacked]
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
            written.update((eqn.outvars[j], LazyRow(y, k, run.name_stack)) for j, y in ys.items())
        last = run.calls[-1]
        written.update((last.outvars[run.carry[p]], c) for p, c in zip(run.carry, carry))
        return written

    def _run_in_place(self, run: Run, params, carry0, shared, stacks, index) -> dict[Any, Any]:
        """The scan of `_run` whose body reads stacked inputs in place (see `jaxdecode.looping.inplace`).

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
            # (a cross-stream wait per layer before the first kernel that reads it).
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
