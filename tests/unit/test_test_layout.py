"""The test tree's layout holds: shared test code lives in tests/support, never in the product.

A test module is pytest's to collect: another module importing it runs its module-level code a
second time under a second name (pytest imports `tests/unit/test_x.py` as `test_x`), and its
fixtures and helpers become an API nobody meant to keep. So no file under tests/ imports a
module of tests/ outside tests/support (conftest files are pytest's too), in any spelling:
`from tests.unit.test_x import y`, `from tests.integration import test_x`, `import
tests.e2e.test_x`, the bare `from test_x import y` that pytest's sys.path allows, or relative.
And the product packages ship no test support: no `testing` module, no import of `tests`
(nor do the benchmarks, which run where tests/ is not installed).
"""

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = [
    ROOT / "operator" / "grpo_operator",
    ROOT / "trainers" / "grpo_trainer",
    ROOT / "rollout" / "grpo_rollout",
    ROOT / "wire" / "grpo_wire",
]


def imported(path: Path, root: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of everything `path` imports, `from a import b` giving both a and a.b;
    relative imports resolved against the file's folder under `root`."""
    package = list(path.relative_to(root).parent.parts)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            if module:
                yield node.lineno, module
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}" if module else alias.name


def owned_modules(tests: Path) -> dict[str, str]:
    """Importable name -> file, for every module of `tests` outside tests/support and conftest
    files: its dotted name from the repository root and its bare name (pytest puts a test's
    folder on sys.path)."""
    owned = {}
    for path in tests.rglob("*.py"):
        rel = path.relative_to(tests.parent)
        if rel.parts[1] == "support" or path.name in ("conftest.py", "__init__.py"):
            continue
        owned[".".join(rel.with_suffix("").parts)] = str(rel)
        owned[path.stem] = str(rel)
    return owned


def cross_imports(tests: Path) -> list[str]:
    """'file:line imports name (file)' for every import of a test-owned module under `tests`."""
    owned = owned_modules(tests)
    found = []
    for path in sorted(tests.rglob("*.py")):
        for line, name in imported(path, tests.parent):
            if name in owned:
                found.append(f"{path.relative_to(tests.parent)}:{line} imports {name} ({owned[name]})")
    return sorted(set(found))


def imports_of_tests(folder: Path) -> list[str]:
    """'file:line imports name' for every import of the `tests` package under `folder`."""
    return [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sorted(folder.rglob("*.py"))
        for line, name in imported(path, folder.parent)
        if name == "tests" or name.startswith("tests.")
    ]


def test_no_test_module_is_imported_by_another_file_of_the_tests() -> None:
    found = cross_imports(ROOT / "tests")
    assert not found, "move what is shared into tests/support (or a conftest fixture):\n" + "\n".join(found)


@pytest.mark.parametrize("package", [*PRODUCT, ROOT / "benchmarks"], ids=lambda p: p.name)
def test_the_product_and_the_benchmarks_import_no_test_code(package: Path) -> None:
    found = imports_of_tests(package)
    assert not found, "test support lives in tests/support, which does not ship:\n" + "\n".join(found)


@pytest.mark.parametrize("package", PRODUCT, ids=lambda p: p.name)
def test_no_product_package_has_a_testing_module(package: Path) -> None:
    found = [str(p.relative_to(ROOT)) for p in package.rglob("testing*") if p.stem == "testing"]
    assert not found, f"test support belongs in tests/support, not in the product: {found}"


def test_the_scan_sees_every_spelling_of_a_cross_import(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    files = {
        "unit/test_a.py": "X = 1\n",
        "unit/test_b.py": "from tests.unit.test_a import X\n",
        "unit/test_c.py": "def f():\n    from tests.unit import test_a\n",
        "integration/test_d.py": "import tests.unit.test_a\nfrom test_a import X\n",
        "integration/test_e.py": "from ..unit.test_a import X\n",
        "support/shared.py": "from tests.unit import helpers\n",
        "unit/helpers.py": "Y = 2\n",
        "unit/test_fine.py": "from tests.support.shared import Y\nimport conftest\n",
        "conftest.py": "",
    }
    for name, text in files.items():
        (tests / name).parent.mkdir(parents=True, exist_ok=True)
        (tests / name).write_text(text)
    assert cross_imports(tests) == [
        "tests/integration/test_d.py:1 imports tests.unit.test_a (tests/unit/test_a.py)",
        "tests/integration/test_d.py:2 imports test_a (tests/unit/test_a.py)",
        "tests/integration/test_e.py:1 imports tests.unit.test_a (tests/unit/test_a.py)",
        "tests/support/shared.py:1 imports tests.unit.helpers (tests/unit/helpers.py)",
        "tests/unit/test_b.py:1 imports tests.unit.test_a (tests/unit/test_a.py)",
        "tests/unit/test_c.py:2 imports tests.unit.test_a (tests/unit/test_a.py)",
    ]
