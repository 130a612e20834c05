"""The package's dependency rules (docs/architecture.md), checked by reading every module's imports.

The rules are data: :data:`GROUPS` puts modules into groups by dotted name (relative to the package),
:data:`WITHIN` nests a group inside a larger one, :data:`RULES` says which group must not import which, and
:data:`PENDING` lists the violations that are known and scheduled (issue 39's later steps), each of which
must still exist (so a fixed one is taken off the list). Later sessions extend the tables as folders move.

Which imports count: every ``import`` / ``from ... import`` statement in a module, at module level,
inside functions and under ``if TYPE_CHECKING:`` alike. A function-local import is a dependency that is
merely deferred, and a type-only import still ties a module to the other's meaning (and becomes a runtime
import at the next refactor); the circle that issue 25 names ran through such imports. The cycle check
uses the same edges.
"""

from __future__ import annotations

import ast
import fnmatch
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import lightning_fedrep

PACKAGE = "lightning_fedrep"
ROOT = Path(lightning_fedrep.__file__).parent
LIGHTNING = ("lightning", "pytorch_lightning")
LIGHTNING_MARKER = "<lightning>"
"""How the checker names the Lightning distribution: never a dotted name inside the package, so it cannot
be confused with the package's own ``lightning/`` folder (design section 6.7)."""

GROUPS: dict[str, tuple[str, ...]] = {
    # the first group whose pattern matches names a module: the narrower groups come first
    "algorithm modules": ("federation.algorithms", "federation.algorithms.*"),
    "core": ("federation", "federation.*"),
    "evaluation": ("evaluation", "evaluation.*"),
    "sequential runner": ("runners.sequential",),
    "vectorized runner": ("runners.lockstep", "runners.lockstep.*"),
    "runners": ("runners", "runners.*"),
    "session": ("session", "session.*"),
    "lightning face": (
        "lightning",  # our lightning_fedrep/lightning/ folder (the distribution is LIGHTNING_MARKER)
        "lightning.*",
    ),
    "callbacks": ("callbacks", "callbacks.*"),
    "data loaders": ("data", "data.*"),
    "app": ("app", "app.*"),
    "privacy": ("privacy", "privacy.*"),
}
"""Module groups: fnmatch patterns on the dotted module name inside the package (``""`` is the package).
The algorithm modules are held to more than the core's rules: they import only the algorithm API
(:func:`test_algorithm_modules_are_written_on_the_public_api`)."""

WITHIN: dict[str, str] = {"sequential runner": "runners", "vectorized runner": "runners"}
"""A group inside a larger one: its modules are the larger group's too, and its rules hold for them."""


@dataclass(frozen=True)
class Rule:
    source: str
    forbidden: str
    why: str


RULES: tuple[Rule, ...] = (
    Rule("core", "algorithm modules", "the core reaches algorithms by name, through the registry they fill"),
    Rule("core", "evaluation", "evaluation scores what the core holds; the core does not score"),
    Rule("core", "runners", "the federation core knows no engine; runners build on it"),
    Rule("core", "lightning face", "the core is driven by the strategy, never the other way round"),
    Rule("core", "callbacks", "callbacks plug into the core, the core does not know them"),
    Rule("core", "data loaders", "the core takes loaders through small protocols (sharding.PlanBatches)"),
    Rule("core", "app", "the command and reports sit on top of everything"),
    Rule("core", "session", "the session holds the core's objects; the core does not know it"),
    Rule("core", "lightning", "the federation core runs without Lightning"),
    Rule("core", "privacy", "the core takes a mechanism through its own protocol (api.mechanism)"),
    Rule("evaluation", "runners", "runners evaluate with it, it does not know them"),
    Rule("evaluation", "lightning face", "the face logs what an evaluation pass leaves"),
    Rule("evaluation", "callbacks", "callbacks ask for evaluation, it does not know them"),
    Rule("evaluation", "data loaders", "evaluation reads batches it is handed"),
    Rule("evaluation", "app", "the command and reports sit on top of everything"),
    Rule("evaluation", "lightning", "evaluation runs without Lightning"),
    Rule("evaluation", "session", "the session asks for evaluation, evaluation does not know it"),
    Rule("runners", "lightning face", "runners use the core's types (Objective, not hooks)"),
    Rule("runners", "lightning", "runners read the Trainer through Constraints, built by the face"),
    Rule("runners", "callbacks", "runners see callbacks only through duck-typed hooks"),
    Rule("runners", "data loaders", "runners take their batches through the core's protocols"),
    Rule("runners", "app", "the command and reports sit on top of everything"),
    Rule("runners", "session", "the session chooses the runner, runners do not know it"),
    Rule("sequential runner", "vectorized runner", "the plain runner stands alone beside the engine"),
    Rule("session", "lightning face", "the face translates Lightning's events into the session's calls"),
    Rule("session", "lightning", "the session runs without Lightning: the face hands it the Trainer's facts"),
    Rule("session", "vectorized runner", "the session drives runners through Runner and the selection"),
    Rule("session", "callbacks", "the session sees callbacks through the callback bus"),
    Rule("session", "app", "the command and reports sit on top of everything"),
    Rule("lightning face", "vectorized runner", "the face drives runners through Runner and the selection"),
    Rule("lightning face", "callbacks", "the face knows the callback API, not the concrete callbacks"),
    Rule("lightning face", "app", "the command and reports sit on top of everything"),
    Rule("callbacks", "runners", "callbacks use the public API, never runner internals"),
    Rule("callbacks", "app", "callbacks do not reach into the command layer"),
    Rule("data loaders", "runners", "loaders feed the engine, they do not know it"),
    Rule("data loaders", "lightning face", "loaders do not know the strategy"),
    Rule("data loaders", "callbacks", "loaders do not know the callbacks"),
    Rule("data loaders", "app", "the command and reports sit on top of everything"),
    Rule("privacy", "lightning face", "the strategy drives mechanisms and accountants, not the reverse"),
    Rule("privacy", "callbacks", "callbacks may report privacy, privacy does not know them"),
    Rule("privacy", "app", "the command and reports sit on top of everything"),
    Rule("privacy", "session", "the session holds a mechanism, the mechanism does not know it"),
    Rule("privacy", "lightning", "privacy runs without Lightning"),
    Rule("privacy", "sequential runner", "runners apply mechanisms, never the other way round"),
    Rule("privacy", "vectorized runner", "runners apply mechanisms, never the other way round"),
    Rule("data loaders", "session", "loaders do not know the session"),
)
"""Group ``source`` must not import group ``forbidden`` (``"lightning"``: the Lightning packages)."""

PENDING: dict[tuple[str, str], str] = {}
"""Known violations ``(module, imported module or "<lightning>")`` with the issue item that fixes each."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    """Every module of the package by dotted name relative to it (``""`` is the package itself)."""
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = f"{PACKAGE}.{module}".rstrip(".").split(".")
    if path.name != "__init__.py":
        base.pop()
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _internal(name: str) -> str | None:
    """``lightning_fedrep.x.y`` as ``"x.y"`` (the nearest existing module), ``None`` for other packages."""
    if name != PACKAGE and not name.startswith(PACKAGE + "."):
        return None
    inner = name[len(PACKAGE) + 1 :]
    while inner not in modules():
        inner = inner.rpartition(".")[0]
    return inner


def imports_of_source(module: str, source: str, path: Path) -> set[str]:
    """What ``source`` (the text of ``module``) imports: package modules by relative dotted name, and
    ``"<lightning>"`` for any Lightning package. Every import statement counts (see the module docstring)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, path, node)
            names = [f"{base}.{alias.name}" for alias in node.names]  # a submodule, or a name in ``base``
        else:
            continue
        for name in names:
            if name.split(".")[0] in LIGHTNING:
                found.add(LIGHTNING_MARKER)
            elif (inner := _internal(name)) is not None and inner != module:
                found.add(inner)
    return found


@cache
def imports_of(module: str) -> frozenset[str]:
    path = modules()[module]
    return frozenset(imports_of_source(module, path.read_text(), path))


def group_of(module: str) -> str | None:
    if module == LIGHTNING_MARKER:
        return "lightning"
    for group, patterns in GROUPS.items():
        if any(fnmatch.fnmatchcase(module, p) for p in patterns):
            return group
    return None


def groups_of(module: str) -> list[str]:
    """The module's group and every group that group lies :data:`WITHIN`, narrowest first."""
    groups = []
    group = group_of(module)
    while group is not None:
        groups.append(group)
        group = WITHIN.get(group)
    return groups


def broken_rule(module: str, target: str) -> Rule | None:
    """The first rule that ``module`` importing ``target`` breaks (any of their groups), or ``None``."""
    forbidden = {(r.source, r.forbidden): r for r in RULES}
    for source in groups_of(module):
        for imported in groups_of(target):
            if (source, imported) in forbidden:
                return forbidden[source, imported]
    return None


def violations(graph: dict[str, frozenset[str]]) -> list[str]:
    """Every import that breaks a rule and is not pending, as readable lines."""
    found = []
    for module, imported in sorted(graph.items()):
        for target in sorted(imported):
            rule = broken_rule(module, target)
            if rule is not None and (module, target) not in PENDING:
                found.append(f"{module} imports {target} ({rule.source} -> {rule.forbidden}: {rule.why})")
    return found


def find_cycle(graph: dict[str, frozenset[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated at the end), or ``None``
    (depth-first search: a back edge to a module on the current path closes a cycle)."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def _package_graph() -> dict[str, frozenset[str]]:
    return {m: imports_of(m) for m in modules()}


def _import_graph() -> dict[str, frozenset[str]]:
    """Imports between the package's modules, package ``__init__`` files included (Lightning left out): a
    package that imports its own modules closes no circle by itself, but a module that imports the package back
    does (``algorithms.py``'s ``__getattr__`` imported ``federation/algorithms/__init__.py``, whose algorithm
    modules import ``algorithms.py``: the circle of issue 39)."""
    return {m: frozenset(i for i in imports_of(m) if i != LIGHTNING_MARKER) for m in modules()}


# ----------------------------------------------------------------------------- the rules, today


def test_groups_name_existing_modules() -> None:
    """A group pattern that matches nothing is a typo or a moved module: the rules would check nothing."""
    for group, patterns in GROUPS.items():
        for pattern in patterns:
            assert any(fnmatch.fnmatchcase(m, pattern) for m in modules()), (
                f"{group}: {pattern!r} matches no module"
            )


def test_rules_name_existing_groups() -> None:
    """A rule or a nesting that names no group (a typo, a renamed group) would check nothing."""
    known = set(GROUPS) | {"lightning"}
    assert {g for r in RULES for g in (r.source, r.forbidden)} - known == set()
    assert set(WITHIN) | set(WITHIN.values()) <= set(GROUPS)


def test_dependency_rules_hold() -> None:
    """Catches any import that breaks a rule, e.g. ``runners/lockstep/engine.py`` importing ``FederatedCallback``
    from ``lightning_fedrep.lightning.callback``, ``federation/sharding.py`` importing ``data.loaders`` under
    TYPE_CHECKING, ``federation/api/registry.py`` importing the built-in algorithm modules, or
    ``runners/sequential.py`` importing ``runners.lockstep.probe`` again."""
    assert violations(_package_graph()) == []


def test_pending_violations_still_exist() -> None:
    """A pending violation that was fixed must leave :data:`PENDING` (else it would be allowed back), and each
    one breaks a rule (else it is no violation) and names the issue item that fixes it."""
    graph = _package_graph()
    assert {(m, t) for m, t in PENDING if t not in graph.get(m, ())} == set()
    assert {(m, t) for m, t in PENDING if broken_rule(m, t) is None} == set()
    assert all(note.startswith("issue ") for note in PENDING.values())


def test_loss_term_type_lives_with_the_algorithm_api() -> None:
    """Catches the loss-term type (``LossTerm``, ``Objective``, ``StepView``, the transforms) defined in the
    callback module (``lightning/callback.py``) again or anywhere outside the algorithm API (``federation/api/``),
    ``LossTerm`` moved out of ``federation/api/objective.py``, or a type of the removed loss-term route
    (``VectorizedLossTerm``, ``LiveStep``) defined again anywhere."""
    names = (
        "LossTerm",
        "Objective",
        "StepView",
        "GradTransform",
        "ParamTransform",
        "VectorizedLossTerm",
        "LiveStep",
    )
    owners = {
        (module, node.name)
        for module, path in modules().items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.name in names
    }
    assert owners and all(group_of(m) == "core" for m, _ in owners), owners
    assert all(m.startswith("federation.api.") for m, _ in owners), owners
    assert ("federation.api.objective", "LossTerm") in owners, owners
    assert not {name for _, name in owners} & {"VectorizedLossTerm", "LiveStep"}, owners


ALGORITHM_API = frozenset(
    {
        "federation.api.aggregation",
        "federation.api.algorithm",
        "federation.api.arguments",
        "federation.api.declared",
        "federation.api.exchange",
        "federation.api.objective",
        "federation.api.registry",
        "federation.api.scoring",
        "federation.api.server_optimizer",
        "federation.module.feature_split",
    }
)
"""What an algorithm module (``federation/algorithms/<name>.py``) may import: the public algorithm API (with
``federation.feature_split``: the module as ``head(features(x))``, found as the vectorized runner finds it)."""


def test_algorithm_modules_are_written_on_the_public_api() -> None:
    """Catches an algorithm module importing past the public algorithm API, e.g. ``federation/algorithms/
    fedrep.py`` importing ``federation.round`` or ``federation.live`` to reach a round's internals, and a module
    other than the package and ``federation/algorithms/__init__.py`` importing one algorithm module (the rest
    of the package reaches algorithms by name, through the registry: the strategy never checks a name). The
    private helpers several algorithm modules share (``federation/algorithms/_<name>.py``, e.g. the class
    prototypes of FedProto and FedPAC) are held to the same API and imported by algorithm modules only."""
    inside = [m for m in modules() if m.startswith("federation.algorithms.")]
    helpers = {m for m in inside if m.rpartition(".")[2].startswith("_")}
    algorithm_modules = [m for m in inside if m not in helpers]
    assert {"federation.algorithms.fedrep", "federation.algorithms.local"} <= set(algorithm_modules)
    beyond = {m: sorted(imports_of(m) - ALGORITHM_API - helpers) for m in inside}
    assert {m: found for m, found in beyond.items() if found} == {}
    importers = {m for m in modules() if imports_of(m) & set(algorithm_modules)}
    assert importers <= {"", "federation.algorithms"}, importers
    assert {m for m in modules() if imports_of(m) & helpers} <= set(algorithm_modules), helpers


def _is_main_guard(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
    )


def test_commands_live_in_the_app_layer() -> None:
    """Catches a command's ``if __name__ == "__main__":`` outside the app layer, e.g. the FEMNIST
    re-sampling's main back in ``data/femnist_sample.py`` (data-preparation commands go to ``scripts/``)."""
    trees = {m: ast.parse(path.read_text()) for m, path in modules().items()}
    commands = {m for m, tree in trees.items() if any(map(_is_main_guard, tree.body))}
    assert {"app.cli", "app.quickstart"} <= commands  # the checker sees the commands that exist
    assert {m for m in commands if group_of(m) != "app"} == set()


def test_no_import_cycle() -> None:
    """Catches a circle such as data/loaders -> sharding -> engine/schedule -> data/loaders (issue 25), or
    the registry importing the algorithm modules back through ``federation/algorithms/__init__.py`` (issue 39)."""
    assert find_cycle(_import_graph()) is None


# ----------------------------------------------------------------------------- the checker itself


def test_planted_violation_is_found() -> None:
    """The checker reads imports inside functions and under TYPE_CHECKING, relative ones included."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ..data.loaders import RoundLoader\n"
        "def f():\n    from lightning_fedrep.lightning import callback\n    import lightning.pytorch as pl\n"
    )
    found = imports_of_source("federation.sharding", source, ROOT / "federation" / "sharding.py")
    assert found == {"data.loaders", "lightning.callback", LIGHTNING_MARKER}
    assert [line.split(" (")[0] for line in violations({"federation.sharding": frozenset(found)})] == [
        "federation.sharding imports <lightning>",
        "federation.sharding imports data.loaders",
        "federation.sharding imports lightning.callback",
    ]


def test_planted_violations_of_nested_groups_are_found() -> None:
    """A group :data:`WITHIN` another is held to its own rules and to the outer group's: the sequential runner
    importing the vectorized runner breaks its own rule, importing the Lightning face breaks the runners'."""
    graph = {
        "runners.sequential": frozenset({"runners.lockstep.probe", "lightning.strategy", "federation.plan"})
    }
    assert [line.split(" (")[0] for line in violations(graph)] == [
        "runners.sequential imports lightning.strategy",
        "runners.sequential imports runners.lockstep.probe",
    ]
    assert (
        broken_rule("runners.selection", "runners.lockstep.engine") is None
    )  # the runners choose between both
    assert (
        broken_rule("federation.api.registry", "federation.algorithms.fedrep").forbidden
        == "algorithm modules"
    )


def test_planted_cycle_is_found() -> None:
    """The depth-first search finds a circle and only a circle (a diamond is none)."""
    diamond = {"a": frozenset({"b", "c"}), "b": frozenset({"d"}), "c": frozenset({"d"}), "d": frozenset()}
    assert find_cycle(diamond) is None
    circle = {**diamond, "d": frozenset({"e"}), "e": frozenset({"b"})}
    assert find_cycle(circle) == ["b", "d", "e", "b"]


# ----------------------------------------------------------------------------- the thin Lightning face

MIXIN_LINES = 400
"""Issue 25: the strategy mixin's class body, docstrings included, at most this many lines."""
PROCESSES = frozenset({"collective", "distributed", "world_size", "rank"})
RUNNER_OR_PROCESSES = PROCESSES | {"engine", "_engine", "runner", "vectorized", "lockstep"}
"""Names a Lightning hook must not branch on: the runner (engine) or the number of processes."""


def _is_override(node: ast.FunctionDef) -> bool:
    names = {d.id if isinstance(d, ast.Name) else getattr(d, "attr", None) for d in node.decorator_list}
    return "override" in names


def hook_branches(class_node: ast.ClassDef) -> list[str]:
    """``hook: line`` for every branch (``if``, conditional expression, ``while``, comprehension filter,
    ``and``/``or``) inside an ``@override`` method whose condition names the runner or the processes."""
    found = []
    for hook in class_node.body:
        if not isinstance(hook, ast.FunctionDef) or not _is_override(hook):
            continue
        for node in ast.walk(hook):
            if isinstance(node, ast.If | ast.IfExp | ast.While):
                tests = [node.test]
            elif isinstance(node, ast.comprehension):
                tests = list(node.ifs)
            elif isinstance(node, ast.BoolOp):
                tests = node.values
            else:
                continue
            names = {
                n.id if isinstance(n, ast.Name) else n.attr
                for test in tests
                for n in ast.walk(test)
                if isinstance(n, ast.Name | ast.Attribute)
            }
            if names & RUNNER_OR_PROCESSES:
                found.append(f"{hook.name}: line {node.lineno}")
    return found


def _mixin() -> ast.ClassDef:
    tree = ast.parse(modules()["lightning.strategy"].read_text())
    (mixin,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "FederatedStrategyMixin"]
    return mixin


def test_the_strategy_mixin_is_thin() -> None:
    """Catches the God class coming back (issue 25): the mixin over 400 lines, or a Lightning hook that
    branches on the runner or on the processes, e.g. ``if self.collective.distributed:`` in
    ``on_train_batch_start`` (those decisions belong to the runners and the ``Sharded`` wrapper)."""
    mixin = _mixin()
    assert mixin.end_lineno - mixin.lineno + 1 <= MIXIN_LINES
    hooks = [n for n in mixin.body if isinstance(n, ast.FunctionDef) and _is_override(n)]
    assert len(hooks) >= 15  # the checker sees the hooks
    assert hook_branches(mixin) == []


def test_planted_hook_branches_are_found() -> None:
    """The branch checker finds a hook's test of the processes or the runner, and nothing in a helper."""
    source = (
        "class FederatedStrategyMixin:\n"
        "    @override\n"
        "    def on_train_batch_start(self, batch, batch_idx):\n"
        "        if self.collective.distributed:\n            pass\n"
        "    @override\n"
        "    def training_step(self, *args):\n"
        "        return 1 if self._run.runner.vectorized else 2\n"
        "    @override\n"
        "    def setup(self, trainer):\n"
        "        if trainer.state.fn == 'fit' and self.lightning_module.automatic_optimization:\n            pass\n"
        "    def _helper(self):\n"
        "        if self.collective.world_size > 1:\n            pass\n"
    )
    (mixin,) = ast.parse(source).body
    assert hook_branches(mixin) == ["on_train_batch_start: line 4", "training_step: line 8"]


LIGHTNING_ATTRIBUTES = frozenset(
    {
        "lightning_module",
        "trainer",
        "root_device",
        "precision_plugin",
        "lr_scheduler_configs",
        "current_epoch",
        "sanity_checking",
        "automatic_optimization",
    }
)
"""What only a Lightning strategy, module or Trainer has: the session asks its host instead (``Host``)."""


def lightning_attributes_in(source: str) -> list[str]:
    """The attributes of :data:`LIGHTNING_ATTRIBUTES` that ``source`` reads or writes (``x.trainer``, ...)."""
    nodes = ast.walk(ast.parse(source))
    return sorted({n.attr for n in nodes if isinstance(n, ast.Attribute) and n.attr in LIGHTNING_ATTRIBUTES})


def test_the_session_reaches_no_lightning_object_around_the_rules() -> None:
    """Catches the session made Lightning-free by accounting only: reading the Trainer or the strategy's
    Lightning attributes (``self.lightning_module.trainer.current_epoch``, ``self.root_device``) without
    importing Lightning, where it should ask its host (``Host._round_now()``, ``Host._device()``)."""
    session = [m for m in modules() if group_of(m) == "session"]
    assert "session.session" in session
    found = {m: lightning_attributes_in(modules()[m].read_text()) for m in session}
    assert {m: names for m, names in found.items() if names} == {}


def test_planted_lightning_attribute_is_found() -> None:
    source = "def f(self):\n    return self.lightning_module.trainer.current_epoch, trainer\n"
    assert lightning_attributes_in(source) == ["current_epoch", "lightning_module", "trainer"]
