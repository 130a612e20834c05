"""The API reference (docs/api/*.md) covers every public name, and every public name documents its arguments.

Reference: the rule of issue 29 restated on the package itself — every name in
``lightning_fedrep.__all__`` has an autodoc directive on an API page and a docstring of its own, and every
public callable the API pages show (an exported function, an exported class's constructor, and each public
method or property the class defines with a docstring) names each of its parameters in its docstring (an
``Args:`` entry or a sentence naming it). The source is read with ``ast`` and ``inspect``, not with Sphinx,
so the test runs without the ``[docs]`` extra.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import textwrap
from functools import cache
from pathlib import Path

import pytest

import lightning_fedrep

ROOT = Path(__file__).resolve().parents[1]
API_PAGES = ROOT / "docs" / "api"
DIRECTIVE = re.compile(r"^\.\. auto(?:class|function|data|exception|attribute)::\s+([\w.]+)", re.MULTILINE)
# A method overriding a hook of Lightning or torch keeps that hook's parameters, documented there.
EXTERNAL_PREFIXES = ("lightning", "torch", "builtins", "typing", "abc", "enum")


def names_with_option(option: str) -> set[str]:
    """The names whose directive has ``option``: ``:inherited-members:`` (the page also shows the members
    the class inherits from the package's classes), ``:no-members:`` (only the class)."""
    names = set()
    for page in sorted(API_PAGES.glob("*.md")):
        for block in re.split(r"\n(?=\.\. )", page.read_text()):
            match = DIRECTIVE.match(block)
            if match and f":{option}:" in block:
                names.add(match.group(1).removeprefix("lightning_fedrep."))
    return names


def documented_names() -> set[str]:
    """The names the API pages pass to an autodoc directive (``.. autoclass:: FedRep`` gives ``FedRep``)."""
    names: set[str] = set()
    for page in sorted(API_PAGES.glob("*.md")):
        for target in DIRECTIVE.findall(page.read_text()):
            names.add(target.removeprefix("lightning_fedrep."))
    return names


@cache
def attribute_docstrings(path: Path) -> dict[str, dict[str, str]]:
    """Docstrings written under assignments (PEP 257 attribute docstrings), by scope: ``""`` for the
    module, the class name for a class body."""
    tree = ast.parse(path.read_text())
    found: dict[str, dict[str, str]] = {}

    def scan(scope: str, body: list[ast.stmt]) -> None:
        for prev, node in zip(body, body[1:]):
            target = None
            if (
                isinstance(prev, ast.Assign)
                and len(prev.targets) == 1
                and isinstance(prev.targets[0], ast.Name)
            ):
                target = prev.targets[0].id
            elif isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name):
                target = prev.target.id
            if (
                target
                and isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                found.setdefault(scope, {})[target] = node.value.value
        for node in body:
            if isinstance(node, ast.ClassDef) and scope == "":
                scan(node.name, node.body)

    scan("", tree.body)
    return found


def package_modules() -> list[Path]:
    return sorted((ROOT / "lightning_fedrep").rglob("*.py"))


def constant_docstring(name: str) -> str | None:
    """The attribute docstring of the module-level assignment ``name = ...`` that defines the constant."""
    for path in package_modules():
        doc = attribute_docstrings(path).get("", {}).get(name)
        if doc:
            return doc
    return None


def own_docstring(obj: object) -> str | None:
    """The object's own docstring: not one inherited from a base class, not a dataclass's generated
    ``Name(field, ...)`` signature line."""
    if obj is None:
        return None
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    if not doc or not doc.strip():
        return None
    if isinstance(obj, type) and dataclasses.is_dataclass(obj) and doc.startswith(f"{obj.__name__}("):
        return None
    return inspect.cleandoc(doc)


def field_docstrings(cls: type) -> dict[str, str]:
    """Attribute docstrings of the class's fields, its own and its package bases'."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        module = inspect.getmodule(klass)
        if module is None or not module.__name__.startswith("lightning_fedrep"):
            continue
        path = Path(inspect.getsourcefile(klass))
        docs.update(attribute_docstrings(path).get(klass.__name__, {}))
    return docs


def parameters(func: object) -> list[str]:
    """The named parameters a caller passes (``self``/``cls`` and ``*args``/``**kwargs`` left out)."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return []
    return [
        p.name
        for p in signature.parameters.values()
        if p.name not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


def undescribed(params: list[str], *texts: str | None) -> list[str]:
    """The parameters none of ``texts`` names as a word (``name``, ``name``, ``name (type):``)."""
    text = "\n".join(t for t in texts if t)
    return [p for p in params if not re.search(rf"(?<![\w.]){re.escape(p)}(?!\w)", text)]


@cache
def lightning_hooks() -> tuple[frozenset[type], frozenset[str]]:
    """The package classes on Lightning's side (an exported class with a Lightning or torch base, and the
    package classes it inherits from, e.g. ``FederatedStrategyMixin``) and the names its outside bases
    define: the hooks such a class overrides."""
    sides, hooks = set(), set()
    for name in lightning_fedrep.__all__:
        cls = getattr(lightning_fedrep, name)
        if not inspect.isclass(cls):
            continue
        outside = [b for b in cls.__mro__ if b.__module__.split(".")[0] in EXTERNAL_PREFIXES[:2]]
        if outside:
            sides.update(b for b in cls.__mro__ if b.__module__.startswith("lightning_fedrep"))
            hooks.update(n for b in outside for n in vars(b))
    return frozenset(sides), frozenset(hooks)


def overrides_external(cls: type, name: str) -> bool:
    """Whether ``cls.name`` overrides a method of a base outside the package (a Lightning/torch hook),
    directly or as a mixin of a Lightning class (the API pages leave such hooks out: docs/conf.py)."""
    for base in cls.__mro__[1:]:
        if name in base.__dict__ and base.__module__.split(".")[0] in EXTERNAL_PREFIXES:
            return True
    sides, hooks = lightning_hooks()
    return cls in sides and name in hooks


def base_docstrings(cls: type, name: str) -> list[str]:
    """The docstrings of the methods ``cls.name`` overrides in the package's base classes: an override
    keeps the parameters its base describes (``FedProx.objective(phase)`` is ``Algorithm.objective``'s)."""
    docs = []
    for base in cls.__mro__[1:]:
        value = base.__dict__.get(name)
        if value is not None and base.__module__.startswith("lightning_fedrep"):
            func = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            docs.append(getattr(func, "__doc__", None) or "")
    return docs


def package_classes(cls: type) -> list[type]:
    """``cls`` and the package classes it inherits from before the first class of another project (the
    API pages show their members: ``:inherited-members:`` stops at Lightning's base)."""
    classes = []
    for klass in cls.__mro__:
        if not klass.__module__.startswith("lightning_fedrep"):
            break
        classes.append(klass)
    return classes


def public_members(cls: type, inherited: bool) -> list[tuple[str, object]]:
    """The public methods and properties ``cls`` defines (``inherited``: or inherits from a package class),
    with a docstring (what the API page shows: autodoc lists members with a docstring of their own)."""
    members: dict[str, object] = {}
    for klass in package_classes(cls) if inherited else [cls]:
        for name, value in klass.__dict__.items():
            if name.startswith("_") or name in members:
                continue
            func = value.fget if isinstance(value, property) else value
            func = func.__func__ if isinstance(func, (staticmethod, classmethod)) else func
            if callable(func) and getattr(func, "__doc__", None) and not isinstance(value, type):
                members[name] = (value, func)
    return [(name, func) for name, (_, func) in members.items()]


def resolve(name: str) -> object:
    """``lightning_fedrep.<name>`` (``FedRep``, or a dotted path such as ``plan.RankShare``)."""
    module, _, attr = f"lightning_fedrep.{name}".rpartition(".")
    return getattr(importlib.import_module(module), attr)


def problems_of(name: str) -> list[str]:
    """What the API reference lacks for ``lightning_fedrep.<name>``: its docstring, or a parameter that
    its docstring does not describe (for a class: the constructor's and its documented methods')."""
    obj = resolve(name)
    if not (inspect.isclass(obj) or inspect.isfunction(obj)):
        return (
            []
            if constant_docstring(name)
            else [f"{name}: a constant without a docstring under its assignment"]
        )
    doc = own_docstring(obj)
    if doc is None:
        return [f"{name}: no docstring"]
    if inspect.isfunction(obj):
        return [f"{name}({p}): not described" for p in undescribed(parameters(obj), doc)]
    problems = []
    init = obj.__dict__.get("__init__")
    fields = field_docstrings(obj)
    init_doc = own_docstring(init) if init is not None else None
    init_params = parameters(obj)
    inherited = [
        text
        for base in obj.__mro__[1:]
        if base.__module__.startswith("lightning_fedrep")
        for text in (own_docstring(base), own_docstring(base.__dict__.get("__init__")))
    ]  # an argument passed on to a package base class is described there
    missing = undescribed(init_params, doc, init_doc, "\n".join(f for f in fields if fields[f]), *inherited)
    problems += [f"{name}({p}): constructor argument not described" for p in missing]
    if name in names_with_option("no-members"):
        return problems
    for member, func in public_members(obj, inherited=name in names_with_option("inherited-members")):
        if isinstance(inspect.getattr_static(obj, member), property) or overrides_external(obj, member):
            continue
        problems += [
            f"{name}.{member}({p}): not described"
            for p in undescribed(parameters(func), func.__doc__, *base_docstrings(obj, member))
        ]
    return problems


def test_every_exported_name_is_on_an_api_page():
    """Catches a name added to ``__all__`` (e.g. a new algorithm) without an autodoc directive on
    docs/api/*.md: delete ``.. autoclass:: FedRep`` from docs/api/algorithms.md and this fails."""
    missing = sorted(set(lightning_fedrep.__all__) - documented_names())
    assert not missing, f"add these names of lightning_fedrep.__all__ to a page of docs/api/: {missing}"


def test_api_pages_name_only_real_objects():
    """Catches a directive naming something that no longer exists (a renamed class) — the page would then
    render an empty entry: rename ``FedRoD`` to ``FedROD`` on docs/api/algorithms.md and this fails."""
    stale = []
    for target in documented_names():
        module, _, attr = f"lightning_fedrep.{target}".rpartition(".")
        try:
            owner = __import__(module, fromlist=[attr])
        except ImportError:
            stale.append(target)
            continue
        if not hasattr(owner, attr):
            stale.append(target)
    assert not stale, f"docs/api/ documents names that do not exist: {sorted(stale)}"


@pytest.mark.parametrize("name", sorted(set(lightning_fedrep.__all__) | documented_names()))
def test_public_name_documents_its_arguments(name):
    """Catches a public name (exported, or shown on an API page such as the types in signatures) without a
    docstring, or whose docstring does not describe one of its arguments: remove ``override`` from
    ``register_algorithm``'s docstring and its case fails."""
    problems = problems_of(name)
    assert not problems, "\n".join(problems)


def test_checks_catch_the_bugs_they_target():
    """The checker itself against hand-made objects: a function with an undescribed argument, a class whose
    dataclass-generated docstring is no docstring, a method whose argument only its Args: names."""

    def described(a: int, b: int) -> int:
        """Add ``a`` to the other one.

        Args:
            b: the other one.
        """
        return a + b

    def half(a: int, b: int) -> int:
        """Return ``a``."""
        return a

    @dataclasses.dataclass
    class Bare:
        x: int = 0

    assert undescribed(parameters(described), described.__doc__) == []
    assert undescribed(parameters(half), half.__doc__) == ["b"]
    assert own_docstring(Bare) is None
    assert undescribed(["x"], "the view.x field") == ["x"], (
        "an attribute of another name is not the parameter"
    )
    assert textwrap.dedent(constant_docstring("CHECKPOINT_KEY") or "").startswith("Where a checkpoint")
