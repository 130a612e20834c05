"""A checkpoint checked before any of it is used: the file reads, its federated state is of a version this
package loads, and every federated entry has the type and shape this run's module needs.

Without these checks a truncated file fails with ``OSError: [Errno 22]`` or a zip reader's message, and
a damaged entry with a raw ``TypeError`` or, worse, inside a convolution rounds later. Every error here is
a :class:`CheckpointError` naming the file and, for an entry, where it is in the checkpoint
(``lightning_fedrep['clients']['local'][3][0]``) with the expected and the actual shape.
"""

from __future__ import annotations

import pickle
import zipfile
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fedrep.federation import STATE_VERSION

LOADABLE_VERSIONS = (1, 2, STATE_VERSION)
"""The versions of the federated state (``checkpoint["lightning_fedrep"]["version"]``) this package loads
(version 1 kept its history as a list of rows and had no fingerprint, fine-tuned tensors or faults; version 2
had no declared server tensors ``"server"`` nor client tensors ``clients["tensors"]``: it loads as holding none)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: unreadable, of another version, or with a damaged federated entry."""


def read_checkpoint(path: Any, load: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``load()`` (which reads the checkpoint at ``path``), with a truncated or corrupt file reported as one
    :class:`CheckpointError` naming it (a missing file keeps its own error)."""
    try:
        checkpoint = load()
    except FileNotFoundError:
        raise
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        unsafe = "weights only load failed" in reason.lower()
        raise CheckpointError(
            f"Cannot read the checkpoint {path}: the file is truncated or corrupt"
            + (", or holds objects other than tensors, numbers, strings and containers" if unsafe else "")
            + f" ({type(error).__name__}: {str(error).strip() if unsafe else reason}). Resume from another "
            "checkpoint (e.g. an earlier one, or last.ckpt), or write it again."
        ) from error
    if not isinstance(checkpoint, dict):
        raise CheckpointError(
            f"The checkpoint {path} holds a {type(checkpoint).__name__}, not a Lightning checkpoint (a dict)."
        )
    return checkpoint


def check_version(state: Any, path: Any) -> None:
    """Refuse a federated state that is not a dict, or whose ``version`` this package does not load."""
    if not isinstance(state, dict):
        raise CheckpointError(
            f"The checkpoint {path}'s entry 'lightning_fedrep' must be a dict (the federated state), got "
            f"{type(state).__name__}."
        )
    version = state.get("version")
    if version not in LOADABLE_VERSIONS:
        loadable = ", ".join(str(v) for v in LOADABLE_VERSIONS[:-1]) + f" and {LOADABLE_VERSIONS[-1]}"
        found = "has no version field" if version is None else f"is version {version!r}"
        raise CheckpointError(
            f"The checkpoint {path}'s federated state {found}; this lightning_fedrep loads versions {loadable} "
            "only. Use the lightning_fedrep release that wrote it, or train again."
        )


def check_federated_state(
    state: dict[str, Any],
    module_tensors: Mapping[str, Tensor],
    shared_names: tuple[str, ...],
    local_names: tuple[str, ...],
    path: Any,
) -> None:
    """Refuse a federated state whose entries do not have the types and shapes this run needs: the global
    shared tensors, the clients' local tensors, fine-tuned tensors, kept optimizer states, the open round,
    the history. Shapes are compared with ``module_tensors`` (the module's parameters and buffers by name)
    when the state shares and keeps the same names as this run (else the federation's own check explains)."""
    check = _Checker(path)
    check_version(state, path)
    saved_shared = check.names(state, "shared_names")
    saved_local = check.names(state, "local_names")
    same = saved_shared == list(shared_names) and saved_local == list(local_names)
    shapes = {n: tuple(module_tensors[n].shape) for n in (*shared_names, *local_names) if n in module_tensors}
    shared_shapes = [shapes.get(n) if same else None for n in saved_shared]
    local_shapes = [shapes.get(n) if same else None for n in saved_local]
    check.tensors(state, "global", saved_shared, shared_shapes, ["global"])
    fingerprint = check.typed(state, "federation", dict, ["federation"], optional=True) or {}
    clients = fingerprint.get("num_clients")
    check.clients(state, saved_local, local_shapes, saved_shared, shared_shapes, clients)
    check.typed(
        state, "history", list | dict, ["history"], optional=True, label="a dict (a list in version 1)"
    )
    check.typed(state, "faults", list, ["faults"], optional=True)
    check.typed(state, "algorithm_state", dict, ["algorithm_state"], optional=True)
    check.rng(state, ["torch_rng"])
    check.round(state, saved_shared + saved_local, shared_shapes + local_shapes, ["round"])
    ranks = check.typed(state, "ranks", list, ["ranks"], optional=True) or []
    for rank, own in enumerate(ranks):
        where = ["ranks", rank]
        if not isinstance(own, dict):
            check.fail(where, "a dict (one process's open round)", own)
        check.rng(own, [*where, "torch_rng"])
        check.round(own, saved_shared + saved_local, shared_shapes + local_shapes, [*where, "round"])


class _Checker:
    """Type and shape checks of the entries of one checkpoint's federated state."""

    def __init__(self, path: Any):
        self.path = path

    def fail(self, where: list[Any], expected: str, got: Any, detail: str = "") -> None:
        entry = "lightning_fedrep" + "".join(f"[{key!r}]" for key in where)
        actual = f"shape {tuple(got.shape)}" if isinstance(got, Tensor) else type(got).__name__
        raise CheckpointError(
            f"The checkpoint {self.path} is damaged: {entry}{detail} must be {expected}, got {actual}. Resume from "
            "another checkpoint, or one written by this package unchanged."
        )

    def typed(
        self, state: dict, key: str, kind: Any, where: list[Any], optional: bool = False, label: str = ""
    ) -> Any:
        value = state.get(key)
        if value is None and optional:
            return None
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
            self.fail(where, label or ("an int" if kind is int else f"a {kind.__name__}"), value)
        return value

    def names(self, state: dict, key: str) -> list[str]:
        names = self.typed(state, key, list, [key])
        if not all(isinstance(n, str) for n in names):
            self.fail([key], "a list of tensor names (strings)", names)
        return names

    def tensor(self, value: Any, name: str, shape: tuple[int, ...] | None, where: list[Any]) -> None:
        detail = f" ({name!r})"
        if not isinstance(value, Tensor):
            self.fail(where, "a tensor", value, detail)
        if shape is not None and tuple(value.shape) != shape:
            self.fail(where, f"of shape {shape}, as this module's {name!r}", value, detail)

    def tensors(
        self, state: dict, key: str, names: list[str], shapes: list[Any], where: list[Any]
    ) -> list[Tensor]:
        values = self.typed(state, key, list | tuple, where, label="a list of tensors")
        if len(values) != len(names):
            raise CheckpointError(
                f"The checkpoint {self.path} is damaged: lightning_fedrep"
                f"{''.join(f'[{k!r}]' for k in where)} holds {len(values)} tensors for the {len(names)} names "
                f"{names}."
            )
        for i, (value, name, shape) in enumerate(zip(values, names, shapes)):
            self.tensor(value, name, shape, [*where, i])
        return values

    def client_id(self, client: Any, where: list[Any], clients: int | None) -> None:
        valid = isinstance(client, int) and not isinstance(client, bool) and client >= 0
        if not valid or (isinstance(clients, int) and client >= clients):
            known = f" in 0..{clients - 1}" if isinstance(clients, int) else ""
            raise CheckpointError(
                f"The checkpoint {self.path} is damaged: lightning_fedrep{''.join(f'[{k!r}]' for k in where)} "
                f"has the key {client!r}, which is not a client id{known}."
            )

    def clients(
        self,
        state: dict,
        local: list[str],
        local_shapes: list[Any],
        shared: list[str],
        shared_shapes: list[Any],
        clients: int | None,
    ) -> None:
        store = self.typed(state, "clients", dict, ["clients"])
        where = ["clients"]
        self.tensors(store, "template", local, local_shapes, [*where, "template"])
        for client, tensors in self.typed(store, "local", dict, [*where, "local"]).items():
            self.client_id(client, [*where, "local"], clients)
            self.tensors({"t": tensors}, "t", local, local_shapes, [*where, "local", client])
        shape_of = dict(zip(shared + local, shared_shapes + local_shapes))
        finetuned = self.typed(store, "finetuned", dict, [*where, "finetuned"], optional=True) or {}
        for client, tensors in finetuned.items():
            self.client_id(client, [*where, "finetuned"], clients)
            self.typed({"t": tensors}, "t", dict, [*where, "finetuned", client])
            for name, value in tensors.items():
                if name not in shape_of:
                    self.fail(
                        [*where, "finetuned", client], f"keyed by the module's tensor names {shared}", name
                    )
                self.tensor(value, name, shape_of[name], [*where, "finetuned", client, name])
        for client, optimizers in self.typed(
            store, "optimizer_states", dict, [*where, "optimizer_states"]
        ).items():
            self.client_id(client, [*where, "optimizer_states"], clients)
            self.typed({"t": optimizers}, "t", dict, [*where, "optimizer_states", client])
            for index, params in optimizers.items():
                self.typed({"t": params}, "t", dict, [*where, "optimizer_states", client, index])

    def rng(self, state: dict, where: list[Any]) -> None:
        value = state.get(where[-1])
        if not isinstance(value, Tensor) or value.dtype != torch.uint8:
            self.fail(where, "the torch RNG state (a uint8 tensor)", value)

    def round(self, state: dict, names: list[str], shapes: list[Any], where: list[Any]) -> None:
        round_state = self.typed(state, "round", dict, where)
        if not isinstance(round_state.get("open"), bool):
            self.fail([*where, "open"], "True or False", round_state.get("open"))
        self.typed(round_state, "index", int, [*where, "index"])
        if round_state["open"]:
            self.tensors(round_state, "live_tensors", names, shapes, [*where, "live_tensors"])
            self.typed(round_state, "live_client", int, [*where, "live_client"])
            self.starts(round_state, dict(zip(names, shapes)), [*where, "starts"])

    def starts(self, round_state: dict, shape_of: dict[str, Any], where: list[Any]) -> None:
        """The started clients' starting values ``Algorithm.start_client`` changed (optional)."""
        if "starts" not in round_state:
            return
        for client, values in self.typed(round_state, "starts", dict, where).items():
            self.client_id(client, where, None)
            for name, value in self.typed({"t": values}, "t", dict, [*where, client]).items():
                if name not in shape_of:
                    self.fail([*where, client], f"keyed by the module's tensor names {list(shape_of)}", name)
                self.tensor(value, name, shape_of[name], [*where, client, name])


def load_federated_state(
    federation: Any, state: dict[str, Any], module: nn.Module, device: Any, path: Any
) -> None:
    """Restore ``federation`` (a :class:`~lightning_fedrep.federation.Federation`) from a checkpoint's federated
    ``state`` onto ``device``, after checking it against ``module``'s parameters and buffers
    (:func:`check_federated_state`; ``path`` names the checkpoint in errors)."""
    named = {**dict(module.named_buffers()), **dict(module.named_parameters())}
    check_federated_state(state, named, federation.shared_names, federation.local_names, path)
    federation.load_state_dict(state, device, path)
