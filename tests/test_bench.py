"""`jaxdecode bench` in suite mode on the CPU: the JSON rows are consistent, the plot is an image, and
the peers compute what our engine computes (HF eager gives the same greedy tokens from the same weights);
torch is needed only for the HF peers. benchmarks/ab.py: its variants become the engine's arguments, bad
ones are refused, and its rows are consistent, in one process and in one per variant."""

import contextlib
import dataclasses
import importlib.util
import io
import json
import os
import statistics
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import hf_model, state_dict_numpy

from jaxdecode.bench import cache_length, peers, time_engine
from jaxdecode.cli import main
from jaxdecode.config import PRESETS
from jaxdecode.cost import decode_cost
from jaxdecode.decode import Engine
from jaxdecode.hooks import KERNEL_CALLS, OPTIONAL_CALLS, TP_CALLS, kernel_stacked_dot
from jaxdecode.model import Hook, init_random, load_state_dict
from kernels.decode_attention import BlockSizes

BATCHES, CONTEXT, PROMPT, STEPS = (1, 2), 32, 16, 8
SYSTEMS = ("ours", "unrolled", "scan", "hf_eager")
REL = 1e-9  # the derived numbers are computed from the raw ones in float64


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = [
        "bench",
        "--models",
        "tiny-gqa",
        "--batches",
        ",".join(map(str, BATCHES)),
        "--contexts",
        str(CONTEXT),
        "--peers",
        "unrolled,scan,hf_eager",
        "--steps",
        str(STEPS),
        "--out",
        str(out),
    ]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(argv) == 0
    lines = (out / "bench.jsonl").read_text().splitlines()
    assert stdout.getvalue().splitlines() == lines  # stdout carries the same JSON lines, the summary last
    objs = [json.loads(line) for line in lines]
    return out, objs[:-1], objs[-1]


def test_rows_cover_every_system_and_config(suite):
    _, rows, summary = suite
    assert sorted((r["system"], r["batch"]) for r in rows) == sorted((s, b) for s in SYSTEMS for b in BATCHES)
    assert summary["summary"] is True and summary["rows"] == len(rows) and not summary["errors"]
    assert not summary["skipped"]
    for r in rows:
        assert {
            "model",
            "system",
            "batch",
            "context",
            "ms_per_token",
            "tok_s",
            "pct_roofline",
            "first_call_s",
            "prefill_ms",
            "bytes_per_step",
            "read_ceiling_gb_s",
            "device",
            "est_s",
        } <= r.keys()
        assert r["context"] == CONTEXT and r["prompt_len"] == PROMPT and r["steps"] == STEPS
        assert r["first_call_s"] > 0 and r["prefill_ms"] > 0 and r["ms_per_token"] > 0


def test_rows_are_internally_consistent(suite):
    _, rows, summary = suite
    cfg = PRESETS["tiny-gqa"]
    ours = {r["batch"]: r for r in rows if r["system"] == "ours"}
    for r in rows:
        step_s = r["ms_per_token"] / 1e3
        assert r["tok_s"] == pytest.approx(r["batch"] / step_s, rel=REL)
        moved = decode_cost(cfg, batch=r["batch"], context=CONTEXT + PROMPT + STEPS // 2, itemsize=4).bytes  # f32
        assert r["bytes_per_step"] == moved
        assert r["pct_roofline"] == pytest.approx(100 * moved / step_s / 1e9 / r["read_ceiling_gb_s"], rel=REL)
        assert r["cache_len"] == cache_length(CONTEXT, PROMPT, STEPS) == 64
        if r["system"] != "ours":
            ratio = ours[r["batch"]]["tok_s"] / r["tok_s"]
            assert r["ours_over_peer"] == pytest.approx(ratio, rel=REL)
            assert summary["ratios_ours_over_peer"][f"tiny-gqa B{r['batch']} ctx{CONTEXT}"][
                r["system"]
            ] == pytest.approx(ratio, rel=REL)
            assert r["tokens_agree"] == 1 + STEPS, f"{r['system']} B{r['batch']} decoded other tokens than ours"


def test_plot_is_a_png_image(suite):
    out, rows, summary = suite
    import matplotlib.image

    path = out / "bench.png"
    assert summary["plot"] == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 200 and img.std() > 0


@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-qwen2"])
def test_hf_copy_of_our_weights_is_exact(name):
    """build_hf(ours) reproduces, tensor for tensor, the HF model our weights were loaded from."""
    cfg = PRESETS[name]
    ref = hf_model(cfg, seed=3)
    ours = load_state_dict(init_random(cfg), state_dict_numpy(ref))
    copy = peers.build_hf(ours, device="cpu")
    want, got = ref.state_dict(), copy.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k


def test_hf_eager_decodes_our_greedy_tokens():
    """Same weights: HF's own generate, our HF decode loop and our engine agree token for token,
    with no prefix, and after a zero prefix of 20 cache rows (the bench's context)."""
    cfg = PRESETS["tiny-llama3"]
    model = init_random(cfg, seed=5)
    hf = peers.build_hf(model, device="cpu")
    prompts = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 7))
    steps = 6
    with torch.no_grad():
        generated = hf.generate(
            torch.as_tensor(prompts),
            max_new_tokens=steps + 1,
            min_new_tokens=steps + 1,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[:, prompts.shape[1] :].numpy()
    loop = peers.time_hf(hf, prompts, context=0, steps=steps, compiled=False).tokens
    np.testing.assert_array_equal(loop, generated)
    engine = Engine(model)
    np.testing.assert_array_equal(time_engine(engine, prompts, context=0, steps=steps).tokens, generated)
    theirs = peers.time_hf(hf, prompts, context=20, steps=steps, compiled=False).tokens
    np.testing.assert_array_equal(time_engine(engine, prompts, context=20, steps=steps).tokens, theirs)
    assert not np.array_equal(theirs, generated)  # the prefix is attended to: it changes the tokens


def test_dry_run_prints_the_gpu_suite(capsys):
    assert main(["bench", "--suite", "gpu", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("llama-3.1-8b") == 6 and out.count("qwen2.5-7b") == 6 and "total about" in out


def test_peer_restricted_to_some_configs(capsys):
    argv = [
        "bench",
        "--dry-run",
        "--models",
        "llama-3.1-8b",
        "--batches",
        "1,32",
        "--contexts",
        "1k,8k",
        "--peers",
        "scan,hf_static@1x1k+32x8k",
    ]
    assert main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "llama-3.1-8b" in line]
    assert len(lines) == 4 and all("scan" in line for line in lines)
    assert [("hf_static" in line) for line in lines] == [True, False, False, True]  # B1 1k, B1 8k, B32 1k, B32 8k
    # the same restriction written as two items (a run once measured only the last of them)
    argv[-1] = "scan,hf_static@1x1k,hf_static@32x8k"
    assert main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "llama-3.1-8b" in line]
    assert [("hf_static" in line) for line in lines] == [True, False, False, True]


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--peers", "vllm"], "vllm"),
        (["--contexts", "1k,big"], "--contexts"),
        (["--models", "tiny-gqa", "--contexts", "60"], "exceeds the model's context of 64"),
        (["--models", "llama-9b"], "llama-9b"),
        (["--peers", "hf_static@1by1k"], "NAME@BxC"),
        (["--peers", "scan,scan"], "twice"),
    ],
)
def test_bad_suite_flags_exit_2(argv, match, capsys):
    assert main(["bench", "--dry-run", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and match in err, err


_WITHOUT_TORCH = """
import sys


class Blocker:  # torch and transformers cannot be imported, as without the extra
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Blocker())
from jaxdecode.cli import main

common = ["bench", "--models", "tiny-gqa", "--batches", "1", "--contexts", "8", "--steps", "2", "--ceiling-gib", "0.01"]
plain = main([*common, "--peers", "unrolled"])
imported = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print("RESULT", plain, main([*common, "--peers", "unrolled,hf_eager"]), imported)
"""


def test_suite_runs_without_torch_and_hf_peers_name_the_extra():
    """torch and transformers are the extra `jaxdecode[peers]`: with neither importable, the suite with
    the plain-JAX peers runs and imports neither; asking for an HF peer exits 2 with one line that
    names the extra, before anything is measured."""
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "RESULT 0 2 []"
    errors = [line for line in proc.stderr.splitlines() if line.startswith("jaxdecode: error:")]
    assert len(errors) == 1 and "torch" in errors[0] and "pip install 'jaxdecode[peers]'" in errors[0], errors
    assert proc.stderr.count("read ceiling") == 1  # the refused run measured nothing


# -- benchmarks/ab.py: engine variants as data ---------------------------------------------------------

AB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "ab.py")


@pytest.fixture(scope="module")
def ab():
    """benchmarks/ab.py as a module (a script beside the packages, not one of them)."""
    spec = importlib.util.spec_from_file_location("ab_script", AB)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_ab_variants_become_engine_arguments(ab):
    """Each word of a variant lands in the engine's public arguments: hooks off (None), hooks with keywords
    or block-size fields (partials of the default hook), the TP table under tp > 1, the dot hook, env."""
    v = ab.parse_variant("qkv_attend=off rms_norm:num_warps=8 sdpa:block_sizes.num_warps=2")
    hooks = v.engine_hooks()
    assert hooks[Hook.QKV_ATTEND] is None and v.engine_stacked_dot() is None and not v.own_process
    assert hooks[Hook.RMS_NORM].func is KERNEL_CALLS[Hook.RMS_NORM] and hooks[Hook.RMS_NORM].keywords == {
        "num_warps": 8
    }
    assert hooks[Hook.SDPA].func is KERNEL_CALLS[Hook.SDPA]
    assert hooks[Hook.SDPA].keywords == {"block_sizes": dataclasses.replace(BlockSizes(), num_warps=2)}
    assert set(hooks) == {Hook.QKV_ATTEND, Hook.RMS_NORM, Hook.SDPA}  # the other hooks keep their defaults
    one = ab.parse_variant("residual_norm:num_warps=8").engine_hooks()[Hook.RESIDUAL_NORM]
    assert one.func is KERNEL_CALLS[Hook.RESIDUAL_NORM] and one.keywords == {"num_warps": 8}
    tp = ab.parse_variant("tp=2 allreduce=psum residual_norm:all_reduce_norm=none")  # the TP hook of that name
    assert (tp.tp, tp.allreduce) == (2, "psum")
    assert tp.engine_hooks()[Hook.RESIDUAL_NORM].func is TP_CALLS[Hook.RESIDUAL_NORM]
    off = ab.parse_variant("stacked_dot=off").engine_stacked_dot()
    assert off(np.ones((1, 2)), np.ones((3, 2, 4)), 0, np.float32) is None  # the caller runs the plain dot
    tiles = ab.parse_variant("stacked_dot:block_sizes.tile_n=128").engine_stacked_dot()
    assert tiles.func is kernel_stacked_dot and tiles.keywords["block_sizes"].tile_n == 128
    on = ab.parse_variant("quantize=int4 mlp=on mlp:block_sizes.stages=2").engine_hooks()[Hook.MLP]  # off by default
    assert on.func is OPTIONAL_CALLS[Hook.MLP] and on.keywords["block_sizes"].stages == 2
    owned = ab.parse_variant("quantize=int4 mlp=on mlp:design=owned").engine_hooks()[Hook.MLP]
    assert owned.keywords == {"design": "owned"}
    env = ab.parse_variant("xla:xla_gpu_enable_command_buffer= xla:xla_foo=1 env:NCCL_PROTO=LL")
    assert env.env == {"XLA_FLAGS": "--xla_gpu_enable_command_buffer= --xla_foo=1", "NCCL_PROTO": "LL"}
    assert env.own_process and ab.parse_variant("base") == ab.Variant("base")
    assert ab.parse_variant("unrolled").loop_layers is False
    f32 = ab.parse_variant("quantize=int4 scales=float32")
    assert (f32.quantize, f32.scales) == ("int4", "float32") and ab.parse_variant("quantize=int8").scales is None


@pytest.mark.parametrize(
    "spec, match",
    [
        ("", "empty"),
        ("base unrolled", "'base' stands alone"),
        ("qkv=on", "cannot read 'qkv=on'"),
        ("sdpa:block_sizes.nope=2", "has the fields"),
        ("sdpa:nope=1", "KW one of impl, block_sizes"),
        ("rms_norm:num_warps=x", "'x' is not of type int"),
        ("rms_norm=off rms_norm:num_warps=8", "both off and set"),
        ("unrolled rms_norm=off", "in-place loop mode only"),
        ("allreduce=psum", "needs tp > 1"),
        ("scales=float32", "scales= needs quantize="),
        ("quantize=int4 scales=int8", "cannot read 'scales=int8'"),
        ("tp=0", "positive integer"),
        ("tp=2 residual_norm:axis=x", "bound by the engine"),
        ("tp=2 residual_norm:num_warps=8", "KW one of axis, allreduce_impl"),  # the TP hook's keywords
    ],
)
def test_ab_bad_variant_exits_2_with_one_line(ab, spec, match, capsys):
    assert ab.main(["--variant", "base", "--variant", spec]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ab: error:") and match in err[0], err


def _run_ab(tmp_path, *variants: str, extra=()) -> tuple[list[dict], dict]:
    argv = ["--model", "tiny-gqa", "--batches", "1,2", "--contexts", "8", "--steps", "4", "--repeats", "3"]
    argv += ["--ceiling-gib", "0.01", "--out", str(tmp_path), *extra]
    for v in variants:
        argv += ["--variant", v]
    proc = subprocess.run([sys.executable, AB, *argv], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert (tmp_path / "ab.jsonl").read_text().splitlines() == lines
    objs = [json.loads(line) for line in lines]
    return objs[:-1], objs[-1]


def test_ab_times_variants_in_one_process(tmp_path):
    """Four variants on the same weights: a row per variant and batch, the median of the repeats, the
    same greedy tokens as the first variant (every variant computes the same function in float32), and
    the HLO counts tell the sliced scan (weight copies) from the unrolled layers (none)."""
    variants = ("base", "unrolled", "loop_mode=inplace qkv_attend=off sdpa:block_sizes.num_warps=2", "base")
    rows, summary = _run_ab(tmp_path, *variants, extra=["--hlo"])
    assert [(r["index"], r["batch"]) for r in rows] == [(i, b) for i in range(4) for b in (1, 2)]
    assert summary["summary"] is True and summary["errors"] == [] and summary["processes"] == "one"
    assert list(summary["ms"]) == [f"{i}: {v}" for i, v in enumerate(variants)]
    for r in rows:
        assert r["variant"] == variants[r["index"]] and r["context"] == 8 and r["steps"] == 4
        # ms and all_ms are rounded to 1e-4 ms, tok_s to 0.01, gb_s, pct_ceiling and the ceiling to 0.1
        assert len(r["all_ms"]) == 3 and r["ms"] == pytest.approx(statistics.median(r["all_ms"]), abs=1e-4)
        # the rounded ms is off by at most 0.5e-4, so 1/ms by this fraction (the ceiling alike, by 0.05 of it);
        # pytest.approx takes the larger of rel and abs, but rounding errors add, so the bounds are summed
        rel_ms = 0.5e-4 / (r["ms"] - 0.5e-4)
        rel_ceiling = 0.05 / (r["read_ceiling_gb_s"] - 0.05)
        tok_s = r["batch"] * 1e3 / r["ms"]
        assert abs(r["tok_s"] - tok_s) <= tok_s * rel_ms + 0.005
        moved = decode_cost(PRESETS["tiny-gqa"], batch=r["batch"], context=8 + 16 + 4 // 2, itemsize=4).bytes
        assert r["bytes_per_step"] == moved
        gb_s = moved / (r["ms"] / 1e3) / 1e9
        assert abs(r["gb_s"] - gb_s) <= gb_s * rel_ms + 0.05
        pct = 100 * gb_s / r["read_ceiling_gb_s"]
        assert abs(r["pct_ceiling"] - pct) <= pct * ((1 + rel_ms) * (1 + rel_ceiling) - 1) + 0.05
        assert r["tokens_agree_with_first"] == (None if r["index"] == 0 else 1 + 4), r
        assert summary["ms"][f"{r['index']}: {r['variant']}"][f"B{r['batch']} ctx8"] == r["ms"]
    modes = {r["index"]: (r["loop_mode"], r["weight_copies"]) for r in rows}
    assert modes[1] == ("unrolled", 0) and modes[2][0] == "inplace"
    assert modes[0][0] == "inplace" and modes[0][1] > 0  # on the CPU XLA still slices W[l] out of the stacks


def test_ab_check_compares_each_variant_with_the_unrolled_model(tmp_path):
    """--check: the in-place looped engine and an int4 copy each agree with the unrolled model on their own
    weights (float32 on the CPU: far inside the tolerance); a variant with a wrong kernel is flagged."""
    rows, summary = _run_ab(tmp_path, "base", "quantize=int4", extra=["--check"])
    assert summary["errors"] == [] and len(rows) == 4
    for r in rows:
        assert r["check_right"] is True and r["check_max_rel_err"] < 1e-4, r


def test_ab_check_flags_a_wrong_kernel(ab):
    """check_logits against an engine whose logits are off by a tenth of the largest: not right."""

    class Shifted:  # the reference's outputs, every logit moved by 0.1 of the largest at the last position
        def __init__(self, engine):
            self.engine, self.params = engine, engine.params

        def new_cache(self, *a):
            return self.engine.new_cache(*a)

        def forward(self, *a):
            out, cache = self.engine.forward(*a)
            return out + 0.1 * jnp.abs(out[:, -1]).max(), cache

    model = init_random(PRESETS["tiny-gqa"], seed=0)
    reference = Engine(model, loop_layers=False)
    prompts = np.random.default_rng(0).integers(0, PRESETS["tiny-gqa"].vocab_size, (2, 5))
    assert ab.check_logits(Engine(model), reference, prompts)["check_right"] is True
    bad = ab.check_logits(Shifted(reference), reference, prompts)
    assert bad["check_right"] is False and bad["check_max_rel_err"] == pytest.approx(0.1, rel=1e-3)


def test_ab_variant_with_xla_flags_runs_in_its_own_process(tmp_path):
    """An xla: word goes to XLA_FLAGS of a process of the variant's own: here 2 fake CPU devices, which
    only that process has, so the tp=2 variant runs there; its greedy tokens equal one device's."""
    rows, summary = _run_ab(tmp_path, "base", "tp=2 xla:xla_force_host_platform_device_count=2")
    assert summary["processes"] == "one per variant" and summary["errors"] == []
    assert [(r["index"], r["tp"], r["batch"]) for r in rows] == [(0, 1, 1), (0, 1, 2), (1, 2, 1), (1, 2, 2)]
    assert rows[2]["allreduce"] == "kernel" and rows[2]["env"] == {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2"
    }
    assert [r["tokens_agree_with_first"] for r in rows] == [None, None, 5, 5]
