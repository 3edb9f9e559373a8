"""The command line: --json output, and exit code 2 with exactly one line on stderr for bad input."""

import argparse
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from helpers import SMOLLM_TOKENS, random_hf_state, write_gguf

from jaxdecode.cli import QUANTIZE_CHOICES, TUNE_HELP, _Parser, build_parser, main
from jaxdecode.config import PRESETS, ModelConfig
from jaxdecode.weights.gguf import default_model_path


def _run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_answers_paris(capsys):
    code, out, err = _run(
        ["generate", "What is the capital of France?", "--chat", "--json", "--max-new-tokens", "24"], capsys
    )
    assert code == 0
    result = json.loads(out.strip().splitlines()[-1])
    assert "Paris" in result["text"]
    assert {"text", "token_ids", "prefill_ms", "decode_tok_s"} <= result.keys()
    assert 0 < len(result["token_ids"]) <= 24 and result["decode_tok_s"] > 0


def _gguf_variant(tmp_path, name, mutate):
    data = bytearray(default_model_path().read_bytes()[: 1 << 20] if mutate == "truncate" else b"")
    if mutate == "magic":
        data = bytearray(b"GGUX" + default_model_path().read_bytes()[4:4096])
    path = tmp_path / name
    path.write_bytes(bytes(data))
    return str(path)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["generate", "hi", "--model", "/nonexistent/model.gguf"], "nonexistent"),
        (["generate", "hi", "--model", "llama-8b"], "llama-8b"),
        (["generate", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "hi", "--temperature", "nan"], "temperature"),
        (["generate", "hi", "--top-p", "0"], "top_p"),
        (["generate", "hi", "--top-p", "1.5"], "top_p"),
        (["generate", "hi", "--top-k", "-3"], "top_k"),
        (["generate", ""], "empty prompt"),
        (["generate", "hi", "--max-new-tokens", "many"], "invalid int"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, match, capsys):
    code, out, err = _run(argv, capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and match in err, err


@pytest.mark.parametrize("mutate, match", [("truncate", "truncated"), ("magic", "magic")])
def test_bad_gguf_exits_2(tmp_path, mutate, match, capsys):
    code, _, err = _run(["generate", "hi", "--model", _gguf_variant(tmp_path, "bad.gguf", mutate)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and match in err.lower(), err


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny random model in a GGUF file with the test tokenizer, for the paths that need no real model."""
    cfg = ModelConfig("tiny-cli", len(SMOLLM_TOKENS), 48, 2, 4, 2, 80, max_seq_len=64)
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", cfg, random_hf_state(cfg))


def test_prompt_longer_than_context_exits_2(tiny_gguf, capsys):
    code, _, err = _run(["generate", "ab " * 70, "--model", str(tiny_gguf), "--max-new-tokens", "4"], capsys)
    assert code == 2 and "exceeds the model's context of 64" in err


def test_real_process_prints_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "jaxdecode.cli", "generate", "hi", "--top-k", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["jaxdecode: error: top_k must be an integer >= 0, got -1"]


def test_help_on_every_command(capsys):
    """In process: argparse prints the usage and exits 0 (the real process is test_real_process_prints_no_traceback)."""
    for cmd in ([], ["generate"], ["chat"], ["bench"], ["loop-report"], ["rdu"], ["tune"]):
        with pytest.raises(SystemExit) as exit_info:
            main([*cmd, "--help"])
        out, _ = capsys.readouterr()
        assert exit_info.value.code == 0 and "usage: jaxdecode" in out, cmd


def test_compile_cache_is_filled_and_reused(tmp_path, tiny_gguf):
    """--compile-cache: the first run writes compiled programs there; a second process with the same
    model and shapes reads them back and generates the same tokens (the cache is under test, not the model)."""
    cache = tmp_path / "xla-cache"
    argv = [
        sys.executable,
        "-m",
        "jaxdecode.cli",
        "generate",
        "ab ab",
        "--model",
        str(tiny_gguf),
        "--max-new-tokens",
        "6",
        "--json",
        "--compile-cache",
        str(cache),
    ]
    first = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    entries = sorted(p.name for p in cache.iterdir())
    assert entries, "the first run wrote nothing to the cache"
    second = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert sorted(p.name for p in cache.iterdir()) == entries  # nothing new compiled: every program was found
    tokens = [json.loads(r.stdout.strip().splitlines()[-1])["token_ids"] for r in (first, second)]
    assert tokens[0] == tokens[1]


def test_compile_cache_that_is_a_file_exits_2(tmp_path, capsys):
    path = tmp_path / "not-a-dir"
    path.write_text("x")
    code, _, err = _run(["generate", "hi", "--compile-cache", str(path)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "is a file" in err, err


def _commands(parser) -> dict[str, argparse.ArgumentParser]:
    """The top-level parser and every subcommand's, by their usage names."""
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {"jaxdecode": parser, **{f"jaxdecode {name}": p for name, p in sub.choices.items()}}


def test_every_flag_has_help_that_states_its_true_default():
    """Every action of every (sub)parser has help; where a flag has a default, its help states the value that
    parsing without the flag gives (set_defaults included, as chat's --max-new-tokens)."""
    parsers, checked = _commands(build_parser(complete=True)), 0
    for name, p in parsers.items():
        required = []
        for a in p._actions:
            if not a.option_strings and not isinstance(a, argparse._SubParsersAction):
                required.append("x")
            elif a.required:
                required += [a.option_strings[0], "x"]
        parsed = vars(p.parse_args(required)) if name != "jaxdecode" else {}
        for a in p._actions:
            assert a.help and a.help != argparse.SUPPRESS, f"{name} {a.option_strings or a.dest}: no help"
            text = a.help % {**vars(a), "prog": p.prog}
            default = parsed.get(a.dest)
            if a.option_strings and not a.required and default not in (None, False, argparse.SUPPRESS):
                assert str(default) in text, f"{name} {a.option_strings[0]}: help {text!r} misses {default!r}"
            checked += 1
    assert checked > 60  # the walk reached every subcommand's flags
    chat_help = " ".join(parsers["jaxdecode chat"].format_help().split())
    assert "--max-new-tokens N tokens to generate (default 256)" in chat_help
    [model] = [a for a in parsers["jaxdecode rdu"]._actions if a.dest == "model"]
    assert all(name in model.help for name in PRESETS)


def test_bare_command_prints_the_help_and_exits_2(capsys):
    code, out, err = _run([], capsys)
    assert code == 2 and out == ""
    assert err.startswith("usage: jaxdecode")
    assert all(f"    {c}" in err for c in ("generate", "chat", "bench", "loop-report", "rdu", "tune"))


def test_version_is_the_project_version(capsys):
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"jaxdecode {pyproject['project']['version']}\n"


def test_generate_echoes_the_prompt_unless_no_echo_or_json(tiny_gguf, capsys):
    """The echoed output is the prompt, then the continuation that --json reports (decoded there at once)."""
    argv = ["generate", "ab ab", "--model", str(tiny_gguf), "--max-new-tokens", "6"]
    code, out_json, _ = _run([*argv, "--json"], capsys)
    text = json.loads(out_json.strip().splitlines()[-1])["text"]
    assert code == 0 and text
    assert _run(argv, capsys)[1] == "ab ab" + text + "\n"
    assert _run([*argv, "--no-echo"], capsys)[1] == text + "\n"


def test_bench_that_measures_nothing_exits_2(capsys):
    """A suite whose every row is refused (the 405B preset fits no single device's memory) fails."""
    code, _, err = _run(["bench", "--models", "llama-3.1-405b", "--peers", "none", "--steps", "2"], capsys)
    assert code == 2
    assert "llama-3.1-405b does not fit" in err
    assert err.strip().splitlines()[-1] == (
        "jaxdecode: error: bench measured nothing: 1 refused, failed or skipped (the lines above say why)"
    )


def test_the_parser_copies_of_jax_modules_names_equal_the_originals():
    """build_parser imports no JAX (tests/test_imports.py), so it holds copies: --quantize's choices and the
    tune subcommand, whose arguments kernels.tune adds when the subparser is first used."""
    from jaxdecode import kquants
    from kernels.tune import add_parser
    from rdu import cli as rdu_cli

    assert QUANTIZE_CHOICES == kquants.QUANTIZE_CHOICES
    rdu_parser = rdu_cli.add_parser(argparse.ArgumentParser().add_subparsers())
    rdu_quantize = next(a for a in rdu_parser._actions if a.dest == "quantize")  # rdu's own copy
    assert tuple(rdu_quantize.choices) == kquants.QUANTIZE_CHOICES
    reference = _Parser(prog="jaxdecode")
    add_parser(reference.add_subparsers(dest="command", parser_class=_Parser))
    ours = build_parser()
    [ref_sub], [our_sub] = (
        [a for a in p._actions if isinstance(a, argparse._SubParsersAction)] for p in (reference, ours)
    )
    [ref_help] = [a.help for a in ref_sub._choices_actions if a.dest == "tune"]
    assert TUNE_HELP == ref_help
    assert len(our_sub.choices["tune"]._actions) == 1  # only -h until the subcommand is used
    assert our_sub.choices["tune"].format_help() == ref_sub.choices["tune"].format_help()
    assert [a.dest for a in our_sub.choices["tune"]._actions] == [a.dest for a in ref_sub.choices["tune"]._actions]
