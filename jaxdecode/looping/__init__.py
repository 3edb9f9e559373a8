"""Kernel looping as a jaxpr pass: runs of consecutive calls of one layer become one `lax.scan`.

Kernel looping (arXiv 2410.23668) turns L calls of the same decoder layer into one loop, so the
runtime pays one synchronization for the loop instead of one per layer. Here it is a pass over
the jaxpr of a function:

    plan = kernel_loop(step, params, cache, tokens, packed_outputs={1: 1})
    print(plan.report)                         # what was looped, and why anything was not
    packed = plan.pack(params, cache, tokens)  # once: per-layer leaves stacked to [L, ...]
    looped = jax.jit(plan.looped)
    logits, cache_p = looped(*packed)          # cache_p is Packed, laid out like packed[1]
    logits, cache_p = looped(packed[0], cache_p, next_tokens)  # the cache stays packed
    logits, cache = plan.unpack_outputs((logits, cache_p))     # original structure back

**A layer must be a call.** The pass sees only call boundaries: a layer is a `jax.jit` function,
an `nnx.jit` method, or `jaxdecode.looping.layer(fn)` (a plain `jax.jit` that states the intent),
called once per layer, e.g. `for l in range(L): x, kv[l] = layer_step(graphdef, state[l], x, kv[l],
pos)`. Calls of one jit function share their callee jaxpr; separately traced callees are matched by
a structural key (primitives, params, avals, wiring; see `find.StructuralKeys`). A layer body
inlined in the caller (a plain Python method) has no boundary and is never looped, even under
`named_scope`s like `layers_0`, `layers_1`. Do not jit a layer with `inline=True` (or
`jax.Inline.JAX_EARLY`): that removes the call. Jitted helpers defined inside JAX itself
(`lax.dynamic_update_index_in_dim`, `jnp.stack`, ...) are not layers; they count as ops.

**Rules.** A run is >= 2 calls of equal callees in one jaxpr, in order, where
- each call reads at least one output of the previous call (the carry), at the same input
  positions every time, and no output of any earlier call (no skip connections);
- every other input is the same value for every call (shared) or one value per call of the same
  type (stacked);
- the call has no effects (e.g. `jax.debug.callback`), and no effectful op sits between calls;
- an op between two calls is allowed if it reads nothing the run computed (it is hoisted before
  the scan, e.g. slicing the next layer's cache) or if no later call reads its result (it is sunk
  after the scan, e.g. summing per-layer outputs). An op on the carried path (`x = 2 * x` between
  layers) or a call of another layer callee ends the run.
In place (`lone_calls`), a single call of a callee that has a run elsewhere at its level becomes a run of one,
wired as that run (the layers of a mixed quantized file that sit alone between runs of another kind).
Runs are found at every level: inside jit, custom_jvp/vjp, cond branches, scan and while bodies.
Structural keys ignore the derivative rules of custom_jvp/custom_vjp calls (every trace re-creates
them), so the derivative of a looped run uses its first call's rule; values are unaffected.

**Rewrite.** The function is re-traced by an interpreter (nothing is bound with hand-built
params; an equation with sub-jaxprs is re-bound with its own params, each sub-jaxpr replaced by
its re-traced, same-typed version). At a run it calls `lax.scan(body, carry, xs, length=L)`: the
carry holds the carried inputs, `xs` the layer index `arange(L)` and the stacked inputs; the body
re-binds the original call with its own params (the layer stays a `jit` call inside the body).
Outputs needed per layer come out stacked `[L, ...]`. With `index_mode="whole"` the stacked inputs
are passed whole (as scan constants) and the body takes row `i` with `lax.dynamic_index_in_dim`.
With a `stacked_dot` hook as well, the body reads them in place instead: the layer's jaxpr is
evaluated with lazy rows, its `x @ W` dots go to the hook (e.g. a kernel reading `[L, K, N]` given
the layer index), and stacked inputs that come back updated (a KV cache) ride in the scan carry,
written at row `i` (`inplace`).

**Packing.** Stacked inputs that are leaves of one argument of the function (per-layer weights,
per-layer caches) are stacked once, by `plan.pack`, into a `Packed` pytree, and the scan reads the
stacks directly, so the looped step never copies weights per call. Stacked inputs computed inside
the function, or read by a run nested in a jit/cond/scan of the function, are stacked inside it
(the report says so; that is a copy per call of `looped`). So give the function per-layer leaves
(a list of per-layer dicts), not an `[L, ...]` array it slices per layer. A jit wrapping the whole
function is looked through. `packed_outputs={out_index: argnum}` returns an output subtree (e.g.
the updated cache) packed like argument `argnum`, so state can stay packed across steps; the
report notes whether each of its stacks is the scan's own output (no copy).

**Name scopes.** Equations keep their `source_info.name_stack`. The scan is emitted under the
calls' common scope; per-call scopes `layers_0`, `layers_1`, ... collapse into one body scope
`layers`. Idempotent: looping a looped function changes nothing (the body holds a single call).

**Modules** (each imports only those after it): `plan` (`kernel_loop`, `LoopPlan`), `rewrite` (the
interpreter that emits the scans), `inplace` (the scan body that reads stacks in place, its hooks
and `SplitSum`), `pack` (`Packed`, `PackLayout`, lazy rows), `find` (structural keys, the rules,
`Analysis`), `report` (`LoopReport`). docs/looping.md is the design page.
"""

from jaxdecode.looping.inplace import SplitSum, StackedCall, StackedDot, StackedRef, outside_runs, takes_split_sums
from jaxdecode.looping.pack import Packed, PackLayout
from jaxdecode.looping.plan import INDEX_MODES, LoopPlan, kernel_loop, layer
from jaxdecode.looping.report import InputReport, LoopReport, RunReport, SkipReport

__all__ = [
    "INDEX_MODES",
    "InputReport",
    "LoopPlan",
    "LoopReport",
    "PackLayout",
    "Packed",
    "RunReport",
    "SkipReport",
    "SplitSum",
    "StackedCall",
    "StackedDot",
    "StackedRef",
    "kernel_loop",
    "layer",
    "takes_split_sums",
    "outside_runs",
]
