"""The `jaxdecode` command (console script and `python -m jaxdecode`): `jaxdecode.cli.main`, with the progress
line shown before the CLI's imports, the seconds of which (JAX's above all) would otherwise pass in silence."""

from __future__ import annotations

import sys

from jaxdecode import progress


def _wants_json(argv: list[str]) -> bool:
    """--json, or an abbreviation argparse accepts for it, before any "--" (the parser has not run yet)."""
    args = argv[: argv.index("--")] if "--" in argv else argv
    return any(a.startswith("--j") and "--json".startswith(a) for a in args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    progress.set_quiet(_wants_json(argv))
    with progress.phase("starting"):
        from jaxdecode.cli import main as cli_main
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
