"""The ``transformers`` extra is optional: no module of the package imports transformers or peft when it is
imported (only inside the functions that need them), and those functions say how to install the extra.

(torchmetrics itself imports transformers when it is installed, so "not in ``sys.modules``" cannot be
checked; the imports are read from the source instead, as ``tests/test_import_rules.py`` does.)"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import lightning_fedrep

ROOT = Path(lightning_fedrep.__file__).parent
EXTRA = ("transformers", "peft")


def module_level_imports(tree: ast.AST) -> list[str]:
    """Top-level names imported outside any function body."""
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            return
        if isinstance(node, ast.Import):
            names.extend(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module.split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def test_no_module_imports_the_extra_at_import_time():
    offenders = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted(ROOT.rglob("*.py"))
        for name in module_level_imports(ast.parse(path.read_text()))
        if name in EXTRA
    ]
    assert offenders == []


@pytest.mark.parametrize("missing", EXTRA)
def test_without_the_extra_the_model_names_it(monkeypatch, missing):
    from lightning_fedrep.models.transformers import HFSequenceClassifier

    monkeypatch.setitem(sys.modules, missing, None)
    kwargs = {"config": {"model_type": "bert"}, "lora_r": 2 if missing == "peft" else None}
    with pytest.raises(ImportError, match=r'pip install "lightning-fedrep\[transformers\]"'):
        HFSequenceClassifier(**kwargs)
