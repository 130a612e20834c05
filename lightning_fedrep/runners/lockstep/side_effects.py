"""What ``training_step`` writes besides its loss, and putting it back: the probe's look at a module's state.

The engine runs no ``training_step`` (it trains the declared loss), so whatever the step writes into the
module would happen on the two probe batches only: a torchmetrics metric it updates would see two batches
a fit, a counter would count two steps. :func:`state_prints` takes a cheap fingerprint of what a step can
write and the user (or Lightning) reads later; :func:`side_effects` says in words what differs between two
of them; :func:`restored` puts the module back as it was, so that probing leaves no trace (a fallback's
sequential run starts from the state ``runner="sequential"`` starts from).

Compared, in the module and in every submodule:

- a torchmetrics ``Metric``: its update count and its states (``add_state``'s tensors and lists), nothing
  else of it (its caches change on ``compute``); a ``MetricCollection``: its metrics, not its bookkeeping;
- every buffer: which tensor is registered, and that tensor's version counter (any in-place write);
- every attribute in the module's ``__dict__``: numbers, strings and ``None`` by value; a tensor by
  identity and version counter; a numpy array by identity and (up to :data:`MAX_ARRAY` elements) value; a
  random generator (torch's, numpy's, Python's) by its state; a list, tuple, dict, set or deque by identity,
  length and (up to :data:`MAX_ITEMS` items) its items; any other object by identity and its own
  attributes; containers and objects :data:`DEPTH` levels deep (an attribute's dict's lists);
- the hooks registered on a submodule (forward, forward pre-, backward, backward pre-): how many; and which
  submodules there are.

Left out, on purpose: parameters (the step does not write them; the optimizer does, and the engine steps
its own copies), ``nn.Module``'s own tables (:data:`MODULE_BOOKKEEPING`) and the ``LightningModule``'s
(:data:`LIGHTNING_BOOKKEEPING`), which Lightning writes around every step on every runner.
Not seen: state outside the module (a global, a callback's attribute, a closure a hook writes into).
"""

from __future__ import annotations

import inspect
import numbers
import pickle
import random
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn
from torchmetrics import Metric, MetricCollection

DEPTH = 2
"""How deep the containers and objects an attribute holds are compared (and restored)."""

MAX_ITEMS = 64
"""Containers (and objects' attribute tables) with more items are compared by identity and length only."""

MAX_ARRAY = 4096
"""Numpy arrays with more elements are compared by identity and shape only (an array has no version counter)."""

SHOWN = 6
"""How many writes a reason names (then how many more there are)."""

MODULE_BOOKKEEPING = frozenset(vars(nn.Module()))
"""``nn.Module``'s own attributes, not compared as attributes: its parameter, buffer and submodule tables
(buffers and submodules are compared themselves; parameters are the optimizer's), its hook tables (compared
by count: :data:`HOOK_TABLES`) and ``training`` (modes are the runners' to set; the probe keeps them)."""

LIGHTNING_BOOKKEEPING = frozenset(
    {
        "_automatic_optimization",
        "_compiler_ctx",
        "_current_fx_name",
        "_device",
        "_device_mesh",
        "_dtype",
        "_example_input_array",
        "_fabric",
        "_fabric_optimizers",
        "_log_hyperparams",
        "_metric_attributes",
        "_param_requires_grad_state",
        "_strict_loading",
        "_trainer",
        "allow_zero_length_dataloader_with_multiple_devices",
        "prepare_data_per_node",
    }
)
"""The attributes ``LightningModule.__init__`` sets (a test pins the list to Lightning's): its trainer, device
and dtype, the hook its loop runs, the optimizers ``toggle_optimizer`` froze, the metric names ``self.log``
looked up. Lightning writes them around every step on every runner; they are not results of the step."""

HOOK_TABLES = {
    "_forward_pre_hooks": "forward pre-hook",
    "_forward_hooks": "forward hook",
    "_backward_pre_hooks": "backward pre-hook",
    "_backward_hooks": "backward hook",
}
"""The hook tables of an ``nn.Module`` whose size is compared, and what their hooks are called."""

_HOOK_EXTRAS = (
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks_with_kwargs",
)
"""Tables keyed by a hook's id beside :data:`HOOK_TABLES` (emptied of a removed hook's id as torch's handle does)."""

Kind = Literal["metric", "module", "buffer", "attribute", "hooks"]
Key = tuple[Kind, str, str]
"""What a print is of: its kind, the dotted name and (hook tables only) which table."""

Role = Literal["metric", "collection", "module"]


@dataclass(frozen=True)
class StatePrints:
    """A fingerprint of everything in a module a ``training_step`` could write (:func:`state_prints`).

    ``prints`` maps what was looked at to a hashable fingerprint (no tensor inside, so ``==`` is plain);
    ``held`` keeps alive every object whose identity a fingerprint records, so no new object takes its id."""

    prints: dict[Key, tuple]
    held: list[Any]


def state_prints(module: nn.Module) -> StatePrints:
    """The fingerprint of ``module``'s side-effect-visible state (see the module's docstring), taken by the
    probe just before and just after ``training_step``. Cheap: no tensor is copied or read (only small
    numpy arrays and random generators' states are)."""
    prints: dict[Key, tuple] = {}
    held: list[Any] = []
    for name, sub, role in _scanned(module):
        prints[("module", name, "")] = (type(sub).__name__, id(sub))
        held.append(sub)
        if role == "metric":
            states = tuple(_print(getattr(sub, state, None), 1, held) for state in sub._defaults)
            prints[("metric", name, "")] = (type(sub).__name__, sub._update_count, states)
        elif role == "module":
            prints.update(_module_prints(name, sub, held))
    return StatePrints(prints, held)


def side_effects(before: StatePrints, after: StatePrints) -> list[str]:
    """What was written between two fingerprints of one module, in words (``"updates the torchmetrics metric
    'train_acc' (MulticlassAccuracy)"``, ``"writes the attribute 'calls' (int)"``); ``[]`` if nothing."""
    added = _module_names(after.prints.keys() - before.prints.keys())
    gone = _module_names(before.prints.keys() - after.prints.keys())
    written = []
    for key, now in after.prints.items():
        then = before.prints.get(key)
        if then is None and not _inside(key, added) or then is not None and not _same(then, now):
            written.append(_described(key, then, now))
    for key in before.prints.keys() - after.prints.keys():
        if not _inside(key, gone):
            written.append(_described(key, before.prints[key], None))
    return written


def _module_names(keys: Any) -> list[str]:
    return [name for kind, name, _ in keys if kind == "module"]


def _inside(key: Key, modules: list[str]) -> bool:
    """Whether ``key`` belongs to one of ``modules`` (added or removed: named once, not with each of its
    attributes, buffers and hook tables), other than that module's own entry."""
    kind, name, _ = key
    return any(name.startswith(f"{m}.") or (name == m and kind != "module") for m in modules if m)


def named_side_effects(written: list[str]) -> str:
    """``written`` (from :func:`side_effects`) as one clause, the first :data:`SHOWN` and how many more."""
    more = f" and {len(written) - SHOWN} more" if len(written) > SHOWN else ""
    return ", ".join(written[:SHOWN]) + more


@contextmanager
def restored(module: nn.Module) -> Iterator[None]:
    """Everything :func:`state_prints` compares is as it was afterwards: metric states, buffers (which
    tensor, and its values), attributes (which object, and the contents of containers, objects, arrays and
    generators they hold, to the same depth), registered hooks and submodules. For work that runs the
    user's ``training_step`` before training (the probe) and must change no run."""
    restorers = _restorers(module)
    try:
        yield
    finally:
        for restore in restorers:
            restore()


# ----------------------------------------------------------------------------- what is looked at


def _scanned(module: nn.Module) -> Iterator[tuple[str, nn.Module, Role]]:
    """Every submodule once, with its role: a torchmetrics ``Metric`` (its states are its whole state: its
    own submodules and caches are not looked at), a ``MetricCollection`` (its metrics are), or a module."""
    metrics: list[str] = []
    for name, sub in module.named_modules():
        if any(name.startswith(f"{m}.") for m in metrics):
            continue
        if isinstance(sub, Metric):
            metrics.append(name)
            yield name, sub, "metric"
        else:
            yield name, sub, "collection" if isinstance(sub, MetricCollection) else "module"


def _compared(attribute: str) -> bool:
    return attribute not in MODULE_BOOKKEEPING and attribute not in LIGHTNING_BOOKKEEPING


def _module_prints(name: str, sub: nn.Module, held: list[Any]) -> Iterator[tuple[Key, tuple]]:
    for buffer, tensor in sub.named_buffers(recurse=False):
        yield ("buffer", _join(name, buffer), ""), _print(tensor, 0, held)
    for attribute, value in vars(sub).items():
        if _compared(attribute):
            yield ("attribute", _join(name, attribute), ""), _print(value, DEPTH, held)
    for table, what in HOOK_TABLES.items():
        yield ("hooks", name, table), (what, len(getattr(sub, table, {})))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _is_value(value: Any) -> bool:
    return value is None or isinstance(value, numbers.Number | str | bytes | Enum | np.generic)


def _opaque(value: Any) -> bool:
    """Objects compared by identity only: submodules (compared themselves), classes, functions and methods."""
    return isinstance(value, nn.Module | type) or inspect.isroutine(value)


def _print(value: Any, depth: int, held: list[Any]) -> tuple:
    """A hashable fingerprint of ``value`` (its type's name first), containers and objects ``depth`` levels deep."""
    kind = type(value).__name__
    if _is_value(value):
        return (kind, value)
    held.append(value)
    if isinstance(value, Tensor):
        return (kind, id(value), _version(value))
    generator = _generator_io(value)
    if generator is not None:
        return (kind, id(value), _state_bytes(generator[0]()))
    if isinstance(value, np.ndarray):
        return (kind, id(value), value.shape, value.tobytes() if value.size <= MAX_ARRAY else None)
    if _opaque(value):
        return (kind, id(value))
    if isinstance(value, list | tuple | deque | dict | set | frozenset):
        if depth == 0 or len(value) > MAX_ITEMS:
            return (kind, id(value), len(value))
        return (kind, id(value), len(value), _items_print(value, depth - 1, held))
    attributes = getattr(value, "__dict__", None)
    if depth == 0 or not isinstance(attributes, dict) or len(attributes) > MAX_ITEMS:
        return (kind, id(value))
    return (kind, id(value), tuple((k, _print(v, depth - 1, held)) for k, v in attributes.items()))


def _items_print(value: Any, depth: int, held: list[Any]) -> tuple | frozenset:
    if isinstance(value, dict):
        return tuple((_print(k, 0, held), _print(v, depth, held)) for k, v in value.items())
    if isinstance(value, set | frozenset):
        return frozenset(_print(v, depth, held) for v in value)
    return tuple(_print(v, depth, held) for v in value)


def _version(tensor: Tensor) -> int | None:
    """The tensor's version counter (every in-place write bumps it); ``None`` for an inference tensor."""
    try:
        return tensor._version
    except RuntimeError:  # inference tensors keep no version counter (and cannot be written outside it)
        return None


def _generator_io(value: Any) -> tuple[Callable[[], Any], Callable[[Any], None]] | None:
    """How to read and set ``value``'s state where it is a random generator (torch's, numpy's, Python's)."""
    if isinstance(value, torch.Generator):
        return value.get_state, value.set_state
    if isinstance(value, np.random.Generator):
        bits = value.bit_generator
        return (lambda: bits.state), (lambda state: setattr(bits, "state", state))
    if isinstance(value, np.random.RandomState):
        return value.get_state, value.set_state
    if isinstance(value, random.Random):
        return value.getstate, value.setstate
    return None


def _state_bytes(state: Any) -> bytes:
    return state.numpy().tobytes() if isinstance(state, Tensor) else pickle.dumps(state)


def _same(a: tuple, b: tuple) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 (a value whose == cannot answer: call it written)
        return False


def _described(key: Key, then: tuple | None, now: tuple | None) -> str:
    kind, name, _ = key
    shown = repr(name) if name else "the module"
    type_name = (now or then)[0]
    if kind == "metric":
        verb = "creates" if then is None else "deletes" if now is None else "updates"
        return f"{verb} the torchmetrics metric {shown} ({type_name})"
    if kind == "module":
        return f"{'adds' if then is None else 'removes' if now is None else 'replaces'} the submodule {shown} ({type_name})"
    if kind == "hooks":
        count = now[1] - (then[1] if then else 0)
        verb = "registers" if count > 0 else "removes"
        return f"{verb} {abs(count)} {type_name}{'s' if abs(count) != 1 else ''} on {shown}"
    what = "buffer" if kind == "buffer" else "attribute"
    if then is None:
        return f"sets a new {what} {shown} ({type_name})"
    if now is None:
        return f"deletes the {what} {shown}"
    return f"writes the {what} {shown} ({type_name})"


# ----------------------------------------------------------------------------- putting it back


def _restorers(module: nn.Module) -> list[Callable[[], None]]:
    restorers: list[Callable[[], None]] = []
    for _, sub, role in _scanned(module):
        if role == "metric":
            restorers.append(_metric_restorer(sub))
            continue
        restorers.append(_attributes_restorer(sub))
        if role == "module":
            restorers += [_children_restorer(sub), _buffers_restorer(sub), _hooks_restorer(sub)]
    return restorers


def _metric_restorer(metric: Metric) -> Callable[[], None]:
    names = [*metric._defaults, "_update_count", "_computed", "_forward_cache"]
    state = {}
    for name in names:
        value = getattr(metric, name, None)
        state[name] = (
            value.clone() if isinstance(value, Tensor) else list(value) if isinstance(value, list) else value
        )

    def restore() -> None:
        for name, value in state.items():
            setattr(metric, name, value)

    return restore


def _children_restorer(sub: nn.Module) -> Callable[[], None]:
    children = dict(sub.named_children())

    def restore() -> None:
        now = dict(sub.named_children())
        for name in now.keys() - children.keys():
            delattr(sub, name)
        for name, child in children.items():
            if now.get(name) is not child:
                setattr(sub, name, child)

    return restore


def _buffers_restorer(sub: nn.Module) -> Callable[[], None]:
    transient = set(sub._non_persistent_buffers_set)
    buffers = dict(sub.named_buffers(recurse=False))
    values = [_tensor_restorer(t) for t in buffers.values()]

    def restore() -> None:
        now = dict(sub.named_buffers(recurse=False))
        for name in now.keys() - buffers.keys():
            delattr(sub, name)
        for name, tensor in buffers.items():
            if now.get(name) is not tensor:
                sub.register_buffer(name, tensor, persistent=name not in transient)
        for restore_values in values:
            restore_values()

    return restore


def _hooks_restorer(sub: nn.Module) -> Callable[[], None]:
    """Takes out the hooks registered meanwhile (as their handles' ``remove`` would: torch gives no other way
    to reach a hook registered without keeping its handle)."""
    tables = {table: set(getattr(sub, table, {})) for table in HOOK_TABLES}

    def restore() -> None:
        for table, ids in tables.items():
            hooks = getattr(sub, table, {})
            for hook_id in [i for i in hooks if i not in ids]:
                del hooks[hook_id]
                for extra in _HOOK_EXTRAS:
                    getattr(sub, extra, {}).pop(hook_id, None)

    return restore


_MISSING = object()


def _attributes_restorer(sub: nn.Module) -> Callable[[], None]:
    attributes = {name: value for name, value in vars(sub).items() if _compared(name)}
    contents = [_contents_restorer(value, DEPTH) for value in attributes.values()]

    def restore() -> None:
        now = vars(sub)
        for name in [n for n in now if _compared(n) and n not in attributes]:
            delattr(sub, name)
        for name, value in attributes.items():
            if now.get(name, _MISSING) is not value:
                setattr(sub, name, value)
        for restore_contents in contents:
            if restore_contents is not None:
                restore_contents()

    return restore


def _tensor_restorer(tensor: Tensor) -> Callable[[], None]:
    version = _version(tensor)
    if version is None:
        return lambda: None
    saved = tensor.detach().clone()

    def restore() -> None:
        if _version(tensor) != version:
            with torch.no_grad():
                tensor.copy_(saved)

    return restore


def _contents_restorer(value: Any, depth: int) -> Callable[[], None] | None:
    """What puts back the contents of ``value`` (the object itself stays), as deep as :func:`_print` looks;
    ``None`` where there is nothing to put back (a number, a function)."""
    if _is_value(value):
        return None
    if isinstance(value, Tensor):
        return _tensor_restorer(value)
    generator = _generator_io(value)
    if generator is not None:
        state = generator[0]()
        return lambda: generator[1](state)
    if isinstance(value, np.ndarray):
        if value.size > MAX_ARRAY or not value.flags.writeable:
            return None
        copy = value.copy()
        return lambda: np.copyto(value, copy)
    if depth == 0 or _opaque(value):
        return None
    if isinstance(value, list | tuple | deque | dict | set | frozenset):
        return _container_restorer(value, depth)
    attributes = getattr(value, "__dict__", None)
    if not isinstance(attributes, dict) or len(attributes) > MAX_ITEMS:
        return None
    return _object_restorer(value, attributes, depth)


def _container_restorer(value: Any, depth: int) -> Callable[[], None]:
    items = list(value.items()) if isinstance(value, dict) else list(value)
    inner_values = [v for _, v in items] if isinstance(value, dict) else items
    inner = [_contents_restorer(v, depth - 1) for v in inner_values] if len(items) <= MAX_ITEMS else []

    def restore() -> None:
        if isinstance(value, list | deque | dict | set) and _changed(value, items):
            value.clear()
            if isinstance(value, dict | set):
                value.update(items)
            else:
                value.extend(items)
        for restore_inner in inner:
            if restore_inner is not None:
                restore_inner()

    return restore


def _changed(value: Any, items: list[Any]) -> bool:
    """Whether a container no longer holds exactly ``items`` (the same objects, in order)."""
    now = list(value.items()) if isinstance(value, dict) else list(value)
    if len(now) != len(items):
        return True
    if isinstance(value, set):
        return value != set(items)
    pairs = zip(now, items, strict=True)
    if isinstance(value, dict):
        return any(k1 != k2 or v1 is not v2 for (k1, v1), (k2, v2) in pairs)
    return any(a is not b for a, b in pairs)


def _object_restorer(value: Any, attributes: dict[str, Any], depth: int) -> Callable[[], None]:
    saved = dict(attributes)
    inner = [_contents_restorer(v, depth - 1) for v in saved.values()]

    def restore() -> None:
        if _changed(attributes, list(saved.items())):
            attributes.clear()
            attributes.update(saved)
        for restore_inner in inner:
            if restore_inner is not None:
                restore_inner()

    return restore
