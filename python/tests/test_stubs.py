"""The type stubs of the native module (python/elasticps/_native.pyi) name every public
attribute of ``elasticps._native`` and of its classes, with the same parameters, and a
doc line each, so that they cannot drift from the Rust code; and the package ships them
(with ``py.typed``)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import elasticps
from elasticps import _native

STUB = Path(__file__).resolve().parents[1] / "elasticps" / "_native.pyi"


def public(names):
    return {n for n in names if not n.startswith("_")}


def stub_module() -> ast.Module:
    return ast.parse(STUB.read_text(), filename=str(STUB))


def stub_items(body):
    """The public functions and classes a stub body defines, by name."""
    return {
        node.name: node
        for node in body
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_")
    }


def own_public(cls) -> set:
    """The public attributes `cls` defines itself (not those of its base classes)."""
    inherited = set().union(*(dir(base) for base in cls.__mro__[1:]))
    return public(set(dir(cls)) - inherited)


def stub_params(fn: ast.FunctionDef) -> list:
    """(name, has a default) of a stub function's parameters, `self` left out."""
    args = fn.args.posonlyargs + fn.args.args
    defaults = [False] * (len(args) - len(fn.args.defaults)) + [True] * len(fn.args.defaults)
    return [(a.arg, d) for a, d in zip(args, defaults) if a.arg != "self"]


def runtime_params(obj) -> list:
    """(name, has a default) of a native callable's parameters (pyo3's text signature)."""
    sig = inspect.signature(obj)
    return [
        (p.name, p.default is not inspect.Parameter.empty) for p in sig.parameters.values() if p.name != "self"
    ]


def test_the_stub_names_every_public_attribute_of_the_module():
    items = stub_items(stub_module().body)
    assert set(items) == public(dir(_native)), "stub and module differ: update python/elasticps/_native.pyi"


@pytest.mark.parametrize("cls_name", sorted(n for n in public(dir(_native)) if isinstance(getattr(_native, n), type)))
def test_the_stub_names_every_public_attribute_of_each_class(cls_name):
    cls = getattr(_native, cls_name)
    node = stub_items(stub_module().body)[cls_name]
    assert isinstance(node, ast.ClassDef), f"{cls_name} is a class, the stub does not say so"
    members = stub_items(node.body)
    assert set(members) == own_public(cls), f"stub of {cls_name} and the class differ"
    for name, fn in members.items():
        attr = inspect.getattr_static(cls, name)
        is_property = any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list)
        if inspect.isdatadescriptor(attr):
            assert is_property, f"{cls_name}.{name} is a property at run time"
        else:
            assert not is_property, f"{cls_name}.{name} is a method at run time"
            assert stub_params(fn) == runtime_params(getattr(cls, name)), f"{cls_name}.{name}'s parameters"


def test_the_stub_functions_have_the_modules_parameters():
    for name, node in stub_items(stub_module().body).items():
        if isinstance(node, ast.FunctionDef):
            assert stub_params(node) == runtime_params(getattr(_native, name)), f"{name}'s parameters"


def test_every_stub_item_has_a_doc_line():
    def walk(body, prefix=""):
        for name, node in stub_items(body).items():
            doc = ast.get_docstring(node)
            assert doc and doc.strip(), f"{prefix}{name} has no docstring in the stub"
            if isinstance(node, ast.ClassDef):
                walk(node.body, f"{prefix}{name}.")

    walk(stub_module().body)


def test_the_package_ships_the_stub_and_py_typed():
    # The installed package the tests import (a wheel built by maturin), not the source.
    installed = Path(elasticps.__file__).resolve().parent
    assert (installed / "py.typed").is_file(), f"no py.typed in {installed}"
    shipped = installed / "_native.pyi"
    assert shipped.is_file(), f"no _native.pyi in {installed}"
    assert shipped.read_text() == STUB.read_text(), "the installed stub is not this tree's: reinstall the package"
