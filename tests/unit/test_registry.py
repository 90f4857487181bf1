"""The one registry of every extension point (grpo_wire.registry.Registry): lookups, errors, lazy homes.

A home package is written to tmp_path per test, so what its import registers, and when, is seen
fresh each time.
"""

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from grpo_wire.registry import Registry


def square(x: int) -> int:
    return x * x


NOT_CALLABLE = 42


def test_a_registered_builtin_is_found_by_name_and_listed():
    registry: Registry[object] = Registry("widget")
    assert registry.register("square")(square) is square  # the decorator hands the object back
    registry.register("cube")(lambda x: x**3)
    assert registry.get("square") is square
    assert registry["square"] is square
    assert "square" in registry and "circle" not in registry
    assert registry.names() == ["cube", "square"]
    assert set(registry) == {"square", "cube"} and len(registry) == 2
    assert [name for name, _ in registry.items()] == ["cube", "square"]


def test_registering_the_same_object_twice_is_harmless_a_different_one_is_an_error():
    registry: Registry[object] = Registry("widget")
    registry.register("square")(square)
    registry.register("square")(square)  # a module imported again registers the same function
    with pytest.raises(ValueError, match="widget 'square' is registered twice"):
        registry.register("square")(lambda x: x)
    assert registry.get("square") is square


def test_an_unknown_name_names_the_kind_and_every_choice():
    registry: Registry[object] = Registry("widget")
    registry.register("b")(square)
    registry.register("a")(abs)
    with pytest.raises(ValueError, match=r"unknown widget 'c'; choose one of \['a', 'b'\]"):
        registry.get("c")


def test_load_takes_a_builtins_name_or_a_module_path():
    registry: Registry[object] = Registry("widget")
    registry.register("square")(square)
    assert registry.load("square") is square
    assert registry.load(f"{__name__}:square") is square
    assert registry.load("os.path:join") is __import__("os").path.join


@pytest.mark.parametrize(
    ("path", "error"),
    [
        (
            "no_such_module_grpo:f",
            r"widget 'no_such_module_grpo:f': cannot import module 'no_such_module_grpo'",
        ),
        (
            f"{__name__}:missing",
            rf"widget '{__name__}:missing': module '{__name__}' has no callable 'missing'",
        ),
        (f"{__name__}:NOT_CALLABLE", r"has no callable 'NOT_CALLABLE'"),
        ("circle", r"widget 'circle' is neither a built-in \['square'\] nor 'module:function'"),
        ("module:", r"is neither a built-in"),
        (":function", r"is neither a built-in"),
    ],
)
def test_load_errors_name_the_kind_and_the_path(path, error):
    registry: Registry[object] = Registry("widget")
    registry.register("square")(square)
    with pytest.raises(ValueError, match=error):
        registry.load(path)


def test_a_registry_without_home_loads_only_user_paths():
    registry: Registry[object] = Registry("environment class")
    assert registry.names() == []
    assert registry.load(f"{__name__}:square") is square
    with pytest.raises(ValueError, match=r"environment class 'x' is neither a built-in \[\] nor"):
        registry.load("x")


def write_home(root: Path, package: str) -> None:
    """A registry module and a home package of two built-ins that register themselves on import."""
    (root / f"{package}_registry.py").write_text(
        textwrap.dedent(
            f"""
            from grpo_wire.registry import Registry
            WIDGETS = Registry("widget", home="{package}")
            """
        )
    )
    home = root / package
    home.mkdir()
    (home / "__init__.py").write_text('"""Built-in widgets, one module each."""\n')
    for name in ("left", "right"):
        (home / f"{name}.py").write_text(
            textwrap.dedent(
                f"""
                from {package}_registry import WIDGETS

                @WIDGETS.register("{name}")
                def {name}():
                    return "{name}"
                """
            )
        )
    (home / "_private.py").write_text("raise RuntimeError('a private module is not imported')\n")


@pytest.fixture
def fresh_modules() -> Iterator[None]:
    """Forget the modules a test wrote and imported (grpo_test_registry_*), so each test imports its own."""
    yield
    for name in [m for m in sys.modules if m.startswith("grpo_test_registry_")]:
        del sys.modules[name]


def test_a_home_package_registers_its_modules_at_the_first_lookup_and_not_before(
    tmp_path, monkeypatch, fresh_modules
):
    package = "grpo_test_registry_widgets"
    write_home(tmp_path, package)
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = __import__(f"{package}_registry").WIDGETS
    assert registry.home == package
    assert package not in sys.modules  # creating the registry imports nothing
    assert registry.get("left")() == "left"  # the first lookup imports every public module
    assert {f"{package}.left", f"{package}.right"} <= set(sys.modules)
    assert f"{package}._private" not in sys.modules
    assert registry.names() == ["left", "right"]
    assert registry.load("right")() == "right"


def test_a_home_module_may_look_names_up_while_it_is_imported(tmp_path, monkeypatch, fresh_modules):
    # `home` may be a module that registers and uses its own entries (the tool-call parsers do)
    (tmp_path / "grpo_test_registry_selfhome.py").write_text(
        textwrap.dedent(
            """
            from grpo_wire.registry import Registry
            SHAPES = Registry("shape", home="grpo_test_registry_selfhome")

            @SHAPES.register("dot")
            class Dot:
                pass

            DEFAULT = SHAPES.get("dot")
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__("grpo_test_registry_selfhome")
    assert module.DEFAULT is module.Dot
    assert module.SHAPES.names() == ["dot"]
