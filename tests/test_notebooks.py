"""The Colab notebooks run top to bottom: every cell, with the `assert`s inside them.

Each notebook executes in a fresh `python3` kernel of this interpreter (ipykernel in the test
group), from colab/, with the environment of the test run (tests/conftest.py pins JAX to the CPU,
so GPU-only cells print a note and skip). The install cell does nothing here: jaxdecode is
importable. A notebook is stored either without outputs or with the outputs of one run on an
H100/H200 (`colab/execute.py`), in which every GPU-only cell ran; executing them here writes nothing back.
"""

import os
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

COLAB = Path(__file__).resolve().parent.parent / "colab"
NOTEBOOKS = sorted(COLAB.glob("*.ipynb"))
CELL_TIMEOUT_S = 300  # the slowest cell loads and compiles the default model on 2 shared CPU cores
NOTEBOOK_BUDGET_S = 600  # a notebook that takes longer than this has stopped being a quick read


def test_every_notebook_is_found():
    assert [p.name for p in NOTEBOOKS] == [
        "01_quickstart.ipynb",
        "02_kernel_looping.ipynb",
        "03_modeled_rdu.ipynb",
        "04_flashdecoding_kernels.ipynb",
    ]


def _text(outputs) -> str:
    return "".join(o.get("text", "") + "".join(str(v) for v in o.get("data", {}).values()) for o in outputs)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_clean(path):
    """Thin: one badge pointing at this file. Either no outputs at all, or the outputs of one run on an
    H100/H200 (metadata.jaxdecode.executed_on) in which every cell ran and no GPU-only cell skipped."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    first = nb.cells[0]
    assert first.cell_type == "markdown" and f"colab/{path.name})" in first.source
    code = [c for c in nb.cells if c.cell_type == "code"]
    executed_on = nb.metadata.get("jaxdecode", {}).get("executed_on", "")
    if not executed_on:
        for cell in code:
            assert not cell.outputs and cell.execution_count is None, f"stored outputs in {path.name}"
    else:
        assert "H100" in executed_on or "H200" in executed_on, executed_on
        assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "not one top-to-bottom run"
        gpu_cells = [c for c in code if "GPU-only cell" in c.source]
        assert gpu_cells, f"{path.name} has no GPU-only cell: store it without outputs"
        for cell in gpu_cells:
            assert cell.outputs and "skipped" not in _text(cell.outputs), cell.source[:80]
        assert not any(o.get("output_type") == "error" for c in code for o in c.outputs)
    installs = [c for c in nb.cells if c.cell_type == "code" and "pip" in c.source]
    assert len(installs) == 1 and 'find_spec("jaxdecode") is None' in installs[0].source


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    # jupyter_client runs a kernelspec's "python" as sys.executable: this venv's interpreter.
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(COLAB)}}
    )
    start = time.perf_counter()
    try:
        client.execute(env=env)
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{path.name}: {e}", pytrace=False)
    elapsed = time.perf_counter() - start
    print(f"{path.name}: {elapsed:.0f} s")
    assert elapsed < NOTEBOOK_BUDGET_S, f"{path.name} took {elapsed:.0f} s"
