"""jaxpr -> DataflowGraph: nodes with FLOPs, bytes and name scopes; sub-jaxprs kept as hierarchy.

    g = trace(f, x_spec, w_spec)              # any function, traced with abstract shapes
    g = trace_decode_step(cfg, batch=1, context=4096, looped=True)   # our decode step, bf16

FLOP conventions (the ones XLA's HloCostAnalysis uses, so the two can be compared):
- dot_general: 2 * (elements of the result) * (product of the contracting dims), batch dims included
  in the result, i.e. 2*M*N*K per batch element.
- elementwise arithmetic and comparisons: 1 per result element. Transcendentals (exp, rsqrt, sin,
  logistic, ...) are counted apart, in `transcendentals`, and as 0 FLOPs.
- reductions: (input elements - output elements), one binary op per element folded in.
- data movement (reshape, broadcast, convert, slice, gather, scatter, ...): 0 FLOPs.

Name scopes come from `eqn.source_info.name_stack`; a jaxpr inside a call starts its own stack, so a
node's scope is its caller's scope joined with its own (e.g. "layers_3/attention/sdpa").
Only `jax.extend.core` is used; primitives are matched by name (`jit`, and `pjit` for old JAX).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from rdu.graph import INPLACE_OPS, SLICING_OPS, DataflowGraph, Edge, Node, TensorInfo

CALL_OPS = frozenset(
    {
        "jit",
        "pjit",
        "closed_call",
        "core_call",
        "remat",
        "checkpoint",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "custom_lin",
    }
)
ARITH_OPS = frozenset(
    {
        "add",
        "add_any",
        "sub",
        "mul",
        "div",
        "rem",
        "max",
        "min",
        "neg",
        "abs",
        "sign",
        "pow",
        "integer_pow",
        "square",
        "floor",
        "ceil",
        "round",
        "clamp",
        "select_n",
        "lt",
        "le",
        "gt",
        "ge",
        "eq",
        "ne",
        "and",
        "or",
        "xor",
        "not",
        "nextafter",
    }
)
TRANSCENDENTAL_OPS = frozenset(
    {
        "exp",
        "exp2",
        "log",
        "log1p",
        "expm1",
        "tanh",
        "logistic",
        "sin",
        "cos",
        "tan",
        "rsqrt",
        "sqrt",
        "cbrt",
        "erf",
        "erfc",
        "erf_inv",
        "atan2",
        "asin",
        "acos",
        "atan",
        "sinh",
        "cosh",
        "asinh",
        "acosh",
        "atanh",
        "lgamma",
        "digamma",
    }
)
REDUCE_OPS = frozenset(
    {
        "reduce_sum",
        "reduce_max",
        "reduce_min",
        "reduce_prod",
        "reduce_and",
        "reduce_or",
        "reduce_xor",
        "argmax",
        "argmin",
        "cumsum",
        "cumprod",
        "cummax",
        "cummin",
        "reduce_precision",
    }
)


def _info(aval) -> TensorInfo | None:
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return None  # tokens and other non-array values
    bits = 4 if jnp.dtype(dtype) in (jnp.int4, jnp.uint4) else 8 * jnp.dtype(dtype).itemsize
    return TensorInfo(tuple(int(d) for d in shape), jnp.dtype(dtype).name, bits / 8)


def _infos(atoms) -> list[TensorInfo]:
    return [i for i in (_info(a.aval) for a in atoms) if i is not None]


def _open(j) -> jcore.Jaxpr:
    return j.jaxpr if isinstance(j, jcore.ClosedJaxpr) else j


def _kind(op: str) -> str:
    if op == "dot_general":
        return "matmul"
    if op in ARITH_OPS or op in TRANSCENDENTAL_OPS:
        return "elementwise"
    if op in REDUCE_OPS:
        return "reduction"
    if op in INPLACE_OPS:
        return "memory"
    if op in ("scan", "while"):
        return "loop"
    if op == "cond":
        return "branch"
    if op in CALL_OPS:
        return "call"
    return "data"


def dot_general_flops(lhs_shape, out_shape, dimension_numbers) -> int:
    """2 * |result| * prod(lhs contracting dims): 2*M*N*K per batch element."""
    (lhs_contract, _), _ = dimension_numbers
    k = math.prod(lhs_shape[d] for d in lhs_contract)
    return 2 * math.prod(out_shape) * k


def _leaf_costs(eqn, ins: list[TensorInfo], outs: list[TensorInfo]) -> tuple[int, int, int, int]:
    """(flops, transcendentals, bytes_read, bytes_written) of one leaf equation."""
    op = eqn.primitive.name
    out_elems = sum(o.size for o in outs)
    flops = trans = 0
    if op == "dot_general":
        flops = dot_general_flops(ins[0].shape, outs[0].shape, eqn.params["dimension_numbers"])
    elif op in TRANSCENDENTAL_OPS:
        trans = out_elems
    elif op in ARITH_OPS:
        flops = out_elems
    elif op in REDUCE_OPS:
        flops = max(ins[0].size - out_elems, 0) if ins else 0
    read = sum(i.nbytes for i in ins)
    written = sum(o.nbytes for o in outs)
    if op in SLICING_OPS and ins:
        read = read - ins[0].nbytes + written  # only the slice of operand 0 is read
    elif op in INPLACE_OPS and ins:
        # dynamic_update_slice(operand, update, *indices); scatter(operand, indices, updates)
        update = ins[1].nbytes if op == "dynamic_update_slice" else ins[2].nbytes
        read = read - ins[0].nbytes  # operand 0 is updated in place, not read
        written = update
    return flops, trans, read, written


def _children(eqn, scope: str) -> tuple[list[DataflowGraph], int, str]:
    """Sub-graphs of a higher-order equation, its trip count and callee name."""
    op, p = eqn.primitive.name, eqn.params
    if op == "scan":
        return [from_jaxpr(p["jaxpr"], "scan_body", scope)], int(p["length"]), "scan_body"
    if op == "cond":
        return [from_jaxpr(b, f"branch_{i}", scope) for i, b in enumerate(p["branches"])], 1, "cond"
    if op == "while":
        # The trip count of a while loop is data-dependent: counted once (stated in the report).
        return [from_jaxpr(p["body_jaxpr"], "while_body", scope)], 1, "while_body"
    if op in ("jit", "pjit"):
        return [from_jaxpr(p["jaxpr"], str(p.get("name", "jit")), scope)], 1, str(p.get("name", "jit"))
    for key in ("call_jaxpr", "fun_jaxpr", "jaxpr"):
        if key in p and isinstance(p[key], (jcore.ClosedJaxpr, jcore.Jaxpr)):
            return [from_jaxpr(p[key], op, scope)], 1, op
    subs = list(jcore.jaxprs_in_params(p))
    return [from_jaxpr(s, f"{op}_{i}", scope) for i, s in enumerate(subs)], 1, op


def scan_counts(eqn) -> tuple[int, int]:
    """(num_consts, num_carry) of a scan equation (jax >= 0.11 groups them in `ft_in`)."""
    p = eqn.params
    if "num_consts" in p:
        return int(p["num_consts"]), int(p["num_carry"])
    consts, carry, xs = (len(part.vals) if hasattr(part, "vals") else len(part) for part in p["ft_in"].unpack())
    if consts + carry + xs != len(eqn.invars):
        raise NotImplementedError(f"scan ft_in {p['ft_in']} does not match {len(eqn.invars)} operands")
    return consts, carry


def _call_input_reads(node: Node, eqn) -> list[int]:
    """Bytes each operand of a call/loop node reads from main memory, from its children's analysis."""
    op = eqn.primitive.name
    n_in = len(eqn.invars)
    if op == "scan":
        nc, ncar = scan_counts(eqn)
        body = node.children[0]
        return [r * (1 if nc <= i < nc + ncar else node.trip_count) for i, r in enumerate(body.input_reads)]
    if op == "cond":
        reads = [max(b.input_reads[i] for b in node.children) for i in range(n_in - 1)]
        return [eqn.invars[0].aval.dtype.itemsize] + reads
    if op == "while":
        ncc = eqn.params["cond_nconsts"]
        body = node.children[0]
        reads = [0] * ncc + list(body.input_reads)
        return reads[:n_in] + [0] * (n_in - len(reads))
    child = node.children[0]
    reads = list(child.input_reads)
    return reads[:n_in] + [0] * (n_in - len(reads))


def _call_aliases(node: Node, eqn) -> dict[int, tuple[int, int]]:
    """out index -> (in index it updates in place, bytes of the update) for a call/loop node."""
    op = eqn.primitive.name
    out: dict[int, tuple[int, int]] = {}
    if op == "cond":
        first = node.children[0]
        for j, a in enumerate(first.output_alias):
            if a is not None and all(b.output_alias[j] == a for b in node.children):
                out[j] = (a + 1, max(b.output_writes[j] for b in node.children))
        return out
    if op == "while":
        return {}
    child = node.children[0]
    for j, a in enumerate(child.output_alias):
        if a is not None:
            out[j] = (a, child.output_writes[j] * node.trip_count)
    return out


def from_jaxpr(jaxpr, name: str = "main", scope: str = "") -> DataflowGraph:
    """The DataflowGraph of a Jaxpr or ClosedJaxpr; sub-jaxprs become child graphs."""
    jaxpr = _open(jaxpr)
    invars = list(jaxpr.constvars) + list(jaxpr.invars)
    g = DataflowGraph(name, _infos(invars), _infos(jaxpr.outvars))
    producer: dict = {v: (-1, i) for i, v in enumerate(invars)}
    # Fused-traffic analysis: every var maps to a root buffer: ("in", i) or ("int", var).
    root: dict = {v: ("in", i) for i, v in enumerate(invars)}
    leaf_full = [False] * len(invars)
    leaf_partial = [0] * len(invars)
    call_reads = [0] * len(invars)
    updates: dict[int, int] = {}  # input index -> bytes written in place

    def read(v, nbytes: int | None, via_call: bool = False):
        if not isinstance(v, jcore.Var) or v not in root:
            return
        r = root[v]
        if r[0] != "in":
            return
        i = r[1]
        if via_call:
            call_reads[i] += nbytes
        elif nbytes is None:
            leaf_full[i] = True
        else:
            leaf_partial[i] += nbytes

    for eqn in jaxpr.eqns:
        op = eqn.primitive.name
        own = str(eqn.source_info.name_stack)
        full_scope = "/".join(s for s in (scope, own) if s)
        ins, outs = _infos(eqn.invars), _infos(eqn.outvars)
        node = Node(len(g.nodes), op, _kind(op), full_scope, ins, outs)
        if op == "dot_general":
            node.params = {"dimension_numbers": eqn.params["dimension_numbers"]}
        subs = (
            _children(eqn, full_scope)
            if (
                op in CALL_OPS
                or op in ("scan", "cond", "while")
                or any(True for _ in jcore.jaxprs_in_params(eqn.params))
            )
            else None
        )
        if subs and subs[0]:
            node.children, node.trip_count, node.name = subs
            if node.kind == "data":
                node.kind = "call"
            for i, (v, r) in enumerate(zip(eqn.invars, _call_input_reads(node, eqn))):
                read(v, r, via_call=True)
            aliases = _call_aliases(node, eqn)
            for j, v in enumerate(eqn.outvars):
                if j in aliases and isinstance(eqn.invars[aliases[j][0]], jcore.Var):
                    src = eqn.invars[aliases[j][0]]
                    root[v] = root.get(src, ("int", v))
                    if root[v][0] == "in":
                        updates[root[v][1]] = updates.get(root[v][1], 0) + aliases[j][1]
                else:
                    root[v] = ("int", v)
        else:
            node.flops, node.transcendentals, node.bytes_read, node.bytes_written = _leaf_costs(eqn, ins, outs)
            for k, v in enumerate(eqn.invars):
                if k == 0 and op in SLICING_OPS:
                    read(v, sum(o.nbytes for o in outs))
                elif k == 0 and op in INPLACE_OPS:
                    pass  # updated in place: not read
                else:
                    read(v, None)
            for v in eqn.outvars:
                root[v] = ("int", v)
            if op in INPLACE_OPS and isinstance(eqn.invars[0], jcore.Var) and eqn.invars[0] in root:
                root[eqn.outvars[0]] = root[eqn.invars[0]]
                if root[eqn.outvars[0]][0] == "in":
                    i = root[eqn.outvars[0]][1]
                    updates[i] = updates.get(i, 0) + node.bytes_written
        for k, v in enumerate(eqn.invars):
            if isinstance(v, jcore.Var) and v in producer and _info(v.aval) is not None:
                src, port = producer[v]
                g.edges.append(Edge(src, node.id, _info(v.aval), port, k))
        for k, v in enumerate(eqn.outvars):
            producer[v] = (node.id, k)
        g.nodes.append(node)

    sizes = [_info(v.aval).nbytes if _info(v.aval) else 0 for v in invars]
    g.input_reads = [
        max(sizes[i] if leaf_full[i] else 0, min(sizes[i], leaf_partial[i])) + call_reads[i] for i in range(len(invars))
    ]
    for j, v in enumerate(jaxpr.outvars):
        info = _info(v.aval)
        if isinstance(v, jcore.Var) and v in producer and info is not None:
            g.edges.append(Edge(producer[v][0], -1, info, producer[v][1], j))
        r = root.get(v) if isinstance(v, jcore.Var) else None
        if r is not None and r[0] == "in":
            g.output_alias.append(r[1])
            g.output_writes.append(0 if v in invars else updates.get(r[1], 0))
        else:
            g.output_alias.append(None)
            g.output_writes.append(0 if info is None or not isinstance(v, jcore.Var) else info.nbytes)
    return g


def trace(fn, *args, name: str | None = None, **kwargs) -> DataflowGraph:
    """Trace `fn` on example arguments or `jax.ShapeDtypeStruct`s into a DataflowGraph."""
    closed = jax.make_jaxpr(functools.partial(fn, **kwargs))(*args)
    return from_jaxpr(closed, name or getattr(fn, "__name__", "main"))


@functools.lru_cache(maxsize=32)
def trace_decode_step(
    cfg,
    batch: int = 1,
    context: int = 4096,
    *,
    looped: bool = True,
    dtype: str = "bfloat16",
    quantize: str | None = None,
    scale_dtype: str | None = None,
) -> DataflowGraph:
    """The decode step of `cfg` (one new token per sequence, a cache of `context` rows) as a graph.

    Built from shapes only (`nnx.eval_shape`), so no weights are allocated, even for 405B. `looped`
    traces the kernel-looped forward (one `scan` of length L); otherwise the unrolled one (L `jit`
    calls of `decoder_layer_call`). `quantize` ("int8" | "int4"): the projections as
    `model.quantize_weights` stores them, so the graph reads their codes and scales (in `scale_dtype`; None:
    its default).
    """
    from flax import nnx

    from jaxdecode.looped_model import LoopedForward
    from jaxdecode.model import Transformer, quantize_weights
    from jaxdecode.quantized import SCALE_DTYPE

    dt = jnp.dtype(dtype)

    def build():
        model = Transformer(cfg, dtype=dt, rngs=nnx.Rngs(0))
        return quantize_weights(model, quantize, scale_dtype=scale_dtype or SCALE_DTYPE) if quantize else model

    abstract = nnx.eval_shape(build)
    graphdef, params = nnx.split(abstract)
    plan = LoopedForward(graphdef, params, cfg).plan(batch, 1, context, dt)
    jaxpr = plan.jaxpr if looped else plan.original_jaxpr
    mode = "looped" if looped else "unrolled"
    suffix = f":{quantize}" if quantize else ""
    return from_jaxpr(jaxpr, f"{cfg.name}:decode:{mode}:B{batch}:S{context}{suffix}")
