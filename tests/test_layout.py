"""The layout the architecture rests on, read from the source: an op family is named in its own modules only, the
generic machinery names none, the package imports no DSL outside backends/, and its top level stays small."""

import ast
import re
from pathlib import Path

import pytest

from test_discovery import DSLS

ROOT = Path(__file__).parents[1]
PACKAGE, REGISTRY = ROOT / "liger_dispatch", ROOT / "registry"
# the word each op family's names share (flce; fused_linear_jsd, jsd_beta; fused_linear_kl_div; mhc_*; *logprobs*)
FAMILY_WORDS = ("flce", "jsd", "kl_div", "mhc", "logprobs")
MAX_FILES_PER_FAMILY = 3
MAX_TOP_LEVEL_MODULES = 12


def _is_front_end(path: Path) -> bool:
    """The user-facing layers, which name ops by design: nn modules, integrations, demos, package __init__s."""
    relative = path.relative_to(ROOT).as_posix()
    return (path.name == "__init__.py" or path.name == "nn.py" or "/integrations/" in relative
            or path.name.startswith("demo"))


def _sources(*roots: Path) -> list[Path]:
    return sorted(p for root in roots for p in root.rglob("*.py") if not _is_front_end(p))


def _naming(word: str, files: list[Path]) -> list[str]:
    pattern = re.compile(re.escape(word), re.IGNORECASE)
    return [p.relative_to(ROOT).as_posix() for p in files if pattern.search(p.read_text())]


@pytest.mark.parametrize("word", FAMILY_WORDS)
def test_an_op_family_is_named_in_at_most_three_modules(word):
    naming = _naming(word, _sources(PACKAGE, REGISTRY))
    assert len(naming) <= MAX_FILES_PER_FAMILY, naming


@pytest.mark.parametrize("word", FAMILY_WORDS)
def test_the_generic_machinery_names_no_op(word):
    """Everything in liger_dispatch/ but the front ends and the conformance library (whose tolerances say which
    family needs them) reads ops from the table."""
    machinery = [p for p in _sources(PACKAGE) if p.name != "testing.py"]
    assert _naming(word, machinery) == []


def test_the_package_and_registry_import_no_dsl():
    importing = []
    for path in sorted([*PACKAGE.rglob("*.py"), *REGISTRY.rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            importing += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in DSLS]
    assert importing == []


def test_the_package_top_level_is_small():
    """Modules and sub-packages beside __init__ and __main__: the layout names the parts."""
    entries = [p.name for p in PACKAGE.iterdir()
               if (p.suffix == ".py" and p.stem not in ("__init__", "__main__"))
               or (p.is_dir() and (p / "__init__.py").exists())]
    assert len(entries) <= MAX_TOP_LEVEL_MODULES, sorted(entries)
