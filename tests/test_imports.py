"""The import graph of the three packages: no cycles, and data flowing one way.

grimp reads every import statement, those inside functions too, so a cycle hidden behind a local
import fails here as well.
"""

import subprocess
import sys

import grimp
import pytest

PACKAGES = ("jaxdecode", "kernels", "rdu")

# The engine's layers, lowest first: a module may import from its own layer or below, never above.
ENGINE_LAYERS = (
    "jaxdecode.config",
    "jaxdecode.model",
    "jaxdecode.looped_model",
    "jaxdecode.tp",
    "jaxdecode.decode",
    "jaxdecode.loading",
    "jaxdecode.llm",
    "jaxdecode.cli",
)


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph(*PACKAGES, include_external_packages=False)


def _cycles(graph) -> list[list[str]]:
    """One shortest cycle through each direct import that closes one (importer -> imported -> importer)."""
    found = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back is not None:
                found.append([importer, *back])
    return found


def test_no_import_cycles(graph):
    assert _cycles(graph) == []


def test_cycle_check_finds_a_cycle():
    """The check itself: a graph with a cycle behind two modules is reported."""
    g = grimp.ImportGraph()
    for name in ("p.a", "p.b", "p.c"):
        g.add_module(name)
    g.add_import(importer="p.a", imported="p.b")
    g.add_import(importer="p.b", imported="p.c")
    assert _cycles(g) == []
    g.add_import(importer="p.c", imported="p.a")
    assert ["p.a", "p.b", "p.c", "p.a"] in _cycles(g)


@pytest.mark.parametrize("lower, higher", [(a, b) for i, a in enumerate(ENGINE_LAYERS) for b in ENGINE_LAYERS[i + 1 :]])
def test_engine_layers_import_downwards(graph, lower, higher):
    assert graph.find_shortest_chain(importer=lower, imported=higher) is None


def test_kernels_import_nothing_from_the_engine_or_rdu(graph):
    for module in graph.find_descendants("kernels") | {"kernels"}:
        for imported in graph.find_modules_directly_imported_by(module):
            assert imported.split(".")[0] == "kernels", (module, imported)


def test_only_the_cli_imports_rdu(graph):
    importers = {
        m
        for m in graph.find_descendants("jaxdecode") | {"jaxdecode"}
        if any(i.split(".")[0] == "rdu" for i in graph.find_modules_directly_imported_by(m))
    }
    assert importers <= {"jaxdecode.cli"}


@pytest.mark.parametrize(
    "code",
    [
        "import jaxdecode",
        "import jaxdecode.cli",
        "import jaxdecode.cli as c; c.build_parser()",
        "import jaxdecode.cli as c; c.main(['--help'])",
        "import jaxdecode.cli as c; c.main(['generate', '--help'])",
        "import jaxdecode.cli as c; c.main(['bench', '--bad-flag'])",
    ],
)
def test_the_package_and_the_parser_do_not_import_jax(code):
    """`jaxdecode --help`, a subcommand's help and a bad flag answer without JAX's seconds of import."""
    check = f"import sys\ntry:\n    {code}\nexcept SystemExit:\n    pass\nprint('jax' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "False", proc.stderr[-2000:]
