"""Tensor-parallel decode (jaxdecode.tp) equals one device: logits and greedy tokens, looped and unrolled.

The test session has already started JAX with one CPU device, so the comparisons run in subprocesses
with fake devices (XLA_FLAGS=--xla_force_host_platform_device_count=N): this file, run as a script,
is the worker; it prints one JSON object of results. The error cases run here, on one device.
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxdecode.config import ModelConfig

RTOL = 1e-5  # f32; TP only reorders the sums of o_proj and down_proj (psum of tp partial sums)


# -- the worker (runs in a subprocess with fake devices) --------------------------------------------


def _compare(
    cfg, tp: int, *, loop: bool, generate: bool = True, mode: str = "slice", hooks=None, tp_hooks=None, quantize=None
) -> dict:
    """quantize: a format, its weights quantized in groups of 8 (the tiny models' shards of o and down hold
    24 and 40 inputs), split as codes, scales and offsets."""
    from jaxdecode.decode import Engine
    from jaxdecode.model import init_random, quantize_weights

    model = init_random(cfg, seed=5)
    if quantize is not None:
        model = quantize_weights(model, quantize, group=8)
    prompts = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 7))
    one = Engine(model, loop_layers=loop, loop_mode=mode, hooks=hooks)
    split = Engine(model, loop_layers=loop, loop_mode=mode, tp=tp, hooks={**(hooks or {}), **(tp_hooks or {})})
    a, b = one.forward_logits(prompts), split.forward_logits(prompts)  # [B, T, V]
    out = {
        "rel": float(np.abs(a - b).max() / np.abs(a).max()),
        "shape": list(b.shape),
        "scans": [r.length for r in split.tp_forward.plan(2, 7, 7, np.float32).report.runs] if loop else [],
    }
    if generate:  # greedy, through the cache and the on-device chunk loop (prompts of different lengths)
        rows = [prompts[0].tolist(), prompts[1, :4].tolist()]
        out["tokens_one"] = one.generate(rows, max_new_tokens=9, chunk=4).token_ids
        out["tokens_tp"] = split.generate(rows, max_new_tokens=9, chunk=4).token_ids
    return out


def _random_in_place(cfg, tp: int) -> dict:
    """`TPForward.random` makes the same model for every tp: logits of tp devices vs one."""
    import jax.numpy as jnp

    from jaxdecode.decode import Engine
    from jaxdecode.tp import TPForward

    prompts = np.random.default_rng(2).integers(0, cfg.vocab_size, (1, 6))
    a, b = (
        Engine(None, tp=TPForward.random(cfg, n, dtype=jnp.float32, seed=3)).forward_logits(prompts) for n in (1, tp)
    )
    return {"rel": float(np.abs(a - b).max() / np.abs(a).max()), "spread": float(a.std())}


def _compare_with_hook(cfg, name: str, hook, *, tp_only: bool = False) -> dict:
    """`_compare` over 2 devices in the in-place mode with the hook `name` replaced by `hook`, passed
    through the engines' public `hooks` argument: to both, or with `tp_only` to the 2-device engine."""
    if tp_only:
        return _compare(cfg, 2, loop=True, mode="inplace", tp_hooks={name: hook})
    return _compare(cfg, 2, loop=True, mode="inplace", hooks={name: hook})


def _compare_qkv_attend(cfg) -> dict:
    """The in-place mode with the q·k·v epilogue hook in interpret mode (a jnp stand-in for the GEMM's
    partials), on 2 devices and on one: the kernel writes each device's shard of the carried caches."""
    import functools

    from jaxdecode import hooks
    from kernels.decode_attention import BlockSizes as AttentionBlocks
    from kernels.flat_gemm_stream import StreamBlocks
    from tests.test_inplace_qkv_attend import reference_partials

    ran = []

    def hook(*args):  # tiles of 8 divide a device's widths (q 24, k and v 8) and hold half a head (4)
        out = hooks.kernel_qkv_attend(
            *args,
            impl="stream",
            partials=functools.partial(reference_partials, tile=8),
            gemm_blocks=StreamBlocks(tile_n=8, tile_k=16),
            attention_blocks=AttentionBlocks(16, 2),
            epilogue_backend="triton",  # heads of 8: below Mosaic GPU's tiles
            attention_backend="triton",
            interpret=True,
        )
        if out is not None:
            ran.append(args[6].stack.shape[2])  # w_q's width: 48 on one device, 24 on each of two
        return out

    out = _compare_with_hook(cfg, "qkv_attend", hook)
    return {**out, "hook_widths": sorted(set(ran))}


def _compare_residual_norm(cfg) -> dict:
    """The in-place mode on 2 devices with the `residual_norm` hook and a psum-based stand-in for the
    all-reduce kernel with the add and the norm (Mosaic GPU's interpreter has no peer memory), so what is
    checked is the hook's wiring: bound to the mesh axis, it all-reduces the partial sums before adding."""
    import jax

    from jaxdecode import hooks
    from kernels.rms_norm import rms_norm_reference

    ran = []

    def all_reduce_norm(block_out, axis, *comm, residual, norm):
        weights, layer, eps = norm
        total = residual + jax.lax.psum(block_out, axis)
        return total, rms_norm_reference(total, weights, layer, eps=eps)

    def hook(*args, axis, allreduce_impl):
        out = hooks.kernel_residual_norm(
            *args, axis=axis, allreduce_impl=allreduce_impl, all_reduce_norm=all_reduce_norm
        )
        if out is not None:
            ran.append(axis)
        return out

    out = _compare_with_hook(cfg, "residual_norm", hook, tp_only=True)  # bound to the mesh axis by the TP engine
    return {**out, "hook_axes": sorted(set(ran))}


def _group_cut(cfg_name: str = "tiny-gqa", fmt: str = "int4") -> str:
    """Groups of 16 over 2 devices: down's 80 inputs (and o's 48) split into shards of 40 (24), which cut a group.
    fmt "q4_k_m" on KQUANT_CUT: o's 256 inputs split into shards of 128, which cut a super-block of 256."""
    from jaxdecode.config import PRESETS
    from jaxdecode.decode import Engine
    from jaxdecode.model import init_random, quantize_weights

    cfg = PRESETS.get(cfg_name, KQUANT_CUT)
    try:
        Engine(quantize_weights(init_random(cfg, seed=5), fmt, group=16), tp=2)
    except ValueError as e:
        return str(e)
    return "no error"


# K-quants over 2 devices: every shard of a row-parallel weight (o: 512 inputs, down: 1024) holds whole super-blocks
# of 256; 3 layers, the last with v and down in Q6_K (two runs of equal layers). KQUANT_CUT: o's shards of 128 do not.
KQUANT = ModelConfig("tiny-kquant-tp", 97, 512, 3, 4, 2, 1024, head_dim=128, max_seq_len=64)
KQUANT_CUT = ModelConfig("tiny-kquant-cut", 97, 256, 1, 2, 2, 512, head_dim=128, max_seq_len=64)


def _default_model_tp3() -> dict:
    """The shipped SmolLM2-135M (9 heads, 3 kv heads) over 3 devices, its Q4_1 weights kept quantized:
    greedy answer of one and of three."""
    from jaxdecode.decode import Engine
    from jaxdecode.loading import load_model

    loaded = load_model()
    tok = loaded.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    one, split = (
        Engine(loaded.model, tp=n).generate([ids], max_new_tokens=8, eos_ids=tok.eos_token_ids).token_ids[0]
        for n in (1, 3)
    )
    return {"tokens_one": one, "tokens_tp": split, "text": tok.decode(split)}


def _engine_freed(cfg) -> bool:
    """A TP engine timed by `bench.time_engine` is freed once the caller drops it: time_engine caches
    the compiled steps on the engine, not in a module-level WeakKeyDictionary whose values (closing
    over the engine) kept every engine alive (a second 70B engine on 2 GPUs ran out of memory)."""
    import gc
    import weakref

    from jaxdecode.bench import time_engine
    from jaxdecode.decode import Engine
    from jaxdecode.model import init_random

    engine = Engine(init_random(cfg, seed=5), tp=2)
    time_engine(engine, np.ones((1, 4), np.int32), context=0, steps=2)
    alive = weakref.ref(engine)
    del engine
    gc.collect()
    return alive() is None


def worker(devices: int) -> dict:
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    from jaxdecode.config import PRESETS

    assert len(jax.devices()) == devices
    gqa = PRESETS["tiny-gqa"]  # N 6, K 2, V 97: the vocab is padded to 98
    if devices == 2:
        return {
            "gqa_unrolled": _compare(gqa, 2, loop=False),
            "gqa_looped": _compare(gqa, 2, loop=True),
            "tied_looped": _compare(
                gqa.replace(name="tiny-gqa-tied", tie_embeddings=True), 2, loop=True, generate=False
            ),
            "vocab_even_looped": _compare(
                gqa.replace(name="tiny-gqa-v96", vocab_size=96), 2, loop=True, generate=False
            ),
            # the GPU's mode: whole stacks in the scan body, the KV cache updated in the carry (f32 on
            # the CPU: the dots stay XLA dots, no kernel)
            "gqa_inplace": _compare(gqa, 2, loop=True, generate=False, mode="inplace"),
            "gqa_inplace_qkv_attend": _compare_qkv_attend(gqa),
            "gqa_inplace_residual_norm": _compare_residual_norm(gqa),
            "random_in_place": _random_in_place(gqa, 2),
            "gqa_int4_looped": _compare(gqa, 2, loop=True, quantize="int4"),
            "gqa_int8_inplace": _compare(gqa, 2, loop=True, mode="inplace", quantize="int8"),
            "tied_int4_unrolled": _compare(  # the quantized table: the embedding's rows and the tied head's
                gqa.replace(name="tiny-gqa-tied", tie_embeddings=True), 2, loop=False, quantize="int4"
            ),
            "group_cut": _group_cut(),
            "kquant_looped": _compare(KQUANT, 2, loop=True, quantize="q4_k_m"),
            "kquant_cut": _group_cut("tiny-kquant-cut", "q4_k_m"),
            "engine_freed": _engine_freed(gqa),
        }
    mha = PRESETS["tiny-mha"]  # N 4, K 4, F 80, V 97 -> 100
    return {
        "mha_looped": _compare(mha, 4, loop=True),
        "mha_unrolled": _compare(mha, 4, loop=False, generate=False),
        "qwen2_bias_looped": _compare(PRESETS["tiny-qwen2"], 2, loop=True),  # on 2 of the 4 devices
        "default_model_tp3": _default_model_tp3(),
    }


def _launch(devices: int) -> subprocess.Popen:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the worker imports `tests.*`
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", PYTHONPATH=path
    )
    return subprocess.Popen(
        [sys.executable, __file__, str(devices)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.fixture(scope="module")
def results():
    """Both workers, run at once (they are mostly compilation, single-threaded)."""
    procs = {n: _launch(n) for n in (2, 4)}
    out = {}
    for n, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        out[n] = json.loads(stdout.strip().splitlines()[-1])
    return out


# -- the comparisons ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "devices, case",
    [
        (2, "gqa_unrolled"),
        (2, "gqa_looped"),
        (2, "tied_looped"),
        (2, "vocab_even_looped"),
        (2, "gqa_inplace"),
        (2, "gqa_inplace_qkv_attend"),
        (2, "gqa_inplace_residual_norm"),
        (2, "gqa_int4_looped"),
        (2, "gqa_int8_inplace"),
        (2, "tied_int4_unrolled"),
        (4, "qwen2_bias_looped"),
        (4, "mha_looped"),
        (4, "mha_unrolled"),
    ],
)
def test_tp_logits_equal_one_device(results, devices, case):
    r = results[devices][case]
    assert r["rel"] < RTOL
    v = 96 if case == "vocab_even_looped" else 97
    assert r["shape"] == [2, 7, v]  # padded vocab entries are cut before anyone samples them


@pytest.mark.parametrize(
    "devices, case",
    [
        (2, "gqa_unrolled"),
        (2, "gqa_looped"),
        (2, "gqa_inplace_qkv_attend"),
        (2, "gqa_inplace_residual_norm"),
        (2, "gqa_int4_looped"),
        (2, "gqa_int8_inplace"),
        (2, "tied_int4_unrolled"),
        (4, "qwen2_bias_looped"),
        (4, "mha_looped"),
    ],
)
def test_tp_greedy_tokens_equal_one_device(results, devices, case):
    r = results[devices][case]
    assert r["tokens_tp"] == r["tokens_one"]
    assert [len(t) for t in r["tokens_tp"]] == [9, 9]


def test_default_model_on_3_devices_answers_like_one(results):
    r = results[4]["default_model_tp3"]
    assert r["tokens_tp"] == r["tokens_one"] and "Paris" in r["text"]


def test_quantized_shards_that_cut_a_group_are_refused_with_the_numbers(results):
    msg = results[2]["group_cut"]
    assert "down_proj" in msg and "80 inputs in groups of 16" in msg and "shards of 40 inputs" in msg, msg
    msg = results[2]["kquant_cut"]  # two levels: the unit a shard must hold is the super-block
    assert "o_proj" in msg and "256 inputs in super-blocks of 256" in msg and "shards of 128 inputs" in msg, msg


def test_k_quants_split_over_two_devices_as_on_one(results):
    """Q4_K_M (two-level Q4_K and Q6_K, layers of two formats) over 2 devices: the same logits as one device, up
    to f32 summation order, and the same greedy tokens."""
    r = results[2]["kquant_looped"]
    assert r["rel"] < 1e-5 and r["tokens_tp"] == r["tokens_one"], r
    assert r["scans"] == [2], r  # layers 0 and 1 share a scan; layer 2 (v and down in Q6_K) runs on its own


def test_tp_runs_the_qkv_epilogue_kernel(results):
    """The hook ran (did not decline) in the decode steps compared above, on one device (q width 48) and on
    each of the two (24)."""
    assert results[2]["gqa_inplace_qkv_attend"]["hook_widths"] == [24, 48]


def test_tp_runs_the_residual_norm_hook(results):
    """The hook ran in the tensor-parallel decode steps compared above, bound to the mesh axis."""
    assert results[2]["gqa_inplace_residual_norm"]["hook_axes"] == ["tp"]


def test_timed_tp_engine_is_freed(results):
    assert results[2]["engine_freed"]


def test_looped_tp_runs_the_layers_as_one_scan(results):
    # The psums sit inside the layer calls: the calls stay identical and the pass loops all of them.
    assert results[2]["gqa_looped"]["scans"] == [3]
    assert results[2]["gqa_inplace"]["scans"] == [3]
    assert results[4]["mha_looped"]["scans"] == [3]


def test_random_weights_made_in_place_do_not_depend_on_tp(results):
    r = results[2]["random_in_place"]
    assert r["rel"] < RTOL and r["spread"] > 0.1


def test_tp_scaling_dry_run_writes_every_tp(tmp_path):
    """benchmarks/tp_scaling.py --dry-run (8 fake CPU devices, a tiny config): one row per tp and batch,
    scaling efficiency 1 at the first tp, no all-reduce at TP 1, rdu predictions and their MAPE; a tp
    above the visible devices is skipped with the reason."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "tp_scaling.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(root, "benchmarks", "tp_scaling.py"),
            "--dry-run",
            "--models",
            "tiny-tp8",
            "--tp",
            "1,2,4,8,16",
            "--batches",
            "1",
            "--psum-chain",
            "5",
            "--out",
            str(out),
        ],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["devices"] == 8 and data["errors"] == []
    rows = {(r["tp"], r["batch"]): r for r in data["rows"]}
    assert sorted(rows) == [(1, 1), (2, 1), (4, 1), (8, 1)]
    assert [(s["tp"], "16 > 8 visible devices" in s["reason"]) for s in data["skipped"]] == [(16, True)]
    for (tp, b), r in rows.items():
        assert r["ms_per_token"] > 0 and r["tok_s"] == pytest.approx(b * 1e3 / r["ms_per_token"], rel=0.02)
        assert r["base_tp"] == 1 and r["scaling_eff"] == pytest.approx(r["speedup_vs_base"] / tp, abs=2e-3)
        if tp == 1:
            assert r["scaling_eff"] == 1 and r["allreduce_ms_per_token"] == 0 and r["psums_per_token"] == 0
        else:  # 2 psums per layer + the embedding's
            assert r["allreduce_us_per_psum"] > 0 and r["psums_per_token"] == 2 * 2 + 1
            assert r["allreduce_ms_per_token"] == pytest.approx(r["allreduce_us_per_psum"] * 5 / 1e3, abs=1e-3)
        for mode in ("xla", "looped_inplace"):
            assert r[f"rdu_{mode}_ms"] > 0 and f"rdu_{mode}_delta_pct" in r
    assert {"xla", "looped_inplace"} <= set(data["rdu_mape_pct"])
    assert proc.stdout.rstrip().splitlines()[-1].startswith("dry run:")  # the table and the summary come last


# -- errors and the preflight (one device, in this process) -----------------------------------------


def test_heads_not_divisible_is_refused_with_the_numbers():
    from jaxdecode.config import PRESETS, shard_config

    with pytest.raises(
        ValueError,
        match=r"smollm2-135m cannot be split over 2 devices: n_heads \(9\), "
        r"n_kv_heads \(3\).*tp in \[1, 3\] works",
    ):
        shard_config(PRESETS["smollm2-135m"], 2)
    with pytest.raises(ValueError, match=r"n_kv_heads \(1\)"):
        shard_config(PRESETS["tiny-mqa"], 2)
    shard = shard_config(PRESETS["smollm2-135m"], 3)
    assert (shard.n_heads, shard.n_kv_heads, shard.ffn_dim, shard.head_dim) == (3, 1, 512, 64)


def test_more_devices_than_present_is_refused():
    from jaxdecode.config import PRESETS
    from jaxdecode.decode import Engine
    from jaxdecode.model import init_random

    with pytest.raises(ValueError, match=r"--tp 2 needs 2 devices, but JAX sees 1 \(cpu\)"):
        Engine(init_random(PRESETS["tiny-gqa"]), tp=2)


def test_load_engine_keeps_the_quantization_asked_for():
    """The --tp path loads as the one-device path does: --quantize draws a preset quantized (it made dense
    random weights before), and the shards keep the codes."""
    from jaxdecode.loading import load_engine

    engine, _ = load_engine("tiny-gqa", 1, quantize="int4")
    codes = [a for a in jax.tree.leaves(engine.params) if a.dtype in ("int4", "int8")]  # int8 here (the CPU)
    assert len(codes) == 8  # the 7 stacked projections of the looped engine and the LM head


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "Hi", "--tp", "2"],  # the default model: 1 device here (and 9 heads would not split by 2)
        ["bench", "--model", "tiny-gqa", "--tp", "2"],
        ["bench", "--model", "tiny-gqa", "--tp", "0"],
        ["bench", "--model", "tiny-gqa", "--tp", "2", "--batches", "1"],  # suite mode: plain only
    ],
)
def test_cli_tp_errors_exit_2_with_one_line(capsys, argv):
    from jaxdecode.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxdecode: error:") and "tp" in err[0]


def test_preflight_is_per_device():
    from jaxdecode.config import get_preset
    from jaxdecode.memory import estimate, preflight

    cfg = get_preset("llama-3.1-70b")
    one, two = (
        estimate(cfg, itemsize=2, context=1024, looped=False),
        estimate(cfg, itemsize=2, context=1024, looped=False, tp=2),
    )
    replicated = 2 * (2 * cfg.n_layers * cfg.dim + cfg.dim)  # the norms, in bytes
    assert two.weights == (one.weights - replicated) // 2 + replicated  # V = 128256 splits evenly
    assert two.kv_cache * 2 == one.kv_cache
    h200 = 139 * 2**30
    with pytest.raises(ValueError, match="does not fit"):
        preflight(cfg, itemsize=2, context=1024, looped=False, available=h200)
    assert preflight(cfg, itemsize=2, context=1024, looped=False, available=h200, tp=2).total < h200


def test_device_gap_chains_compute_the_same_on_one_device_and_two():
    """benchmarks/device_gap_gpu.py's setups (2 fake CPU devices, small slabs): every setup without a
    psum computes the chain one device computes, on each device (the sharded and concurrent forms run the
    same kernels, which is what the gap comparison assumes); with a psum, the chain plus the psum's term."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = """
import json, numpy as np, jax
from benchmarks import gpu_trace as d
d.SLAB = 256
out = {}
for s in ("one", "one_dev1", "two_jits", "shard2", "shard2_psum", "shard2+axis", "one+heavy", "shard2+heavy"):
    run, block = d.build(s)
    res = block(run())
    out[s] = [np.asarray(r, np.float32).reshape(-1).tolist() for r in (res if isinstance(res, list) else [res])]
print(json.dumps(out))
"""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {k: [np.asarray(v, np.float32) for v in vs] for k, vs in json.loads(proc.stdout.splitlines()[-1]).items()}
    (one,) = out["one"]
    assert one.shape == (8192,) and np.isfinite(one).all() and np.ptp(one) == 0 and one[0] != 0
    np.testing.assert_array_equal(out["one_dev1"][0], one)
    for a in out["two_jits"]:
        np.testing.assert_array_equal(a, one)
    np.testing.assert_array_equal(out["shard2"][0], np.concatenate([one, one]))
    # with the psum, each step adds 1e-6 · (sum over both devices of x[0]): bf16 keeps it or not, but the
    # two devices must agree element for element, and the result must stay near the plain chain's
    psum = out["shard2_psum"][0].reshape(2, -1)
    np.testing.assert_array_equal(psum[0], psum[1])
    np.testing.assert_allclose(psum[0], one, atol=0.05)
    # device 1 adds its index (1) once a step, and the chain's sin steps forget it again (a contraction to
    # one fixed point): both halves end where the plain chain ends
    axis = out["shard2+axis"][0].reshape(2, -1)
    np.testing.assert_allclose(axis, np.stack([one, one]), atol=0.02)
    # every heavy kernel adds 1e-6 · (a sum of ones over the slab): a small, equal shift on one device and two
    (heavy,) = out["one+heavy"]
    np.testing.assert_array_equal(out["shard2+heavy"][0], np.concatenate([heavy, heavy]))


if __name__ == "__main__":
    print(json.dumps(worker(int(sys.argv[1]))))
