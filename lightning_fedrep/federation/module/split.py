"""Which parameters of a module are the shared body and which are the per-client head.

The split is resolved once, from parameter *names*, when the strategy connects to the module
(``Strategy.connect``), and validated before training starts. It never holds tensors, so it is
cheap to recompute and safe to keep across device moves.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from torch import nn, optim

HeadSpec = str | Sequence[str] | re.Pattern | None

MODULE_HEAD_ATTRIBUTE = "fedrep_head"
"""Name of the attribute a ``LightningModule`` may set to mark its own head, e.g. ``fedrep_head = "fc3"``."""


class SplitError(ValueError):
    """The body/head marking does not describe the module's parameters."""


@dataclass(frozen=True)
class ParameterSplit:
    """Parameter names of the head (per client) and of the body (shared), in module order.

    ``frozen`` lists parameters that had ``requires_grad=False`` when the split was resolved; they
    belong to neither group, are never trained, averaged or stored per client.
    """

    head: tuple[str, ...]
    body: tuple[str, ...]
    frozen: tuple[str, ...] = ()

    def group(self, name: str) -> str:
        """Return ``"head"``, ``"body"`` or ``"frozen"`` for a parameter name."""
        if name in self.head:
            return "head"
        if name in self.body:
            return "body"
        return "frozen"


def _spec_from_module(module: nn.Module) -> HeadSpec:
    return getattr(module, MODULE_HEAD_ATTRIBUTE, None)


def _module_names(module: nn.Module) -> list[str]:
    """Names of the submodules that hold parameters (those a head entry can name)."""
    return [name for name, m in module.named_modules() if name and any(True for _ in m.parameters())]


def _matches_prefix(param_name: str, prefix: str) -> bool:
    return param_name == prefix or param_name.startswith(prefix + ".")


def _last_linear(module: nn.Module) -> str | None:
    last = None
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Linear) and name:
            last = name
    return last


def _describe(module: nn.Module) -> str:
    names = [name for name, _ in module.named_parameters()]
    shown = ", ".join(names[:40]) + (" ..." if len(names) > 40 else "")
    return f"the module's parameters are: {shown}"


def resolve_split(module: nn.Module, head: HeadSpec = None, *, allow_frozen: bool = False) -> ParameterSplit:
    """Resolve ``head`` against ``module`` and check the result; called by the strategy at ``connect``.

    ``head`` may be a module name or parameter-name prefix (``"classifier"`` marks
    ``classifier.weight`` and ``classifier.bias``), a list of them, or a compiled regular
    expression matched (``re.search``) against full parameter names. When it is ``None`` the module's
    own ``fedrep_head`` attribute is used. Everything trainable that is not head is body.

    Raises:
        SplitError: nothing is marked, a name matches no parameter (with the closest real name),
            the head or the body is empty, or parameters are frozen while ``allow_frozen`` is off.
    """
    spec = head if head is not None else _spec_from_module(module)
    if spec is None:
        suggestion = _last_linear(module)
        hint = f" (the last nn.Linear is {suggestion!r}: head={suggestion!r})" if suggestion else ""
        raise SplitError(
            "No head is marked. Pass head=<module name, list of names or re.compile(regex)> to the strategy"
            f'{hint}, or set the class attribute `{MODULE_HEAD_ATTRIBUTE} = "<module name>"` on your '
            f"LightningModule; {_describe(module)}."
        )

    named = list(module.named_parameters())
    if isinstance(spec, re.Pattern):
        head_names = [n for n, _ in named if spec.search(n)]
        if not head_names:
            raise SplitError(f"The head regex {spec.pattern!r} matches no parameter; {_describe(module)}.")
    else:
        prefixes = [spec] if isinstance(spec, str) else list(spec)
        if not prefixes or not all(isinstance(p, str) and p for p in prefixes):
            raise SplitError(f"head must be a non-empty name or list of non-empty names, got {spec!r}.")
        head_names = []
        for prefix in prefixes:
            matched = [n for n, _ in named if _matches_prefix(n, prefix)]
            if not matched:
                candidates = [n for n in _module_names(module) if n != prefix] + [n for n, _ in named]
                close = difflib.get_close_matches(prefix, candidates, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                modules = dict(module.named_modules())
                what = (
                    f"is a {type(modules[prefix]).__name__} without parameters"
                    if prefix in modules
                    else "matches no parameter"
                )
                raise SplitError(f"head entry {prefix!r} {what}.{hint} {_describe(module)}.")
            head_names.extend(n for n in matched if n not in head_names)

    frozen = [n for n, p in named if not p.requires_grad]
    frozen_head = [n for n in head_names if n in frozen]
    if frozen_head:
        raise SplitError(
            f"Head parameters {frozen_head} have requires_grad=False, so the head could never train. "
            "Unfreeze them, or leave them out of the head."
        )
    if frozen and not allow_frozen:
        raise SplitError(
            f"Parameters {frozen} have requires_grad=False. The strategy decides what trains in each "
            "phase, so frozen parameters would be neither trained, shared nor personalized. Unfreeze "
            "them, or pass allow_frozen=True to keep them fixed at their initial values."
        )
    head_set = set(head_names)
    ordered_head = tuple(n for n, _ in named if n in head_set)
    body = tuple(n for n, p in named if p.requires_grad and n not in head_set)
    if not body:
        raise SplitError(
            f"The head {list(ordered_head)} covers every trainable parameter, so there is no body to "
            f"share. Mark only the last layer(s) as head; {_describe(module)}."
        )
    return ParameterSplit(head=ordered_head, body=body, frozen=tuple(frozen))


def split_without_head(module: nn.Module, *, allow_frozen: bool = False) -> ParameterSplit:
    """The split of an algorithm that never needs the head (FedAvg, Local Only): everything is body."""
    named = list(module.named_parameters())
    frozen = tuple(n for n, p in named if not p.requires_grad)
    if frozen and not allow_frozen:
        raise SplitError(
            f"Parameters {list(frozen)} have requires_grad=False; unfreeze them or pass allow_frozen=True."
        )
    return ParameterSplit(head=(), body=tuple(n for n, p in named if p.requires_grad), frozen=frozen)


def check_optimizers_cover_split(
    optimizers: Sequence[optim.Optimizer], module: nn.Module, split: ParameterSplit
) -> None:
    """Every head and body parameter must be in an optimizer, or it would never train."""
    in_optimizer = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
    named = dict(module.named_parameters())
    missing = [n for n in split.head + split.body if id(named[n]) not in in_optimizer]
    if missing:
        raise ValueError(
            f"Parameters {missing} are in no optimizer returned by configure_optimizers, so they would never "
            "train. Pass self.parameters() to the optimizer (the strategy freezes what each phase must not train)."
        )


@dataclass(frozen=True)
class TensorLayout:
    """Which named tensors of the module the server shares and which each client keeps.

    ``shared`` are averaged by the server (the split groups the algorithm shares, plus buffers when
    they follow a shared body); ``local`` are stored per client. Frozen parameters are in neither.
    """

    split: ParameterSplit
    shared: tuple[str, ...]
    local: tuple[str, ...]


def resolve_layout(
    module: nn.Module,
    head: HeadSpec,
    *,
    shares: frozenset[str],
    needs_head: bool,
    buffers: str = "shared",
    allow_frozen: bool = False,
    keep_local: Collection[str] = (),
    owner: str = "the algorithm",
) -> TensorLayout:
    """Resolve the split and the shared/local tensor names for an algorithm sharing ``shares``.

    The head must be marked when ``needs_head`` (the algorithm shares one group only, or a phase
    trains only one) or when the user marked one anyway; otherwise everything trainable is body.
    Buffers follow the body (shared when the body is) unless ``buffers="local"``. ``keep_local`` names
    tensors (parameters or buffers) that stay local whatever ``shares`` and ``buffers`` say (what
    ``Algorithm.keep_local`` returns: FedBN's BatchNorm layers); ``owner`` names it in errors.
    """
    marked = head is not None or _spec_from_module(module) is not None
    if needs_head or marked:
        split = resolve_split(module, head, allow_frozen=allow_frozen)
    else:
        split = split_without_head(module, allow_frozen=allow_frozen)
    names = [n for n, _ in module.named_parameters()]
    shared = [n for n in names if split.group(n) in shares]
    local = [n for n in names if split.group(n) in ("body", "head") and n not in shared]
    state_names = module.state_dict().keys()
    buffer_names = [n for n, _ in module.named_buffers() if n in state_names]
    (shared if buffers == "shared" and "body" in shares else local).extend(buffer_names)
    kept = _kept_local(keep_local, split, names, buffer_names, owner)
    local = [n for n in [*names, *buffer_names] if n in kept or n in local]
    return TensorLayout(split, tuple(n for n in shared if n not in kept), tuple(local))


def _kept_local(
    keep_local: Collection[str], split: ParameterSplit, names: list[str], buffer_names: list[str], owner: str
) -> set[str]:
    """``keep_local`` as a set, checked: each a trainable parameter or a buffer of the module."""
    if isinstance(keep_local, str) or not isinstance(keep_local, Collection):
        raise TypeError(f"{owner}.keep_local must return a collection of tensor names, got {keep_local!r}.")
    kept = set(keep_local)
    unknown = sorted(kept - set(names) - set(buffer_names))
    frozen = sorted(kept & set(split.frozen))
    if unknown or frozen:
        what = (
            f"{unknown[:4]} which are no parameter or buffer of the module"
            if unknown
            else f"{frozen[:4]} which are frozen (never trained, nothing to keep)"
        )
        raise ValueError(
            f"{owner}.keep_local named {what}; return names among the module's parameters and buffers "
            f"(named_parameters(), named_buffers()), e.g. {(names + buffer_names)[:3]}."
        )
    return kept
