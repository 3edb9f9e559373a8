"""Finding runs of repeated layer calls in a jaxpr: structural keys, the chaining rules, `Analysis`.

Nothing here traces or binds anything: it reads jaxprs and returns, per jaxpr, a *schedule* (the
equations in evaluation order, with each run of calls replaced by one `Run`) plus reports.
`Analysis` does this for a jaxpr and every sub-jaxpr it holds. The contract and the rules are in
the `jaxdecode.looping` docstring and docs/looping.md; the rules are implemented in `_Candidate`.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
from collections.abc import Hashable
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from jaxdecode.looping.report import RunReport, SkipReport, aval_str

# Primitives that call a sub-jaxpr with their own operands, one to one.
CALL_PRIMITIVES = frozenset({"jit", "closed_call", "core_call", "checkpoint", "remat"})
# Primitives whose function-valued params (derivative rules) are re-created by every trace.
_CUSTOM_RULE_PRIMITIVES = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
_PLAIN_PARAM = (jcore.Jaxpr, int, float, str, tuple, type(None))
# Callees defined in JAX itself (jnp/lax helpers such as dynamic_update_index_in_dim) are not layers.
_JAX_SOURCE = f"{os.sep}jax{os.sep}_src{os.sep}"
# Constants up to this many elements are compared by value in structural keys, larger ones by id.
_CONST_BY_VALUE_MAX = 4096


def is_layer_call(eqn: jcore.JaxprEqn) -> bool:
    """A call whose callee is user code (not a JAX library helper): a candidate for looping."""
    callee = callee_of(eqn)
    src = getattr(getattr(callee, "debug_info", None), "func_src_info", None) or ""
    return callee is not None and _JAX_SOURCE not in src


def callee_of(eqn: jcore.JaxprEqn) -> jcore.Jaxpr | None:
    """The jaxpr that `eqn` calls, if `eqn` is a plain call (jit and friends)."""
    if eqn.primitive.name not in CALL_PRIMITIVES:
        return None
    callee = eqn.params.get("jaxpr")
    return callee if isinstance(callee, jcore.Jaxpr) else None


def side_effects(eqn: jcore.JaxprEqn) -> set:
    """The effects of `eqn` that order something. A collective's `NamedAxisEffect` (the psums of a
    tensor-parallel layer) only records that a mesh axis is used: `lax.scan` carries it, JAX's remat
    ignores it, and a run of layer calls holding psums loops like any other."""
    return {e for e in eqn.effects if type(e).__name__ != "NamedAxisEffect"}


def callee_name(eqn: jcore.JaxprEqn) -> str:
    return str(eqn.params.get("name") or eqn.primitive.name)


def sub_jaxprs(params: dict[str, Any]) -> list[tuple[str, jcore.Jaxpr]]:
    """(label, jaxpr) for every jaxpr held in `params`, directly or in a tuple (cond branches)."""
    found = []
    for key, value in params.items():
        if isinstance(value, jcore.Jaxpr):
            found.append((key, value))
        elif isinstance(value, tuple):
            found += [(f"{key}[{i}]", v) for i, v in enumerate(value) if isinstance(v, jcore.Jaxpr)]
    return found


def _aval_key(aval) -> Hashable:
    shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return ("aval", str(aval))
    return (type(aval).__name__, tuple(shape), str(dtype), bool(getattr(aval, "weak_type", False)))


def _const_key(value) -> Hashable:
    if isinstance(value, jax.core.Tracer):
        # A Pallas kernel's inner jaxprs (`run_scoped` in a `plgpu.kernel`) close over the kernel's
        # own refs as tracer constants; the same kernel code closes over the same refs in every call.
        return ("tracer", _aval_key(value.aval))
    arr = np.asarray(value)
    if arr.size > _CONST_BY_VALUE_MAX:
        return ("const-id", id(value))
    return ("const", arr.shape, str(arr.dtype), arr.tobytes())


class StructuralKeys:
    """Hashable structural keys of jaxprs: equal keys <=> same primitives, params, avals and wiring.

    Variables are numbered in order of appearance (alpha-equivalence). Sub-jaxprs in params are
    keyed recursively; small constants by value; other function-valued params by identity, except
    the derivative rules of custom_jvp/custom_vjp calls, which every trace re-creates: those are
    ignored, so a looped run differentiates with its first call's rule (values are unaffected).
    """

    def __init__(self):
        self._memo: dict[int, tuple[jcore.Jaxpr, Hashable]] = {}  # id -> (jaxpr kept alive, key)

    def jaxpr(self, jaxpr: jcore.Jaxpr) -> Hashable:
        hit = self._memo.get(id(jaxpr))
        if hit is not None:
            return hit[1]
        names: dict[Any, int] = {}

        def atom(a) -> Hashable:
            if isinstance(a, jcore.Literal):
                return ("lit", _aval_key(a.aval), _const_key(a.val))
            return names.setdefault(a, len(names))

        invars = tuple((atom(v), _aval_key(v.aval)) for v in jaxpr.all_invars)
        eqns = []
        for eqn in jaxpr.eqns:
            ins = tuple(atom(a) for a in eqn.invars)
            outs = tuple((atom(v), _aval_key(v.aval)) for v in eqn.outvars)
            params = eqn.params
            if eqn.primitive.name in _CUSTOM_RULE_PRIMITIVES:
                params = {k: v for k, v in params.items() if isinstance(v, _PLAIN_PARAM)}
            eqns.append((eqn.primitive.name, self.params(params), ins, outs, str(eqn.effects)))
        key = (invars, tuple(_const_key(c) for c in jaxpr.consts), tuple(eqns), tuple(atom(a) for a in jaxpr.outvars))
        self._memo[id(jaxpr)] = (jaxpr, key)
        return key

    def params(self, params: dict[str, Any]) -> Hashable:
        return tuple(sorted((k, self.value(v)) for k, v in params.items()))

    def value(self, value) -> Hashable:
        if isinstance(value, jcore.Jaxpr):
            return ("jaxpr", self.jaxpr(value))
        if isinstance(value, (tuple, list)):
            return (type(value).__name__, tuple(self.value(v) for v in value))
        if isinstance(value, dict):
            return ("dict", tuple(sorted((k, self.value(v)) for k, v in value.items())))
        if isinstance(value, np.ndarray):
            return _const_key(value)
        try:
            hash(value)
        except TypeError:
            return ("id", id(value))
        return value

    def call(self, eqn: jcore.JaxprEqn) -> Hashable:
        """Key of a call equation: its primitive, its params and its callee's structure."""
        params = {k: v for k, v in eqn.params.items() if k != "jaxpr"}
        return (eqn.primitive.name, self.params(params), self.jaxpr(eqn.params["jaxpr"]))


@dataclasses.dataclass
class Run:
    """A maximal run of >= 2 consecutive calls of one callee, to become one `lax.scan`; or (`find_runs`' lone_calls) a
    single call of a callee that has such a run elsewhere, a scan of length 1 wired as that run.

    Input positions p of the callee are split into `carry` (p -> output position of the previous
    call that feeds it), `shared` (the same value for every call) and `stacked` (one value per call).
    `ys` are output positions needed outside the run for some call, returned stacked by the scan.
    """

    calls: list[jcore.JaxprEqn]
    hoisted: list[jcore.JaxprEqn]  # pure ops between calls that read nothing the run computes
    sunk: list[jcore.JaxprEqn]  # pure ops between calls whose results no later call reads
    carry: dict[int, int]
    shared: list[int]
    stacked: list[int]
    ys: list[int]
    name_stack: Any  # NameStack common to all calls; the scan is emitted under it
    body_scope: str | None  # e.g. "layers" when the calls sit under layers_0, layers_1, ...
    report: RunReport | None = None

    @property
    def length(self) -> int:
        return len(self.calls)


def _common_scope(calls: list[jcore.JaxprEqn]) -> tuple[Any, str | None]:
    """The common name-stack prefix of the calls and a name for the per-call scope below it."""
    stacks = [eqn.source_info.name_stack for eqn in calls]
    k = 0
    while all(len(s) > k for s in stacks) and all(s.stack[k] == stacks[0].stack[k] for s in stacks):
        k += 1
    below = [s.stack[k] if len(s) > k else None for s in stacks]
    if any(type(b).__name__ != "Scope" for b in below):  # no per-call scope, or a transform
        return stacks[0][:k], None
    stripped = {re.sub(r"[_\-.]?\d+$", "", b.name) for b in below}
    return stacks[0][:k], (stripped.pop() or None) if len(stripped) == 1 else None


class _Candidate:
    """A growing run. Implements the rules: see `extend` and `add_between`."""

    def __init__(self, eqns: list[jcore.JaxprEqn], index: int, key: Hashable):
        self.eqns, self.key = eqns, key
        self.name = callee_name(eqns[index])
        self.calls = [index]
        self.carry: dict[int, int] | None = None
        self.tainted = set(eqns[index].outvars)  # values computed by the run so far
        self.sunk_from: dict[Any, jcore.JaxprEqn] = {}  # tainted value -> sunk op that computed it
        self.between: list[tuple[int, bool]] = []  # (eqn index, sunk?)
        self.ended_by: str | None = None

    def add_between(self, index: int, eqn: jcore.JaxprEqn) -> None:
        """A pure op between calls: hoisted if it reads nothing the run computed, else sunk."""
        sunk = any(not isinstance(a, jcore.Literal) and a in self.tainted for a in eqn.invars)
        if sunk:
            self.tainted.update(eqn.outvars)
            self.sunk_from.update((v, eqn) for v in eqn.outvars)
        self.between.append((index, sunk))

    def extend(self, index: int, eqn: jcore.JaxprEqn) -> str | None:
        """Append call `eqn` if its inputs chain from the previous call; else return why not."""
        prev = self.eqns[self.calls[-1]]
        out_pos = {v: j for j, v in enumerate(prev.outvars) if not isinstance(v, jcore.DropVar)}
        carry = {}
        for p, a in enumerate(eqn.invars):
            if isinstance(a, jcore.Literal):
                continue
            if a in out_pos:
                carry[p] = out_pos[a]
            elif a in self.sunk_from:
                return (
                    f"op `{self.sunk_from[a].primitive.name}` between calls sits on the carried path "
                    "(it reads the previous call's output and the next call reads its result)"
                )
            elif a in self.tainted:
                return "it reads an output of an earlier call than the previous one (skip connection)"
        if not carry:
            return "carried value does not chain: it reads no output of the previous call"
        if self.carry is not None and carry != self.carry:
            return f"carry wiring differs from the earlier calls ({carry} vs {self.carry})"
        callee = eqn.params["jaxpr"]
        for p, j in carry.items():
            a_in, a_out = callee.in_avals[p], callee.out_avals[j]
            if (a_in.shape, a_in.dtype) != (a_out.shape, a_out.dtype):
                return f"output {j} ({aval_str(a_out)}) cannot be carried into input {p} ({aval_str(a_in)})"
        self.carry = carry
        self.calls.append(index)
        self.tainted.update(eqn.outvars)
        return None

    def _shared_and_stacked(self, calls: list[jcore.JaxprEqn]) -> tuple[list[int], list[int]]:
        """The input positions that are not carried: the same value in every call, or one value per call."""
        shared, stacked = [], []
        for p in range(len(calls[0].invars)):
            if p in self.carry:
                continue
            atoms = [eqn.invars[p] for eqn in calls]
            same = all(a is atoms[0] for a in atoms) or all(
                isinstance(a, jcore.Literal) and _const_key(a.val) == _const_key(atoms[0].val) for a in atoms
            )
            (shared if same else stacked).append(p)
        return shared, stacked

    def to_run(self, uses: collections.Counter, like: Run | None = None) -> Run | None:
        """The run of the calls; a single call becomes a run of one, wired as `like` (a run of the same callee),
        so that the layers of a mixed file between runs of the other kind take the in-place kernels too."""
        if len(self.calls) < 2 and like is None:
            return None
        last = self.calls[-1]
        calls = [self.eqns[i] for i in self.calls]
        hoisted = [self.eqns[i] for i, sunk in self.between if i < last and not sunk]
        sunk = [self.eqns[i] for i, s in self.between if i < last and s]
        if len(calls) == 1:  # the same callee as `like`: its carried, shared and stacked positions
            self.carry, shared, stacked = like.carry, list(like.shared), list(like.stacked)
        else:
            shared, stacked = self._shared_and_stacked(calls)
        assert self.carry is not None
        ys = set()
        for k, eqn in enumerate(calls):
            for j, v in enumerate(eqn.outvars):
                if isinstance(v, jcore.DropVar):
                    continue
                by_next = sum(1 for jj in self.carry.values() if jj == j) if k + 1 < len(calls) else 0
                last_carried = k + 1 == len(calls) and j in self.carry.values()
                if uses[v] > by_next and not last_carried:
                    ys.add(j)
        name_stack, body_scope = _common_scope(calls if like is None else [*like.calls, *calls])
        return Run(
            calls, hoisted, sunk, dict(sorted(self.carry.items())), shared, stacked, sorted(ys), name_stack, body_scope
        )


def _uses(jaxpr: jcore.Jaxpr) -> collections.Counter:
    uses = collections.Counter(a for eqn in jaxpr.eqns for a in eqn.invars if not isinstance(a, jcore.Literal))
    uses.update(a for a in jaxpr.outvars if not isinstance(a, jcore.Literal))
    return uses


def find_runs(
    jaxpr: jcore.Jaxpr, keys: StructuralKeys, where: str, lone_calls: bool = False
) -> tuple[list[jcore.JaxprEqn | Run], list[Run], list[SkipReport]]:
    """The schedule of one jaxpr level (no recursion), its runs, and the calls left out and why. `lone_calls`: a
    single call whose callee has a run at this level becomes a run of one, wired as that run."""
    eqns = list(jaxpr.eqns)
    calls_per_name = collections.Counter(callee_name(e) for e in eqns if is_layer_call(e))
    uses = _uses(jaxpr)
    finished: list[_Candidate] = []
    skips: list[SkipReport] = []
    last_by_name: dict[str, _Candidate] = {}
    cur: _Candidate | None = None

    def skip(eqn, reason):
        if calls_per_name[callee_name(eqn)] >= 2:
            skips.append(SkipReport(callee_name(eqn), where, str(eqn.source_info.name_stack), reason))

    def finish(ended_by):
        nonlocal cur
        if cur is not None:
            cur.ended_by = ended_by
            finished.append(cur)
            last_by_name[cur.name] = cur
        cur = None

    for i, eqn in enumerate(eqns):
        if not is_layer_call(eqn):
            if cur is not None and side_effects(eqn):
                finish(f"op `{eqn.primitive.name}` with side effects {side_effects(eqn)} between calls")
            elif cur is not None:
                cur.add_between(i, eqn)
            continue
        name = callee_name(eqn)
        if side_effects(eqn):
            finish(f"call `{name}` with side effects between calls")
            skip(eqn, f"side effects in the callee: {side_effects(eqn)}")
            continue
        key = keys.call(eqn)
        if cur is not None and cur.key == key:
            why = cur.extend(i, eqn)
            if why is None:
                continue
            finish(why)
            skip(eqn, why)
        else:
            finish(f"call of a different callee `{name}`")
            prev = last_by_name.get(name)
            if prev is not None and prev.key != key:
                skip(
                    eqn,
                    "different callee: same function but a structurally different jaxpr "
                    "(shapes, dtypes or params differ)",
                )
            elif prev is not None:
                skip(eqn, f"non-consecutive: {prev.ended_by}")
        cur = _Candidate(eqns, i, key)
    finish(None)

    made = [(c, c.to_run(uses)) for c in finished]
    wiring = {c.key: run for c, run in made if run is not None} if lone_calls else {}
    runs = [run if run is not None else c.to_run(uses, like=wiring.get(c.key)) for c, run in made]
    runs = [run for run in runs if run is not None]
    at_first = {id(r.calls[0]): r for r in runs}
    in_run = {id(e) for r in runs for e in (*r.calls, *r.hoisted, *r.sunk)}
    schedule: list[jcore.JaxprEqn | Run] = []
    for eqn in eqns:
        run = at_first.get(id(eqn))
        if run is not None:
            schedule += [*run.hoisted, run, *run.sunk]
        elif id(eqn) not in in_run:
            schedule.append(eqn)
    return schedule, runs, skips


class Analysis:
    """Runs and schedules for a jaxpr and all its sub-jaxprs, each analysed once."""

    def __init__(self, lone_calls: bool = False):
        self.keys = StructuralKeys()
        self.lone_calls = lone_calls
        self.levels: dict[int, tuple[jcore.Jaxpr, list, list[Run], str]] = {}
        self.skips: list[SkipReport] = []
        self._has_runs: dict[int, bool] = {}

    def analyze(self, jaxpr: jcore.Jaxpr, where: str) -> None:
        if id(jaxpr) in self.levels:
            return
        schedule, runs, skips = find_runs(jaxpr, self.keys, where, self.lone_calls)
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
