"""The probe: the module's own ``training_step`` against its declared loss, on real training batches.

The engine never runs ``training_step``; it trains ``mean(fedrep_loss(module(x), y))``. Before it is
trusted, :func:`probe_problem` runs both on a few real batches (as Lightning would hand them to the
step: on the device, in the trainer's precision) and says why they differ, if they do:

- the batch is not ``(inputs, targets)`` tensors (a dict batch), or ``forward`` returns no tensor;
- the declared loss does not give one loss per sample of the batch (``fedrep_loss="mse"`` on integer
  labels against a vector of logits: the shapes differ);
- ``forward`` is random beyond the random layers already refused (two seeds, two outputs further apart
  than float error: kernels that are not deterministic, GPU atomics, differ only in the last bits); under
  ``randomness="per_client"`` random operations are welcome (each client draws its own), but only from torch's
  generator: two forwards under one seed must agree (a draw from numpy's or Python's generator would give
  every client of a lockstep step the same numbers);
- ``training_step``'s loss is not the declared loss's mean (an extra term, label smoothing, ...);
- ``training_step`` logs something the engine would not (it logs only ``train/loss``, the clients'
  mean loss), since those ``self.log`` calls would vanish on the engine;
- ``training_step`` writes into the module besides its loss (updates a torchmetrics metric, counts in an
  attribute, writes a buffer, appends to a list, registers a hook: :mod:`.side_effects` says what is
  compared), since those writes would happen on the probe batches only.

:func:`vectorize_problem` then runs what the engine runs instead of the step, once per phase kind of the
round: ``torch.func.vmap`` of the declared loss over two clients' copies of the module's tensors and its
gradient, on one probe batch; an operation ``vmap`` cannot batch (``nn.LSTM``: ``aten::lstm`` has no
batching rule) is a reason, not a crash in the first round.

Both sides run in train mode under ``torch.no_grad`` with the same random seed (``fork_rng``: the run's
own random streams are untouched), so a ``training_step`` that draws random numbers the model's forward
does not (noise on the inputs) differs, while one whose forward draws them identically matches.
``self.log`` is captured (nothing reaches Lightning) and the module's state is put back afterwards
(:func:`~.side_effects.restored`: metric states, buffers, attributes, hooks), so probing changes no run;
state outside the module (a global, a callback's attribute) is neither compared nor put back.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fedrep.federation.module.batches import batch_problem
from lightning_fedrep.federation.module.feature_split import FeatureSplit
from lightning_fedrep.federation.module.losses import LossFn, mse_per_sample
from lightning_fedrep.federation.module.untouched import untouched_modes, untouched_random_state
from lightning_fedrep.runners.lockstep.randomness import vmap_randomness
from lightning_fedrep.runners.lockstep.side_effects import (
    named_side_effects,
    restored,
    side_effects,
    state_prints,
)
from lightning_fedrep.runners.settings import Randomness

ENGINE_LOG = "train/loss"
"""The one metric the engine logs from its steps (the mean loss of the clients that stepped)."""

SIDE_EFFECTS = "training_step has side effects"
"""How a reason about what ``training_step`` writes besides its loss starts (:mod:`.side_effects`)."""

PER_CLIENT_RANDOM = "randomness='per_client' lets the vectorized runner draw each client's own"
"""How the exact contract's refusal of a random forward names the fix."""

PROBE_SEED = 20_231
"""The seed both sides of the comparison run under (and, plus one, the second forward's)."""

RTOL, ATOL = 1e-5, 1e-6
"""How close ``training_step``'s loss and the declared loss's mean must be (float error only)."""


def probe_problem(
    module: nn.Module,
    loss_fn: LossFn,
    loss_name: str,
    batches: Sequence[tuple[Any, int, str]],
    randomness: Randomness = "exact",
) -> str | None:
    """Why the engine would not train what ``module.training_step`` trains on ``batches`` (each
    ``(batch, batch_idx, where)``, the batch as the step would get it), or ``None``; ``randomness``: the
    strategy's contract (``"per_client"`` takes a forward that draws from torch's generator)."""
    with untouched_modes(module):
        module.train()
        for batch, batch_idx, where in batches:
            problem = batch_problem(batch, where) or _step_problem(
                module, loss_fn, loss_name, batch, batch_idx, where, randomness
            )
            if problem is not None:
                return problem
    return None


PROBE_CLIENTS = 2
"""Clients the vmap probe stacks (copies of the module's tensors): enough to batch every operation."""

CANNOT_VECTORIZE = "cannot vectorize"
"""How a reason from :func:`vectorize_problem` starts."""

Forward = Callable[[dict[str, Tensor], Tensor], Tensor]
"""The module as a pure function of its tensors (``{full name: tensor}``) and an input batch."""


def vectorize_problem(
    module: nn.Module,
    loss_fn: LossFn,
    batch: tuple[Tensor, Tensor],
    parts: Mapping[str, Collection[str]],
    stacked: Collection[str],
    forward: Forward | None = None,
    cached: FeatureSplit | None = None,
    randomness: Randomness = "exact",
) -> str | None:
    """Why ``torch.func.vmap`` cannot run the engine's step on ``module``, or ``None``.

    For each phase kind in ``parts`` (``"head"``, ``"body"``, ``"all"``: the names it trains), the mean
    of ``loss_fn`` on ``batch`` is vmapped over :data:`PROBE_CLIENTS` copies of the ``stacked`` tensors
    (each client's own, as in a lockstep group; the other tensors are shared) and differentiated with
    respect to the trained ones, as a lockstep step does. ``forward`` runs the module (default:
    ``functional_call``); where ``cached`` is given the head phase runs ``cached.head`` on
    ``cached.features`` computed outside the vmap, as on cached features. The exception's first line is
    the reason (``cannot vectorize: Batching rule not implemented for aten::lstm.input ...``), with the
    submodule it came from. Leaves no trace: the module's tensors are copied, every submodule keeps its
    mode, and the random generators are restored. Under ``randomness="per_client"`` the ``vmap`` draws each
    client's own random numbers, as the engine's does.
    """
    x, y = batch
    forward = forward or (lambda tensors, inputs: torch.func.functional_call(module, tensors, (inputs,)))
    devices = [x.device] if x.device.type == "cuda" else []
    named = {**dict(module.named_buffers()), **dict(module.named_parameters())}
    with untouched_modes(module), untouched_random_state(), torch.random.fork_rng(devices=devices):
        module.train()
        for part, trained in parts.items():
            on_features = cached is not None and part == "head"
            problem = _vmap_problem(
                module,
                (cached.head if on_features else forward),
                loss_fn,
                _features(cached, named, x) if on_features else x,
                y,
                named,
                stacked,
                trained,
                vmap_randomness(randomness),
            )
            if problem is not None:
                return f"{problem}, {part} phase{' on cached features' if on_features else ''})"
    return None


def _copies(t: Tensor, k: int, trained: bool) -> Tensor:
    """``k`` stacked copies of ``t``, a leaf that requires grad where ``trained``."""
    copies = t.detach().unsqueeze(0).expand(k, *t.shape).clone()
    return copies.requires_grad_(trained and t.is_floating_point())


def _features(split: FeatureSplit, named: dict[str, Tensor], x: Tensor) -> Tensor:
    with torch.no_grad():
        return split.features({n: t.detach() for n, t in named.items()}, x)


def _vmap_problem(
    module: nn.Module,
    forward: Forward,
    loss_fn: LossFn,
    x: Tensor,
    y: Tensor,
    named: dict[str, Tensor],
    stacked: Collection[str],
    trained: Collection[str],
    randomness: str,
) -> str | None:
    """One vmapped loss and its gradient (``randomness``: ``vmap``'s); the reason without its closing
    parenthesis, or ``None``."""
    k = PROBE_CLIENTS
    own = {n: _copies(t, k, n in trained) for n, t in named.items() if n in stacked}
    shared = {n: t.detach().clone() for n, t in named.items() if n not in stacked}

    def client_loss(tensors: dict[str, Tensor], inputs: Tensor, targets: Tensor) -> Tensor:
        return loss_fn(forward({**shared, **tensors}, inputs), targets).mean()

    def stack(t: Tensor) -> Tensor:
        return t.unsqueeze(0).expand(k, *t.shape)

    stage = "loss"
    with _open_submodules(module) as entered, torch.enable_grad():
        try:
            losses = torch.func.vmap(client_loss, randomness=randomness)(own, stack(x), stack(y))
            stage = "gradient"
            leaves = [t for t in own.values() if t.requires_grad]
            if leaves and losses.requires_grad:
                torch.autograd.grad(losses.sum(), leaves, allow_unused=True)
        except Exception as error:  # noqa: BLE001 (any error under vmap is why the engine cannot run)
            first = next(iter(str(error).strip().splitlines()), "") or type(error).__name__
            where = f"{type(module).__name__}'s {stage}"
            if entered:
                sub = module.get_submodule(entered[-1])
                where = f"{where}, in {entered[-1]!r} ({type(sub).__name__})"
            return f"{CANNOT_VECTORIZE}: {first} (torch.func.vmap of {where}"
    return None


def loss_label(loss: Any) -> str:
    """How a message names the declared loss: ``fedrep_loss='cross_entropy'`` or the callable's name."""
    return (
        f"fedrep_loss={loss!r}" if isinstance(loss, str) else f"fedrep_loss={getattr(loss, '__name__', loss)}"
    )


def _step_problem(
    module: nn.Module,
    loss_fn: LossFn,
    loss_name: str,
    batch: Any,
    batch_idx: int,
    where: str,
    randomness: Randomness = "exact",
) -> str | None:
    x, y = batch
    with torch.no_grad(), restored(module):
        output = _seeded(lambda: module(x), x.device)
        if not isinstance(output, Tensor):
            return (
                f"the module's forward returns a {type(output).__name__}, not a tensor (the engine's loss "
                "takes forward's output)"
            )
        per_sample = _declared_losses(loss_fn, loss_name, output, y, where)
        if isinstance(per_sample, str):
            return per_sample
        if randomness == "per_client":  # random ops welcome, drawn from torch's generator only
            again = _seeded(lambda: module(x), x.device)
            if not _same_output(output, again):
                return (
                    "the module's forward is random outside torch's generator (two forwards under one seed "
                    "differ: numpy's or Python's generator, or state that changes between calls), so "
                    "randomness='per_client' cannot give each client its own draws"
                )
        else:
            again = _seeded(lambda: module(x), x.device, PROBE_SEED + 1)
            if not _same_output(output, again):
                return (
                    "the module's forward is random (it differs between two seeds: a random op inside forward; "
                    f"{PER_CLIENT_RANDOM})"
                )
        declared = per_sample.mean()
        with _captured_logs(module) as logged:
            before = state_prints(module)
            try:
                returned = _seeded(lambda: module.training_step(batch, batch_idx), x.device)
            except Exception as error:  # noqa: BLE001 (outside Lightning's loop: the sequential path decides)
                return f"training_step raised {type(error).__name__} on the probe ({where}): {error}"
            written = side_effects(before, state_prints(module))
    loss = _step_loss(returned)
    if isinstance(loss, str):
        return f"training_step {loss} ({where})"
    if not _close(loss, declared):
        return (
            f"training_step's loss {loss.item():.6g} differs from the declared {loss_name} "
            f"{declared.item():.6g} ({where}): the engine would train the declared loss"
        )
    problems = [_logs_problem(logged, loss), _side_effects_problem(written, where)]
    return "; ".join(p for p in problems if p is not None) or None


def _side_effects_problem(written: list[str], where: str) -> str | None:
    """What ``training_step`` wrote into the module (:func:`side_effects`): the engine runs no step, so those
    writes would happen on the probe batches only (a metric would count two batches, a counter two steps)."""
    if not written:
        return None
    return (
        f"{SIDE_EFFECTS}: it {named_side_effects(written)} ({where}); the engine runs no training_step, so "
        "they would happen on its probe batches only"
    )


def _declared_losses(loss_fn: LossFn, loss_name: str, output: Tensor, y: Tensor, where: str) -> Tensor | str:
    """The declared loss per sample, or why it is not one loss per sample; ``"mse"`` also needs targets
    shaped like the outputs (else it broadcasts every output toward the target: logits toward a label)."""
    batch = output.shape[0]
    if loss_fn is mse_per_sample and output[0].numel() != y[0].numel():
        return (
            f"{loss_name} compares outputs of shape {tuple(output.shape)} with targets of shape "
            f"{tuple(y.shape)} ({where}): give targets shaped like the outputs (one-hot or real values), or "
            "declare the loss training_step computes"
        )
    try:
        per_sample = loss_fn(output, y)
    except Exception as error:  # noqa: BLE001 (the user's loss on the user's batch: any error is the reason)
        return f"{loss_name} fails on the probe batch ({where}): {type(error).__name__}: {error}"
    if not isinstance(per_sample, Tensor) or tuple(per_sample.shape) != (batch,):
        got = tuple(per_sample.shape) if isinstance(per_sample, Tensor) else type(per_sample).__name__
        return f"{loss_name} gives {got} on a batch of {batch} ({where}), not one loss per sample ({batch},)"
    return per_sample


def _step_loss(returned: Any) -> Tensor | str:
    """The loss ``training_step`` returned (a tensor or a dict's ``"loss"``), or what is wrong with it."""
    loss = returned.get("loss") if isinstance(returned, Mapping) else returned
    if not isinstance(loss, Tensor):
        return f"returns {type(returned).__name__}, not a loss tensor (None skips the step)"
    if loss.numel() != 1:
        return f"returns a loss of shape {tuple(loss.shape)}, not a scalar"
    return loss.reshape(())


def _logs_problem(logged: dict[str, Any], loss: Tensor) -> str | None:
    """The engine logs only ``train/loss`` (the clients' mean loss): any other metric would vanish."""
    others = sorted(name for name in logged if name != ENGINE_LOG)
    if others:
        return (
            f"training_step logs {', '.join(map(repr, others))}, which the engine would not log (it runs no "
            f"training_step; it logs only {ENGINE_LOG!r}, the clients' mean loss)"
        )
    value = logged.get(ENGINE_LOG)
    if value is not None and not _close(torch.as_tensor(value, device=loss.device), loss):
        return (
            f"training_step logs {ENGINE_LOG!r} as something other than its loss (the engine logs its loss)"
        )
    return None


def _same_output(a: Tensor, b: Tensor) -> bool:
    """Two forwards of one input agree up to float error (NaN equal to NaN): kernels that are not
    deterministic (GPU atomics) differ in the last bits between calls, a random op by far more. The
    tolerance is :data:`RTOL`/:data:`ATOL`, at least a few units in the last place of a low precision."""
    if not isinstance(b, Tensor) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    ulps = 8 * torch.finfo(a.dtype).eps
    return torch.allclose(a, b, rtol=max(RTOL, ulps), atol=max(ATOL, ulps), equal_nan=True)


def _close(a: Tensor, b: Tensor) -> bool:
    a, b = a.detach().double().reshape(()), b.detach().double().reshape(())
    return bool(torch.isclose(a, b, rtol=RTOL, atol=ATOL, equal_nan=True))


def _seeded(call: Callable[[], Any], device: torch.device, seed: int = PROBE_SEED) -> Any:
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return call()


@contextmanager
def _open_submodules(module: nn.Module) -> Iterator[list[str]]:
    """The names of the submodules whose forward has started and not returned, innermost last (after an
    exception: where it was raised)."""
    entered: list[str] = []

    def leave(_module: nn.Module, _args: Any, _output: Any) -> None:  # returns None: the output stays
        entered.pop()

    handles = []
    for name, sub in module.named_modules():
        if name:
            handles.append(sub.register_forward_pre_hook(lambda _m, _a, name=name: entered.append(name)))
            handles.append(sub.register_forward_hook(leave))
    try:
        yield entered
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _captured_logs(module: nn.Module) -> Iterator[dict[str, Any]]:
    """``module.log`` (and so ``log_dict``) records into a dict instead of reaching Lightning."""
    logged: dict[str, Any] = {}

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        logged[name] = value

    module.log = log
    try:
        yield logged
    finally:
        del module.log
