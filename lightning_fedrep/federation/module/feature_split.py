"""The model as ``head(features(x))``: found and verified on a probe input, for whatever runs the body and
the head separately (the vectorized runner caching a frozen body's output, batched evaluation, fine-tuned
evaluation, FedCP's two heads on one body output).

Declared with ``forward_features`` / ``forward_head`` (timm's names), or detected when the head is one
submodule, holding every head parameter, called once, whose output the model returns (``forward`` is
``head(body(x))``). Either is trusted only once ``head(features(x)) == module(x)`` on the probe.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fedrep.federation.module.stateless import stateless_call
from lightning_fedrep.federation.module.untouched import untouched_modes, untouched_random_state

PROBE_SAMPLES = 16
"""How many training samples :func:`probe_inputs` takes (batch norm needs more than one)."""


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
    head_module: str | None = None
    """The detected head submodule's name (``forward`` is ``head_module(body(x))``); ``None`` for a declared
    split (``forward_features``/``forward_head``)."""


def declares_split(module: nn.Module) -> bool:
    """Whether ``module`` declares its split: ``forward_features(x)`` and ``forward_head(features)``."""
    return callable(getattr(module, "forward_features", None)) and callable(
        getattr(module, "forward_head", None)
    )


def find_feature_split(module: nn.Module, head_names: tuple[str, ...], probe: Tensor) -> FeatureSplit | None:
    """Find and verify ``module(x) == head(features(x))`` on ``probe``, or ``None`` (no caching then)."""
    declared = declares_split(module)
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


def evaluation_split(module: nn.Module, head_names: tuple[str, ...], probe: Tensor) -> FeatureSplit | None:
    """The module as ``head(features(x))`` in evaluation mode, verified on ``probe``, or ``None``: what the
    batched evaluation runs, and what a callback computes a frozen body's output with once."""
    training = module.training
    module.eval()
    try:
        return find_feature_split(module, head_names, probe)
    finally:
        module.train(training)


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
    owner = head_owner(head_names)
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
        return _input_of(head, owner, lambda: run_module(tensors, x))

    def head_call(tensors: dict[str, Tensor], f: Tensor) -> Tensor:
        own = {n.removeprefix(prefix): t for n, t in tensors.items() if n.startswith(prefix)}
        return run_head(own, f)

    return FeatureSplit(
        features=features, head=head_call, how=f"head module {owner!r} called last", head_module=owner
    )


def head_owner(head_names: tuple[str, ...]) -> str:
    """The deepest submodule holding every head parameter (``"classifier"`` for ``classifier.weight`` and
    ``classifier.bias``; for a multi-layer head ``classifier.0.*``, ``classifier.2.*`` too); ``""``: none but the
    module itself."""
    paths = [n.split(".")[:-1] for n in head_names]
    common = next((i for i in range(min(map(len, paths))) if len({p[i] for p in paths}) > 1), None)
    return ".".join(paths[0][: min(map(len, paths)) if common is None else common])


def head_input(module: nn.Module, head_module: str, x: Tensor) -> Tensor:
    """The input of ``module``'s submodule ``head_module`` when the class's ``forward`` runs on ``x`` with the
    module's own tensors (the body's output, for a detected split: :attr:`FeatureSplit.head_module`); the forward
    stops there. The class's method, not ``module.forward``: an evaluation may have replaced that
    (``EvaluationSpec.forward``) by a prediction that calls this."""
    return _input_of(module.get_submodule(head_module), head_module, lambda: type(module).forward(module, x))


def _input_of(head: nn.Module, name: str, run: Callable[[], Any]) -> Tensor:
    """Run ``run`` (a forward pass reaching ``head``) up to ``head``'s call; its input."""

    def stop(_m: nn.Module, args: tuple) -> None:
        raise _Features(args[0])

    hook = head.register_forward_pre_hook(stop)
    try:
        run()
    except _Features as captured:
        return captured.value
    finally:
        hook.remove()
    raise RuntimeError(f"The forward pass never reached the head {name!r}.")


def probe_inputs(datamodule: Any, module: nn.Module, samples: int = PROBE_SAMPLES) -> Tensor | None:
    """A few training inputs to verify a split on: the first ``samples`` of the first client with training data
    of a federated data module (``num_clients``, ``client_data``, ``client_batches``), collated as its loaders
    collate them, on the module's device and, when floating, in its parameters' dtype (what a true-precision
    Trainer does to inputs). Fetched without drawing from the run's random generators. ``None`` without such
    data, or when the batches are not ``(inputs, targets)`` with tensor inputs."""
    if not all(hasattr(type(datamodule), a) for a in ("num_clients", "client_data", "client_batches")):
        return None
    clients = [c for c in range(datamodule.num_clients) if len(datamodule.client_data(c, "train"))]
    if not clients:
        return None
    count = min(len(datamodule.client_data(clients[0], "train")), samples)
    with untouched_random_state():
        batch = next(iter(datamodule.client_batches(clients[0], [torch.arange(count)])))
    if not (isinstance(batch, list | tuple) and len(batch) == 2 and isinstance(batch[0], Tensor)):
        return None
    parameter = next((p for p in module.parameters() if p.is_floating_point()), None)
    x = batch[0]
    if parameter is None:
        return x
    return x.to(parameter.device, parameter.dtype if x.is_floating_point() else x.dtype)


def find_feature_split_on_data(
    module: nn.Module, head_names: tuple[str, ...], datamodule: Any
) -> FeatureSplit | None:
    """:func:`find_feature_split` verified on :func:`probe_inputs` of ``datamodule``, in evaluation mode (the
    split's structure, not dropout's draws, is checked; every submodule's mode and the run's random generators are
    as they were afterwards); without such inputs, the module's declared split, unverified (``None`` if it
    declares none): for set-up code that runs the body and the head separately (FedCP)."""
    probe = probe_inputs(datamodule, module)
    if probe is None:
        return _declared_split(module) if declares_split(module) else None
    with untouched_modes(module), untouched_random_state():
        module.eval()
        return find_feature_split(module, head_names, probe)


def require_feature_split(
    module: nn.Module, head_names: tuple[str, ...], datamodule: Any, owner: str
) -> FeatureSplit:
    """:func:`find_feature_split_on_data`, or a ``ValueError`` naming ``owner`` (an algorithm that runs the body and
    the head separately) and how to declare the split: for its ``setup``."""
    found = find_feature_split_on_data(module, tuple(head_names), datamodule)
    if found is None:
        raise ValueError(
            f"{owner} needs the module as head(features(x)), but {type(module).__name__}'s forward is not its "
            f"head {head_owner(tuple(head_names)) or list(head_names)!r} applied last to the body's output, nor "
            "forward_head(forward_features(x)): define forward_features(x) and forward_head(features) with "
            "forward(x) == forward_head(forward_features(x)), or make forward return head(body(x))."
        )
    return found


def module_features(module: nn.Module, head_module: str, x: Tensor, owner: str) -> Tensor:
    """``features(x)`` of a live module: its declared ``forward_features``, else the input of its head submodule
    ``head_module`` (:attr:`FeatureSplit.head_module`, ``""`` until ``owner``'s set-up has found it): for a
    prediction (``EvaluationSpec.forward``) that reads the features."""
    if declares_split(module):
        return module.forward_features(x)
    if not head_module:
        raise RuntimeError(f"{owner} needs setup() to have found the module's head.")
    return head_input(module, head_module, x)


def module_head(module: nn.Module, head_module: str, features: Tensor) -> Tensor:
    """The live module's head on ``features``: its declared ``forward_head``, else its submodule ``head_module``."""
    if declares_split(module):
        return module.forward_head(features)
    return module.get_submodule(head_module)(features)
