"""What the vectorized engine needs to know about a module: its pure loss and its body/head split.

The user's ``training_step`` is opaque, so the engine runs only on a module that *declares* the loss
its ``training_step`` computes (``fedrep_loss``). To cache the frozen body's output it also needs the
model as ``head(features(x))``: declared with ``forward_features`` / ``forward_head`` (timm's names),
or detected when the head submodule is called last and its output is the model's output. Both are
checked on a probe batch before they are trusted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_fedrep.losses import (  # noqa: F401 (re-exported: the engine's old import path)
    NAMED_LOSSES,
    LossFn,
    cross_entropy_per_sample,
    declared_loss,
    mse_per_sample,
)
from lightning_fedrep.stateless import stateless_call


class _Features(Exception):
    """Raised by a forward pre-hook to stop the forward pass at the head's input."""

    def __init__(self, value: Tensor):
        self.value = value


class _MethodAsForward(nn.Module):
    """Calls ``module.<method>`` as ``forward``, so ``torch.func.functional_call`` can bind its tensors."""

    def __init__(self, module: nn.Module, method: str):
        super().__init__()
        self.module = module
        self.method = method

    def forward(self, *args: Tensor) -> Tensor:
        return getattr(self.module, self.method)(*args)


@dataclass
class FeatureSplit:
    """The model as ``head(features(x))``, each callable with any tensors (``{full name: tensor}``):
    the engine computes a client's features once with its frozen body, then trains its head on them."""

    features: Callable[[dict[str, Tensor], Tensor], Tensor]
    head: Callable[[dict[str, Tensor], Tensor], Tensor]
    how: str
    head_reads: frozenset[str] | None = None
    """The only tensors ``head`` reads (verified on the probe: :func:`find_feature_split`), so a cached head
    step may hand it just these; ``None``: it may read any."""


def find_feature_split(module: nn.Module, head_names: tuple[str, ...], probe: Tensor) -> FeatureSplit | None:
    """Find and verify ``module(x) == head(features(x))`` on ``probe``, or ``None`` (no caching then)."""
    declared = callable(getattr(module, "forward_features", None)) and callable(
        getattr(module, "forward_head", None)
    )
    tensors = {**dict(module.named_buffers()), **dict(module.named_parameters())}
    with torch.no_grad():
        expected = module(probe)
        if not isinstance(expected, Tensor):  # a tuple or dict: the engine's loss needs the output tensor
            return None
        split = (
            _declared_split(module)
            if declared
            else _detect_last_head_module(module, head_names, probe, expected)
        )
        if split is None:
            return None
        features = split.features(tensors, probe)
        if declared and _features_read(split, tensors, head_names, probe, features):
            return None
        got = split.head(tensors, features)
        if not same_tensor(got, expected):
            return None
        others = tuple(n for n in tensors if n not in head_names)
        if not _reads(split.head, tensors, others, features, got):
            split.head_reads = frozenset(head_names) | {
                n for n, t in tensors.items() if not t.is_floating_point()
            }
    return split


def _reads(
    fn: Callable[[dict[str, Tensor], Tensor], Tensor],
    tensors: dict[str, Tensor],
    names: tuple[str, ...],
    x: Tensor,
    output: Tensor,
) -> bool:
    """Whether ``fn(tensors, x)`` (which gave ``output``) reads any floating-point tensor among ``names``:
    shifting them all changes its output."""
    shifted = {**tensors, **{n: tensors[n] + 1.0 for n in names if tensors[n].is_floating_point()}}
    return not same_tensor(fn(shifted, x), output)


def _features_read(
    split: FeatureSplit,
    tensors: dict[str, Tensor],
    head_names: tuple[str, ...],
    probe: Tensor,
    features: Tensor,
) -> bool:
    """Whether the declared ``forward_features`` reads any of ``head_names`` (then they are not the head of this
    split: LG-FedAvg's local part is the body)."""
    return _reads(split.features, tensors, head_names, probe, features)


def same_tensor(a: object, b: object) -> bool:
    """``a`` and ``b`` are tensors of one shape with equal values, NaN equal to NaN (data holding NaN is
    no reason to think two computations differ)."""
    if not (isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape):
        return False
    return torch.equal(a, b) or torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True)


def _declared_split(module: nn.Module) -> FeatureSplit:
    features, head = _MethodAsForward(module, "forward_features"), _MethodAsForward(module, "forward_head")

    def call(wrapper: nn.Module) -> Callable[[dict[str, Tensor], Tensor], Tensor]:
        run = stateless_call(wrapper)
        return lambda tensors, x: run({"module." + n: t for n, t in tensors.items()}, x)

    return FeatureSplit(features=call(features), head=call(head), how="forward_features/forward_head")


def _detect_last_head_module(
    module: nn.Module, head_names: tuple[str, ...], probe: Tensor, expected: Tensor
) -> FeatureSplit | None:
    """The head is one submodule, holding every head parameter, called once, whose output the model returns."""
    # the deepest module holding every head parameter (a multi-layer head: ``classifier.0``, ``classifier.2``)
    paths = [n.split(".")[:-1] for n in head_names]
    common = next((i for i in range(min(map(len, paths))) if len({p[i] for p in paths}) > 1), None)
    owner = ".".join(paths[0][: min(map(len, paths)) if common is None else common])
    if not owner:
        return None
    head = module.get_submodule(owner)
    if {f"{owner}.{n}" for n, _ in head.named_parameters()} != set(head_names):
        return None
    outputs: list[Tensor] = []
    handle = head.register_forward_hook(lambda _m, _a, out: outputs.append(out))
    try:
        module(probe)
    finally:
        handle.remove()
    if len(outputs) != 1 or outputs[0] is not expected and not same_tensor(outputs[0], expected):
        return None
    prefix = owner + "."
    run_module, run_head = stateless_call(module), stateless_call(head)

    def features(tensors: dict[str, Tensor], x: Tensor) -> Tensor:
        def stop(_m: nn.Module, args: tuple) -> None:
            raise _Features(args[0])

        hook = head.register_forward_pre_hook(stop)
        try:
            run_module(tensors, x)
        except _Features as captured:
            return captured.value
        finally:
            hook.remove()
        raise RuntimeError(f"The forward pass never reached the head {owner!r}.")

    def head_call(tensors: dict[str, Tensor], f: Tensor) -> Tensor:
        own = {n.removeprefix(prefix): t for n, t in tensors.items() if n.startswith(prefix)}
        return run_head(own, f)

    return FeatureSplit(features=features, head=head_call, how=f"head module {owner!r} called last")
