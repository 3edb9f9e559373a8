"""Execute notebooks top to bottom and keep their outputs: how the GPU-only cells' outputs were stored.

    python colab/execute.py colab/02_kernel_looping.ipynb colab/04_flashdecoding_kernels.ipynb --out DIR

Each notebook runs in a fresh `python3` kernel from colab/ (nbclient), with this process's environment,
and is written to DIR under its own name with `metadata.jaxdecode = {executed_on, date, jax}`. A cell
that raises stops that notebook: it is written to DIR with `.failed` before `.ipynb`, for reading.
tests/test_notebooks.py accepts stored outputs only from a run on an H100/H200 that executed every
GPU-only cell. CI executes the notebooks again on the CPU and never writes them back.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import nbclient
import nbformat

COLAB = Path(__file__).resolve().parent


def execute(path: Path, out_dir: Path, timeout_s: int = 600) -> bool:
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": str(COLAB)}}
    )
    start = time.perf_counter()
    try:
        client.execute()
        ok = True
    except nbclient.exceptions.CellExecutionError as e:
        print(f"{path.name}: {str(e)[-2000:]}", file=sys.stderr)
        ok = False
    nb.metadata["jaxdecode"] = {
        "executed_on": jax.devices()[0].device_kind,
        "date": time.strftime("%Y-%m-%d"),
        "jax": jax.__version__,
    }
    name = path.name if ok else path.stem + ".failed.ipynb"
    nbformat.write(nb, out_dir / name)
    print(f"{path.name}: {'ok' if ok else 'FAILED'} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--out", required=True, type=Path, help="folder for the executed notebooks")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = [execute(p, args.out) for p in args.notebooks]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
