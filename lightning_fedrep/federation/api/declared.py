"""The state an algorithm declares beyond the module's own tensors: extra per-client tensors
(:class:`ClientTensors`, e.g. SCAFFOLD's control variate ``c_i``, Ditto's personal model) and server tensors
(:class:`ServerTensors`, e.g. SCAFFOLD's ``c`` or a server momentum), given as the class attributes
``Algorithm.client_tensors`` / ``Algorithm.server_tensors``.

The federation keeps the client tensors in the client store (stacked like the local part, a template for
clients that never trained) and the server tensors in its state; both are checkpointed (version 3), rolled
back with an interrupted round, and lent/gathered between processes with the client's record. No Lightning
here (the core).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = ["ClientTensors", "ServerTensors", "declared_names", "declared_templates"]

Init = Literal["zeros", "module"] | Callable[[str, Tensor, torch.Generator], Tensor]
"""``"zeros"``, the module's values at fit start (only with ``like``), or a callable
``init(name, template, generator) -> Tensor`` (see :class:`ClientTensors`)."""
Shapes = Mapping[str, tuple[int, ...]] | tuple[int, ...]
ShapesOf = Callable[[Mapping[str, Mapping[str, tuple[int, ...]]]], Shapes]
"""``shapes(groups) -> shapes``: ``groups`` maps each group (``"shared"``, ``"local"``, ``"model"``, ``"body"``,
``"head"``) to its tensors' shapes by name."""


@dataclass(frozen=True)
class ClientTensors:
    """Extra per-client tensors, shaped like a group's tensors (``like``) or given explicitly (``shapes``).

    ``like`` is ``"shared"`` (the tensors the server aggregates), ``"local"`` (those each client keeps),
    ``"model"`` (both: a per-client slot a ``Phase(slot=name)`` can train, Ditto's ``"personal"``),
    ``"body"`` or ``"head"``: one tensor ``"<name>.<tensor name>"`` per tensor of it. ``shapes`` is a
    tuple (one tensor named ``name``) or a mapping ``key -> shape`` (tensors ``"<name>.<key>"``), or a
    callable ``shapes(groups)`` returning one of those from the groups' shapes (FedCP's policy network,
    sized by the head's input).

    ``init``: ``"zeros"``, ``"module"`` (a copy of the ``like`` tensor at fit start), or a callable
    ``init(name, template, generator) -> Tensor`` run once per tensor when the federation first snapshots
    its state (fit start, after Lightning's seeding; a resumed run loads the checkpoint instead):
    ``template`` is the tensor's zeros (the ``like`` tensor's values with ``like=``), ``generator`` a CPU
    ``torch.Generator`` seeded from the strategy's ``seed`` and ``name``, so every process and every run with
    the same seed draws the same values (a random initialization, FedCP's ``nn.Linear``-like policy network).
    """

    name: str
    like: str | None = None
    shapes: Shapes | ShapesOf | None = None
    init: Init = "zeros"
    dtype: torch.dtype | None = None
    """``None``: the dtype of the ``like`` tensors (float32 for ``shapes``)."""


@dataclass(frozen=True)
class ServerTensors(ClientTensors):
    """Extra server tensors (SCAFFOLD's ``c``, server momentum), held identically on every process."""


def _names(spec: ClientTensors, groups: Mapping[str, Mapping[str, Tensor]]) -> dict[str, Tensor | tuple]:
    if (spec.like is None) == (spec.shapes is None):
        raise ValueError(f"{type(spec).__name__} {spec.name!r}: give exactly one of like= or shapes=.")
    if spec.like is not None:
        if spec.like not in groups:
            raise ValueError(
                f"{type(spec).__name__} {spec.name!r}: like={spec.like!r} is not a group; choose one of "
                f"{sorted(groups)}."
            )
        return {f"{spec.name}.{n}": t for n, t in groups[spec.like].items()}
    if spec.init == "module":
        raise ValueError(f"{type(spec).__name__} {spec.name!r}: init={spec.init!r} needs like=, not shapes=.")
    shapes = spec.shapes
    if callable(shapes):
        shapes = shapes(
            {g: {n: tuple(getattr(t, "shape", ())) for n, t in named.items()} for g, named in groups.items()}
        )
    if isinstance(shapes, Mapping):
        return {f"{spec.name}.{k}": tuple(s) for k, s in shapes.items()}
    return {spec.name: tuple(shapes)}


def _generator(seed: int, name: str) -> torch.Generator:
    """The CPU generator of a callable ``init``: seeded from the strategy's ``seed`` and the tensor's name."""
    return torch.Generator().manual_seed(
        ((seed & 0xFFFFFFFF) * 1_000_003 + zlib.crc32(name.encode())) % (2**61 - 1)
    )


def declared_templates(
    specs: Iterable[ClientTensors], groups: Mapping[str, Mapping[str, Tensor]], seed: int = 0
) -> dict[str, Tensor]:
    """The initial values of declared tensors by name, from ``groups`` (group name -> the module's tensors
    by name at fit start); ``seed`` (the strategy's) seeds a callable ``init``. A bad declaration is an error
    naming it."""
    out: dict[str, Tensor] = {}
    for spec in specs:
        if not callable(spec.init) and spec.init not in ("zeros", "module"):
            raise ValueError(
                f"{type(spec).__name__} {spec.name!r}: init must be 'zeros', 'module' or a callable "
                f"(name, template, generator) -> Tensor, got {spec.init!r}."
            )
        for name, like in _names(spec, groups).items():
            if name in out:
                raise ValueError(f"Two declared tensors are named {name!r}; give them different names.")
            if isinstance(like, Tensor):
                value = like.detach().clone() if spec.init != "zeros" else torch.zeros_like(like)
                value = value if spec.dtype is None else value.to(spec.dtype)
            else:
                value = torch.zeros(like, dtype=spec.dtype or torch.float32)
            out[name] = _initialized(spec, name, value, seed) if callable(spec.init) else value
    return out


def _initialized(spec: ClientTensors, name: str, template: Tensor, seed: int) -> Tensor:
    """A callable ``init``'s value of ``name``, checked to be a tensor of the template's shape."""
    value = spec.init(name, template, _generator(seed, name))  # type: ignore[operator]
    if not isinstance(value, Tensor) or value.shape != template.shape:
        raise ValueError(
            f"{type(spec).__name__} {spec.name!r}: init({name!r}, ...) must return a tensor of shape "
            f"{tuple(template.shape)}, got {getattr(value, 'shape', value)!r}."
        )
    return value.detach().to(template.device, template.dtype)


def declared_names(specs: Iterable[ClientTensors], groups: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The names of declared tensors (``groups``: group name -> tensor names as keys)."""
    return [name for spec in specs for name in _names(spec, groups)]
