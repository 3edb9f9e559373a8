"""The tensor-parallel all-reduce (`kernels.allreduce`, `model.tp_residual_add`): against lax.psum and the host sum.

On 2 Hopper GPUs (the device machine) both one-shot Mosaic GPU kernels (behind XLA's barrier, and
barrier-free with persistent flags) run compiled and must equal psum bit for bit, on both devices,
also in a loop of dependent calls. Mosaic GPU's interpreter does
not model semaphores, so on the CPU the checks are what the CPU can show: `all_reduce` falls back to
psum (equal to the host sum), the kernel's input checks, and the kernel-looping pass traced over a
tensor-parallel model whose layers call the kernel (they must still loop into one scan). The
2-device CPU checks run in a subprocess with fake devices (the session's JAX has one).
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.config import TensorParallel, get_preset
from kernels import allreduce

# -- the worker (a subprocess with 2 fake CPU devices) -----------------------------------------------


def _worker() -> dict:
    from jax.sharding import PartitionSpec as P

    from jaxdecode.tp import AXIS, TPForward, make_mesh

    mesh = make_mesh(2)
    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    x16 = jnp.asarray(x, jnp.bfloat16)  # rows [0, 2) on device 0, [2, 4) on device 1
    run = lambda fn: np.asarray(
        jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS), check_vma=False))(x16), np.float32
    )
    got, ref = run(lambda v: allreduce.all_reduce(v, AXIS)), run(lambda v: jax.lax.psum(v, AXIS))
    host = (np.asarray(x16[:2], np.float32) + np.asarray(x16[2:], np.float32)).astype(jnp.bfloat16).astype(np.float32)
    # with a residual: r + psum(x), r = x / 4 (exact in bf16), against the host's two roundings
    with_residual = run(lambda v: allreduce.all_reduce(v, AXIS, residual=v * jnp.asarray(0.25, v.dtype)))
    host_residual = (np.asarray(x16[:2], np.float32) / 4 + host).astype(jnp.bfloat16).astype(np.float32)
    # The looping pass over a TP model whose layers call the kernel (traced only: Mosaic GPU kernels
    # do not lower on the CPU). The kernel applies where dim is a multiple of 128.
    allreduce.on_hopper = lambda: True
    cfg = get_preset("tiny-gqa").replace(dim=128, head_dim=16)
    tp = TPForward.random(cfg, 2, dtype=jnp.bfloat16, loop_mode="inplace", allreduce="kernel")
    plan = tp.plan(1, 1, 64, jnp.bfloat16)
    tokens = jnp.zeros((1, 1), jnp.int32)
    step_params = tp.step_params  # the weights and the barrier-free kernel's persistent buffers
    step = str(jax.make_jaxpr(tp.forward)(step_params, tokens, tokens, tp.new_cache(1, 64, jnp.bfloat16)))
    wrap_state = np.asarray(allreduce.persistent_buffers(mesh, AXIS, jnp.bfloat16, start=-3)[0]).tolist()
    # Two engines of one config in one process, both taking the kernel path. The Mosaic kernel does not
    # run on the CPU, so a psum that also reads the buffers stands in for it. Before the layer call took
    # the buffers as arguments, the second engine found the first one's tracers in jit's cache
    # (UnexpectedTracerError on the GPU; here "Computation compiled for 23 inputs but called with 21").
    from jaxdecode.decode import Engine
    from kernels.rms_norm import rms_norm_reference

    def stand_in(v, axis, state, mailbox, residual=None, norm=None):
        total = jax.lax.psum(v, axis) + (state[0] * 0).astype(v.dtype) + mailbox[0, 0] * 0
        total = total if residual is None else residual + total
        if norm is None:
            return total
        weights, layer, eps = norm  # the residual_norm hook: the sum and its norm
        return total, rms_norm_reference(total, weights, layer, eps=eps)

    allreduce.all_reduce_persistent = stand_in
    jax.clear_caches()  # the traces above hold the real kernel
    second_engine = []
    for _ in range(2):
        engine = Engine(None, tp=TPForward.random(cfg, 2, dtype=jnp.bfloat16, loop_mode="inplace", allreduce="kernel"))
        try:
            second_engine.append(engine.generate([[1, 2, 3]], max_new_tokens=4, chunk=2).token_ids)
        except (jax.errors.UnexpectedTracerError, TypeError) as e:  # the two ways the stale trace showed
            second_engine.append(f"{type(e).__name__}: {str(e)[:200]}")
    return {
        "equal_psum": bool(np.array_equal(got, ref)),
        "equal_host": bool(np.array_equal(got[:2], host)),
        "wrap_state": wrap_state,
        "two_engines": second_engine,
        "residual_equal_host": bool(np.array_equal(with_residual[:2], host_residual)),
        "devices_equal": bool(np.array_equal(got[:2], got[2:])),
        "runs": [r.length for r in plan.report.runs],
        "layers": cfg.n_layers,
        "kernels_in_step": step.count("mpmd_map"),
    }


if __name__ == "__main__" and os.environ.get("ALLREDUCE_TEST_WORKER"):
    print(json.dumps(_worker()))
    sys.exit(0)


# -- the tests ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def worker():
    env = {
        **os.environ,
        "ALLREDUCE_TEST_WORKER": "1",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip(),
    }
    proc = subprocess.run(
        [sys.executable, __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_engine_of_the_same_config_runs(worker):
    """Two tensor-parallel engines of one config in one process, the kernel path traced in both: the
    second generates the same tokens instead of finding the first one's tracers in jit's cache."""
    first, second = worker["two_engines"]
    assert isinstance(second, list), second
    assert first == second and len(first[0]) == 4


def test_buffers_can_start_before_the_wrap(worker):
    """persistent_buffers(start=-3): each device's call count and flag as if 2^32 - 3 calls had run."""
    assert worker["wrap_state"] == [-3, -3, 0, 0] * 2


def test_cpu_falls_back_to_psum(worker):
    assert worker["equal_psum"] and worker["equal_host"] and worker["devices_equal"]
    assert worker["residual_equal_host"]


def test_layers_calling_the_kernel_still_loop(worker):
    """One scan over all layers, whose body holds the kernel twice (after o_proj and down_proj, each
    with the residual add); the embedding's psum stays a psum."""
    assert worker["runs"] == [worker["layers"]]
    assert worker["kernels_in_step"] == 2, worker


def test_kernel_refuses_inputs_it_does_not_take():
    assert allreduce.fits(jnp.zeros((8, 4096), jnp.bfloat16))
    for bad in (
        jnp.zeros((1, 4096), jnp.float32),
        jnp.zeros((1, 100), jnp.bfloat16),
        jnp.zeros((32, 4096), jnp.bfloat16),
    ):
        assert not allreduce.fits(bad)
        with pytest.raises(ValueError, match="all-reduce kernel takes"):
            allreduce.all_reduce_kernel(bad, "tp", 2)


def test_buffers_are_the_pair_or_nothing():
    state, mailbox = jnp.zeros((allreduce.STATE_WORDS,), jnp.int32), jnp.zeros((2, 128), jnp.bfloat16)
    x = jnp.zeros((1, 128), jnp.bfloat16)
    assert not allreduce.takes(x, "tp", ())  # no buffers: psum (and on the CPU, never the kernel)
    with pytest.raises(ValueError, match=r"\(state, mailbox\) or nothing, got 1"):
        allreduce.takes(x, "tp", (state,))
    with pytest.raises(ValueError, match=r"\(state, mailbox\) or nothing, got 3"):
        allreduce.takes(x, "tp", (state, mailbox, mailbox))


def test_config_names_a_bad_allreduce():
    with pytest.raises(ValueError, match="TensorParallel.allreduce must be one of .* got 'nccl'"):
        TensorParallel(allreduce="nccl")
    assert "tp_axis" not in {f.name for f in dataclasses.fields(get_preset("tiny-gqa"))}  # not a model's setting


# -- compiled, on 2 Hopper GPUs ------------------------------------------------------------------------


def _hopper_pair() -> bool:
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    return len(gpus) >= 2 and all(getattr(d, "compute_capability", "") == "9.0" for d in gpus[:2])


@pytest.mark.skipif(not _hopper_pair(), reason="needs 2 Hopper GPUs (the kernel is Mosaic GPU with remote refs)")
@pytest.mark.parametrize("impl", ["barrier", "persistent", "persistent_wrap"])
@pytest.mark.parametrize("batch", [1, 8, 16])
def test_kernel_equals_psum_on_gpus(batch, impl):
    """Both kernels (behind XLA's barrier; barrier-free with persistent flags and mailbox) equal psum
    bit for bit on both devices, once and over 50 dependent calls. "persistent_wrap" starts the
    barrier-free kernel's counter 3 calls before the 32-bit wrap, so the loop crosses it."""
    from jax.sharding import PartitionSpec as P

    from jaxdecode.tp import AXIS, make_mesh

    mesh = make_mesh(2)
    # the same arrays for every call below
    bufs = allreduce.persistent_buffers(mesh, AXIS, jnp.bfloat16, start=-3 if impl == "persistent_wrap" else 0)
    kernel = (
        (lambda v, *b: allreduce.all_reduce_kernel(v, AXIS, 2))
        if impl == "barrier"
        else (lambda v, *b: allreduce.all_reduce_persistent(v, AXIS, *b))
    )
    psum = lambda v, *b: jax.lax.psum(v, AXIS)

    def sharded(fn):
        run = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(AXIS),) * 3, out_specs=P(AXIS), check_vma=False))
        return lambda v: np.asarray(run(v, *bufs), np.float32)

    x = jnp.asarray(np.random.default_rng(batch).standard_normal((2 * batch, 4096)), jnp.bfloat16)
    got, ref = sharded(kernel)(x), sharded(psum)(x)
    assert np.array_equal(got, ref) and np.array_equal(got[:batch], got[batch:])

    def loop(reduce):  # 50 dependent calls, each input different on each device
        def body(v, *b):
            bump = (jax.lax.axis_index(AXIS) + 1).astype(v.dtype) * jnp.asarray(1e-2, v.dtype)
            return jax.lax.fori_loop(0, 50, lambda i, v: reduce(v, *b) * jnp.asarray(0.5, v.dtype) + bump, v)

        return sharded(body)(x)

    assert np.array_equal(loop(kernel), loop(psum))


def _bf16(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32)


@pytest.mark.skipif(not _hopper_pair(), reason="needs 2 Hopper GPUs (the kernel is Mosaic GPU with remote refs)")
@pytest.mark.parametrize("batch", [1, 2])
def test_kernel_with_residual_equals_psum_then_add_on_gpus(batch):
    """r + Σ x in the barrier-free kernel, as the decode uses it: x different on each device (a partial
    sum), r the same on both (the residual stream), both already in memory. Once: equal bit for bit to
    `r + psum(x)` and to the host's two bf16 roundings. Over 50 dependent calls, each sum the next
    residual and each partial halved plus a device-dependent bump: equal to the host's replay with a
    bf16 rounding after every op. (XLA's psum in such a loop is not a reference: on the H200 it drifts
    from the per-op rounding from the second step on, with or without XLA's excess precision, while
    the kernel, and the kernel followed by an XLA add, match the replay exactly; docs/log/2026-11-30.md.)"""
    from jax.sharding import PartitionSpec as P

    from jaxdecode.tp import AXIS, make_mesh

    mesh = make_mesh(2)
    bufs = allreduce.persistent_buffers(mesh, AXIS, jnp.bfloat16)
    kernel = lambda v, r, *b: allreduce.all_reduce_persistent(v, AXIS, *b, residual=r)  # noqa: E731
    reference = lambda v, r, *b: r + jax.lax.psum(v, AXIS)  # noqa: E731

    def sharded(fn):
        run = jax.jit(
            jax.shard_map(fn, mesh=mesh, in_specs=(P(AXIS), P(), P(AXIS), P(AXIS)), out_specs=P(AXIS), check_vma=False)
        )
        return lambda v, r: np.asarray(run(v, r, *bufs), np.float32)

    rng = np.random.default_rng(batch)
    x = jnp.asarray(rng.standard_normal((2 * batch, 4096)), jnp.bfloat16)  # each device's partial
    r = jnp.asarray(4 * rng.standard_normal((batch, 4096)), jnp.bfloat16)  # replicated
    got, ref = sharded(kernel)(x, r), sharded(reference)(x, r)
    assert np.array_equal(got, ref) and np.array_equal(got[:batch], got[batch:])
    parts, res = [np.asarray(x[:batch], np.float32), np.asarray(x[batch:], np.float32)], np.asarray(r, np.float32)
    assert np.array_equal(got[:batch], _bf16(res + _bf16(parts[0] + parts[1])))

    def body(v, r, *b):
        def step(i, carry):
            v, r = carry
            bump = (jax.lax.axis_index(AXIS) + 1).astype(v.dtype) * jnp.asarray(1e-2, v.dtype)
            return v * jnp.asarray(0.5, v.dtype) + bump, kernel(v, r, *b)

        return jax.lax.fori_loop(0, 50, step, (v, r))[1]

    looped = sharded(body)(x, r)
    bumps = [_bf16(np.float32(1e-2)), _bf16(2 * _bf16(np.float32(1e-2)))]
    for _ in range(50):
        res = _bf16(res + _bf16(parts[0] + parts[1]))
        parts = [_bf16(p * 0.5 + bump) for p, bump in zip(parts, bumps)]
    assert np.array_equal(looped[:batch], res) and np.array_equal(looped[batch:], res)


@pytest.mark.skipif(not _hopper_pair(), reason="needs 2 Hopper GPUs (the kernel is Mosaic GPU with remote refs)")
@pytest.mark.parametrize("batch, dim", [(1, 4096), (2, 4096), (1, 8192), (2, 3584)])
def test_kernel_with_norm_equals_psum_add_then_norm_on_gpus(batch, dim):
    """r + Σ x and the RMSNorm of that sum in the barrier-free kernel (`norm=`, as `model.residual_norm`
    runs on 2 GPUs), the norm weight read in place from a stack of 3 layers at layer 1. The sum equals
    `r + psum(x)` bit for bit; the norm equals the model's `rms_norm` of it within one bf16 step (the sum
    of squares runs in another order) and is the same on both devices, bit for bit. Over 20 dependent
    calls (each sum the next residual), the same."""
    from jax.sharding import PartitionSpec as P

    from jaxdecode.model import rms_norm as model_rms_norm
    from jaxdecode.tp import AXIS, make_mesh

    mesh = make_mesh(2)
    bufs = allreduce.persistent_buffers(mesh, AXIS, jnp.bfloat16)
    rng = np.random.default_rng(dim + batch)
    weights = jnp.asarray(1 + 0.2 * rng.standard_normal((3, dim)), jnp.bfloat16)
    eps = 1e-5

    def kernel(v, r, w, *b):
        return allreduce.all_reduce_persistent(v, AXIS, *b, residual=r, norm=(w, jnp.int32(1), eps))

    def reference(v, r, w, *b):
        s = r + jax.lax.psum(v, AXIS)
        return s, model_rms_norm(s, w[1], np.float32(eps))

    def sharded(fn, steps=1):
        def body(v, r, w, *b):
            def step(i, carry):
                v, r, _ = carry
                s, n = fn(v, r, w, *b)
                return v * jnp.asarray(0.5, v.dtype), s, n

            return jax.lax.fori_loop(0, steps, step, (v, r, r))[1:]

        run = jax.jit(
            jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(P(AXIS), P(), P(), P(AXIS), P(AXIS)),
                out_specs=(P(AXIS), P(AXIS)),
                check_vma=False,
            )
        )
        return lambda v, r: [np.asarray(a, np.float32) for a in run(v, r, weights, *bufs)]

    x = jnp.asarray(rng.standard_normal((2 * batch, dim)), jnp.bfloat16)  # each device's partial
    r = jnp.asarray(4 * rng.standard_normal((batch, dim)), jnp.bfloat16)  # replicated
    for steps in (1, 20):
        (s, n), (ref_s, ref_n) = sharded(kernel, steps)(x, r), sharded(reference, steps)(x, r)
        assert np.isfinite(n).all()
        assert np.array_equal(s, ref_s) and np.array_equal(s[:batch], s[batch:])
        assert np.array_equal(n[:batch], n[batch:])
        np.testing.assert_allclose(n, ref_n, rtol=2.0**-7, atol=0)
        assert (n == ref_n).mean() > 0.99  # one step apart only where the two sums of squares round apart
