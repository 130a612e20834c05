"""Sphinx configuration of the lightning_fedrep documentation site (``make docs`` builds it offline)."""

import functools
import inspect
import os
import sys

sys.path.insert(0, os.path.abspath(".."))
os.environ.setdefault("WANDB_MODE", "disabled")

project = "lightning_fedrep"
author = "lightning_fedrep developers"
copyright = "lightning_fedrep developers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "sphinx_copybutton",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "browser-check", "figures/**/*.md", "Thumbs.db", ".DS_Store"]

# MyST: `#section-slug` links to headings down to level 3; ::: fences; {testcode} etc. as directives.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]

# autodoc: the signature's hints stay in the signature; the Args: section describes each argument.
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "signature"
autodoc_class_signature = "mixed"
autodoc_member_order = "bysource"
# Lightning's docstrings of the hooks a class overrides are Lightning's to document, not ours.
autodoc_inherit_docstrings = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# Warnings are errors (`-W`), and every cross reference must resolve, except to names of other
# projects: no intersphinx inventories are fetched (the build is offline).
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|lightning|lightning_fabric|lightning_utilities|torchmetrics|numpy|np)(\..*)?"),
    (
        r"py:.*",
        r"(typing|collections|collections\.abc|abc|contextlib|enum|dataclasses|pathlib|os|logging|datetime|re|nn)\..*",
    ),
    (r"py:.*", r"(Tensor|Module|Optimizer|LightningModule|LightningDataModule|Trainer|Callback|Strategy)"),
    # private helpers (a leading underscore) that appear in a signature have no page to link to
    (r"py:class", r"lightning_fedrep\.(\w+\.)*_\w+"),
]

# doctest: every {testcode}/{doctest} block on a page and every >>> example in a docstring runs.
doctest_global_setup = """
import os
os.environ.setdefault("WANDB_MODE", "disabled")
import torch
torch.set_num_threads(1)
"""

html_theme = "furo"
html_title = "lightning_fedrep"
html_static_path: list[str] = []


def _prose_attribute_docstring(self) -> tuple[str, list[str]]:
    """Read an attribute's docstring as prose: napoleon would take the words before its first colon
    ("Extra per-client tensors: e.g. ...") for the attribute's type."""
    lines = [*self._dedent(self._consume_to_end())]
    return "", self.__class__(lines, self._config).lines()


from sphinx.ext.napoleon import docstring as _napoleon_docstring  # noqa: E402

_napoleon_docstring.GoogleDocstring._consume_inline_attribute = _prose_attribute_docstring


def exported_constant_docstring(name: str) -> list[str] | None:
    """The docstring of ``lightning_fedrep.<name>`` (a constant re-exported by the package) as written
    under its assignment in the module that defines it, or None when no module documents it."""
    import importlib
    import pkgutil

    from sphinx.pycode import ModuleAnalyzer

    import lightning_fedrep

    value = getattr(lightning_fedrep, name)
    for info in pkgutil.walk_packages(lightning_fedrep.__path__, "lightning_fedrep."):
        module = importlib.import_module(info.name)
        if getattr(module, name, None) is not value:
            continue
        docs = ModuleAnalyzer.for_module(info.name).find_attr_docs().get(("", name))
        if docs:
            return list(docs)
    return None


def _constant_docstring(app, what, name, obj, options, lines) -> None:  # noqa: ANN001
    """autodoc shows a re-exported constant's type's docstring (``dict``'s, ``str``'s); show its own (none:
    the type's lines are dropped, and :func:`_require_docstring` fails the build)."""
    if what == "data" and name.startswith("lightning_fedrep.") and name.count(".") == 1:
        docs = exported_constant_docstring(name.split(".", 1)[1])
        lines[:] = docs or []


DOCUMENTED_KINDS = ("class", "exception", "function", "data", "method", "property", "attribute")


def _require_docstring(app, what, name, obj, options, lines) -> None:  # noqa: ANN001
    """A public name of the package shown on a page without a docstring of its own is a warning, so the
    ``-W`` build fails on it (``tests/test_docs_api.py`` also checks that each argument is described)."""
    public = name.startswith("lightning_fedrep.") and not any(p.startswith("_") for p in name.split("."))
    if public and what in DOCUMENTED_KINDS and not any(line.strip() for line in lines):
        from sphinx.util import logging as sphinx_logging

        sphinx_logging.getLogger(__name__).warning(
            f"{name} has no docstring: say what it is for and when it runs (a public name needs one)"
        )


def _factory_defaults(app, what, name, obj, options, signature, return_annotation):  # noqa: ANN001
    """A dataclass field's ``default_factory`` shows as ``=<factory>``, which is no Python expression:
    Sphinx then cannot parse the signature and splits ``dict[str, float]`` at its comma."""
    if signature and "<factory>" in signature:
        signature = signature.replace("<factory>", "...")
    return signature, return_annotation


EXTERNAL_PROJECTS = ("lightning", "lightning_fabric", "pytorch_lightning", "torch")


@functools.cache
def _lightning_hooks() -> tuple[frozenset[type], frozenset[str]]:
    """The package classes on the Lightning side (an exported class with a Lightning base, and the
    package classes it inherits from, such as ``FederatedStrategyMixin``) and the names of the methods
    their Lightning bases define (the hooks they override)."""
    import lightning_fedrep

    sides, hooks = set(), set()
    for name in lightning_fedrep.__all__:
        cls = getattr(lightning_fedrep, name)
        if not inspect.isclass(cls):
            continue
        external = [b for b in cls.__mro__ if b.__module__.split(".")[0] in EXTERNAL_PROJECTS]
        if external:
            sides.update(b for b in cls.__mro__ if b.__module__.startswith("lightning_fedrep"))
            hooks.update(n for b in external for n in vars(b) if not n.startswith("_"))
    return frozenset(sides), frozenset(hooks)


def _skip_lightning_hooks(app, what, name, obj, skip, options):  # noqa: ANN001
    """Leave out a Lightning hook a strategy, callback or data module overrides (``setup``,
    ``training_step``, ``on_train_end``, ...): Lightning documents it; the page shows the package's API."""
    func = getattr(obj, "fget", obj)
    owner_name = getattr(func, "__qualname__", "").rpartition(".")[0]
    owner = getattr(sys.modules.get(getattr(func, "__module__", "") or ""), owner_name, None)
    sides, hooks = _lightning_hooks()
    if what == "class" and owner in sides and name in hooks:
        return True
    return None


def setup(app) -> None:  # noqa: ANN001
    app.connect("autodoc-process-docstring", _constant_docstring)
    app.connect("autodoc-process-docstring", _require_docstring)
    app.connect("autodoc-process-signature", _factory_defaults)
    app.connect("autodoc-skip-member", _skip_lightning_hooks)
