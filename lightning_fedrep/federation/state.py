"""The federation's stored state: settings, the global and client tensors, fingerprint, ``state_dict``.

:class:`FederationState` is the part of :class:`~lightning_fedrep.federation.Federation` that holds and
reads what a checkpoint holds; the round (:mod:`.round`), the live module (:mod:`.live`) and the
processes (:mod:`.ranks`) are its other parts, each given this one to work on.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_fedrep.federation.api.aggregation import ClientFault
from lightning_fedrep.federation.api.algorithm import Algorithm, Phase
from lightning_fedrep.federation.api.declared import declared_names as declared_templates_names
from lightning_fedrep.federation.api.declared import declared_templates
from lightning_fedrep.federation.api.mechanism import PrivacyMechanism
from lightning_fedrep.federation.api.scoring import EvaluationSpec, evaluation_spec, scored_tensors
from lightning_fedrep.federation.history import History
from lightning_fedrep.federation.module.split import ParameterSplit, TensorLayout
from lightning_fedrep.federation.store import ClientStore, check_client_id

STATE_VERSION = 3
"""Version 3 added the declared server tensors (``"server"``) and client tensors (``clients["tensors"]``)."""


@dataclass(frozen=True)
class FederationConfig:
    """The settings of a federation that do not depend on the model (checked at construction): ``phases``,
    ``clients_per_round``, ``weighting``, ``client_optimizer_state``, ``seed``, ``on_nonfinite``,
    ``on_client_error`` and ``privacy`` are the strategy's settings of the same names
    (:class:`~lightning_fedrep.session.session.FederatedSession`)."""

    phases: tuple[Phase, ...]
    clients_per_round: float | int = 0.1
    weighting: Literal["samples", "uniform"] = "samples"
    client_optimizer_state: Literal["reset", "keep"] = "reset"
    seed: int = 0
    on_nonfinite: Literal["skip", "raise"] = "skip"
    on_client_error: Literal["raise", "skip"] = "raise"
    first_state: Literal["initial", "average"] = "initial"
    """Where a client that has not trained yet starts its local part: the module's ``"initial"`` values, or
    the ``"average"`` of every local tensor over the last aggregated round's clients (the official code's
    aliasing of ``w_locals`` to the global model, into which it averages every key, heads included)."""
    privacy: PrivacyMechanism | None = None
    """The server's privacy mechanism (e.g. ``lightning_fedrep.privacy.ClientLevelDP``): it aggregates every
    round in place of the algorithm's aggregator (:mod:`~lightning_fedrep.federation.api.mechanism`)."""

    def __post_init__(self) -> None:
        for name, value in (("on_nonfinite", self.on_nonfinite), ("on_client_error", self.on_client_error)):
            if value not in ("skip", "raise"):
                raise ValueError(f"{name} must be 'skip' or 'raise', got {value!r}.")
        if self.weighting not in ("samples", "uniform"):
            raise ValueError(f"weighting must be 'samples' or 'uniform', got {self.weighting!r}.")
        if self.client_optimizer_state not in ("reset", "keep"):
            raise ValueError(
                f"client_optimizer_state must be 'reset' or 'keep', got {self.client_optimizer_state!r}."
            )
        if self.first_state not in ("initial", "average"):
            raise ValueError(f"first_state must be 'initial' or 'average', got {self.first_state!r}.")
        if self.privacy is not None and not isinstance(self.privacy, PrivacyMechanism):
            raise TypeError(
                "privacy must be a mechanism from lightning_fedrep.privacy (e.g. ClientLevelDP(clip=1.0, "
                f"noise_multiplier=1.0)) or None, got {type(self.privacy).__name__} ({self.privacy!r})."
            )


class FederationMismatch(ValueError):
    """A checkpoint saved by another federation (other clients or planning settings) than the run's."""


def clients_fingerprint(client_sizes: Sequence[int], partition: int) -> dict[str, Any]:
    """The clients' part of a federation's fingerprint: their number, a checksum of their training-set
    sizes, and ``partition``, a checksum of which samples each holds (``RoundLoader.partition_checksum``)."""
    sizes = tuple(int(n) for n in client_sizes)
    return {
        "num_clients": len(sizes),
        "client_sizes": zlib.crc32(str(sizes).encode()),
        "partition": int(partition),
    }


def federation_fingerprint(
    client_sizes: Sequence[int], partition: int, batch_size: int, algorithm: str, config: FederationConfig
) -> dict[str, Any]:
    """What a checkpoint records of its federation: the clients (:func:`clients_fingerprint`), the batch
    size, the algorithm, how rounds are planned (seed, clients per round, phases), where untrained
    clients start (``first_state``; absent from older checkpoints, whose resumes compare the rest) and, under a
    privacy mechanism, its settings (``privacy``: the mechanism's ``repr``)."""
    privacy = {} if config.privacy is None else {"privacy": repr(config.privacy)}
    return {
        **clients_fingerprint(client_sizes, partition),
        "batch_size": int(batch_size),
        "algorithm": algorithm,
        "seed": config.seed,
        "clients_per_round": repr(config.clients_per_round),
        "phases": repr(config.phases),
        "first_state": config.first_state,
        **privacy,
    }


def fingerprint_changes(saved: Mapping[str, Any] | None, current: Mapping[str, Any]) -> list[str]:
    """``"<key> <saved> -> <current>"`` for each key of ``current`` the ``saved`` fingerprint records
    with another value (``[]`` without a saved fingerprint)."""
    if not saved:
        return []
    return [
        f"{key} {saved[key]!r} -> {value!r}"
        for key, value in current.items()
        if key in saved and saved[key] != value
    ]


class FederationState:
    """The stored state of a :class:`~lightning_fedrep.federation.Federation`: its settings, the global
    shared and server tensors, every client's tensors (a :class:`ClientStore`), the history and the
    clients' sizes; what its ``state_dict`` saves (the open round aside, :mod:`.round`).

    Args:
        algorithm: what the server shares and how it aggregates.
        layout: which named tensors of the module are shared and which are local.
        config: sampling, phases, weighting and optimizer-state settings.
    """

    def __init__(self, algorithm: Algorithm, layout: TensorLayout, config: FederationConfig):
        self.algorithm = algorithm
        self.layout = layout
        self.config = config
        self.global_state: list[Tensor] | None = None
        self.server_tensors: dict[str, Tensor] = {}
        """The algorithm's declared server tensors by name (``Algorithm.server_tensors``)."""
        self.store: ClientStore | None = None
        self.history = History()
        self.faults: list[ClientFault] = []
        """Every client left out of a round so far (checkpointed)."""
        self.saved_federation: dict[str, Any] | None = None
        """The fingerprint of the federation the loaded checkpoint was saved with."""
        self.partition = 0
        self.client_sizes: tuple[int, ...] | None = None
        self.batch_size = 1
        self.device = torch.device("cpu")
        """Where the state is held (the training device, set by :meth:`initialize`)."""
        self._evaluation_spec: EvaluationSpec | None = None
        if config.privacy is not None:
            config.privacy.check(algorithm, config)

    @property
    def split(self) -> ParameterSplit:
        """Which parameters are head, body and frozen."""
        return self.layout.split

    @property
    def shared_names(self) -> tuple[str, ...]:
        """Names of the tensors the server averages (parameters and buffers)."""
        return self.layout.shared

    @property
    def local_names(self) -> tuple[str, ...]:
        """Names of the tensors every client keeps for itself."""
        return self.layout.local

    @property
    def num_clients(self) -> int:
        """Number of clients (known once the training data is bound)."""
        return len(self.require_data())

    @property
    def has_state(self) -> bool:
        """Whether the global and client state exist (after ``initialize`` or loading a checkpoint)."""
        return self.store is not None

    def global_tensors(self) -> dict[str, Tensor]:
        """The global shared tensors by name (copies)."""
        self.require_state()
        return {n: t.detach().clone() for n, t in zip(self.shared_names, self.global_state)}

    def global_view(self) -> dict[str, Tensor]:
        """The global shared tensors by name, not copied: read them, never modify them."""
        self.require_state()
        return dict(zip(self.shared_names, self.global_state))

    def client_tensors(self, client: int) -> dict[str, Tensor]:
        """What makes ``client``'s model its own, by name (copies): its local part (the initial one if it
        never trained) and any shared tensors it fine-tuned in a round that did not aggregate."""
        self.require_state()
        self.check_client(client)
        return {n: t.detach().clone() for n, t in self.store.personal(client, self.local_names).items()}

    def check_client(self, client: int) -> None:
        """Refuse a client id outside the federation (``-1``, a client that never trained, is allowed)."""
        known = len(self.client_sizes) if self.client_sizes is not None else None
        if known is None and self.saved_federation is not None:
            known = self.saved_federation.get("num_clients")
        check_client_id(client, known)

    def personalized_state(self, base_state: Mapping[str, Tensor], client: int) -> dict[str, Tensor]:
        """``base_state`` (a module ``state_dict`` holding the global shared part) made ``client``'s own: the
        model evaluation scores (``Algorithm.evaluation()``, before any adaptation); ``-1``: a new client's
        model (the global shared part, the initial local part)."""
        own = self.client_tensors(client)
        if client != -1:
            own = {n: t.detach().clone() for n, t in self.scored_tensors(client).items()}
        return {**{k: v.detach().clone() for k, v in base_state.items()}, **own}

    def update_global(self, tensors: Mapping[str, Tensor]) -> None:
        """Overwrite some of the global shared tensors (e.g. a server step after aggregation); the live
        module is the federation's to update."""
        self.require_state()
        index = {n: i for i, n in enumerate(self.shared_names)}
        unknown = set(tensors) - set(index)
        if unknown:
            raise KeyError(f"{sorted(unknown)} are not shared; shared tensors are {list(self.shared_names)}.")
        for name, value in tensors.items():
            self.global_state[index[name]].copy_(value.detach())

    def update_client(self, client: int, tensors: Mapping[str, Tensor]) -> list[Tensor]:
        """Overwrite some of ``client``'s local tensors (e.g. a server step on the heads); returns its new
        local part (``local_names``' order)."""
        self.require_state()
        unknown = set(tensors) - set(self.local_names)
        if unknown:
            raise KeyError(
                f"{sorted(unknown)} are not local to a client; local tensors are {list(self.local_names)}."
            )
        current = [t.detach().clone() for t in self.store.get(client)]
        for i, name in enumerate(self.local_names):
            if name in tensors:
                current[i] = tensors[name].detach().to(current[i].device, current[i].dtype)
        self.store.put(client, current)
        return current

    def set_server_state(self, shared: Mapping[str, Tensor], tensors: Mapping[str, Tensor]) -> None:
        """Replace the global shared and the server tensors with copies of the server step's (``shared``:
        every shared name, ``tensors``: every declared server tensor), on their devices and dtypes."""
        self.global_state = [
            shared[n].detach().to(ref.device, ref.dtype).clone()
            for n, ref in zip(self.shared_names, self.global_state)
        ]
        self.server_tensors = {
            n: tensors[n].detach().to(ref.device, ref.dtype).clone() for n, ref in self.server_tensors.items()
        }

    def initialize(self, device: torch.device, named: Mapping[str, Tensor]) -> None:
        """Snapshot the global shared part and the initial local part from the module's tensors ``named``
        (first time), or move the existing state to ``device``."""
        self.device = torch.device(device)
        if self.store is None:
            self.global_state = [named[n].detach().clone() for n in self.shared_names]
            self.store = ClientStore([named[n] for n in self.local_names])
            groups = self._declared_groups(dict(named))
            seed = self.config.seed
            # shapes= declarations and callable inits are made on the CPU: held on the training device
            declared = declared_templates(self.algorithm.client_tensors, groups, seed)
            self.store.declare({n: t.to(self.device) for n, t in declared.items()})
            server = declared_templates(self.algorithm.server_tensors, groups, seed)
            self.server_tensors = {n: t.to(self.device) for n, t in server.items()}
            self._check_slots()
        else:
            self.global_state = [t.to(device) for t in self.global_state]
            self.store.to(device)
            self.server_tensors = {n: t.to(device) for n, t in self.server_tensors.items()}

    def _check_slots(self) -> None:
        """Every slot a phase or the evaluation names is a declared ``ClientTensors(slot, like="model")``;
        a ``"global"`` evaluation needs an algorithm that shares everything."""
        declared = {t.name for t in self.algorithm.client_tensors if t.like == "model"}
        spec = self.evaluation_spec
        named = [p.slot for p in self.config.phases] + [spec.slot]
        if spec.score == "mixture":  # a mixture may read any declared like= tensors (FedRoD's head)
            named.pop()
            declared_like = {t.name for t in self.algorithm.client_tensors if t.like is not None}
            if spec.slot not in declared_like:
                raise ValueError(
                    f"Slot {spec.slot!r} ({type(self.algorithm).__name__}.evaluation()'s mixture slot) is not "
                    f"declared: add ClientTensors({spec.slot!r}, like='model' (or 'head', 'body', ...)) to the "
                    "algorithm's client_tensors."
                )
        for slot in named:
            if slot not in (None, "model") and slot not in declared:
                raise ValueError(
                    f"Slot {slot!r} (a phase's slot= or {type(self.algorithm).__name__}.evaluation()'s slot) is "
                    f"not declared: add ClientTensors({slot!r}, like='model', init='module') to the algorithm's "
                    f"client_tensors, or use slot='model'."
                )
        if spec.score == "global" and self.local_names:
            raise ValueError(
                f"{type(self.algorithm).__name__} (algorithm {self.algorithm.name!r}) scores evaluation with the "
                f"global model (EvaluationSpec('global')), but it keeps {list(self.local_names)} per client, so "
                "there is no global model: score 'personal' (or 'slot'/'mixture'), or share every group "
                "(and buffers='shared')."
            )

    def _declared_groups(self, named: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """The groups a declared tensor can be shaped ``like``: shared, local, body, head (name -> value)."""
        groups: dict[str, dict[str, Any]] = {
            "shared": {n: named[n] for n in self.shared_names},
            "local": {n: named[n] for n in self.local_names},
            "model": {n: named[n] for n in self.shared_names + self.local_names},
            "body": {},
            "head": {},
        }
        for name in self.shared_names + self.local_names:
            group = self.split.group(name)
            if group in ("body", "head"):
                groups[group][name] = named[name]
        return groups

    def declared_names(self, named: Mapping[str, Any]) -> tuple[list[str], list[str]]:
        """The names of the algorithm's declared client and server tensors in this layout (``named``: the
        model's tensors by name, whose shapes size a ``shapes=callable``)."""
        groups = self._declared_groups({n: named.get(n) for n in self.shared_names + self.local_names})
        return (
            list(declared_templates_names(self.algorithm.client_tensors, groups)),
            list(declared_templates_names(self.algorithm.server_tensors, groups)),
        )

    def check_declared(self, state: Mapping[str, Any], path: Any, named: Mapping[str, Any]) -> None:
        """Refuse a checkpoint that lacks declared tensors this run's algorithm needs (e.g. a version-2 file,
        which holds none), naming them and what to do (``named``: the attached module's tensors by name)."""
        saved = zip(
            [*state.get("shared_names", []), *state.get("local_names", [])],
            [*state.get("global", []), *state.get("clients", {}).get("template", [])],
        )
        client, server = self.declared_names({**dict(saved), **named})
        saved_client = list(state.get("clients", {}).get("tensor_names", []))
        saved_server = list(state.get("server", {}))
        missing = {
            "client": [n for n in client if n not in saved_client],
            "server": [n for n in server if n not in saved_server],
        }
        parts = []
        for kind, names in missing.items():
            counts: dict[str, int] = {}
            for name in names:
                counts[name.split(".")[0]] = counts.get(name.split(".")[0], 0) + 1
            parts += [f"{kind} tensors {prefix}.* ({count})" for prefix, count in counts.items()]
        if not parts:
            return
        raise ValueError(
            f"{path} was written by lightning_fedrep's version-{state.get('version')} federated state, which "
            f"holds no {', '.join(parts)} that algorithm {self.algorithm.name!r} needs (its client_tensors/"
            f"server_tensors); resume with the algorithm it was written with ({state.get('algorithm')!r}) or "
            "start a new fit."
        )

    def bind_data(self, client_sizes: Sequence[int], batch_size: int, partition: int = 0) -> None:
        """The clients' training-set sizes (aggregation weights, epoch budgets), the batch size, and a
        checksum of which samples each client holds (part of the federation's fingerprint)."""
        self.client_sizes = tuple(int(n) for n in client_sizes)
        self.batch_size = int(batch_size)
        self.partition = int(partition)
        if self.config.privacy is not None:
            self.config.privacy.bind_data(self.client_sizes, self.batch_size)

    def adopt_new_federation(self) -> None:
        """Keep the loaded global state and forget the loaded clients (another federation's)."""
        self.store.local.clear()
        self.store.optimizer_states.clear()
        self.store.finetuned.clear()
        self.store.tensors.clear()
        self.saved_federation = None

    def fingerprint(self) -> dict[str, Any]:
        """What makes a checkpoint this federation's: its clients (count, sizes, which samples), the
        batch size, the algorithm, how rounds are planned (seed, clients per round, phases), ``first_state``."""
        return federation_fingerprint(
            self.require_data(), self.partition, self.batch_size, self.algorithm.name, self.config
        )

    def federation_changes(self, current: Mapping[str, Any] | None = None) -> list[str]:
        """How this run's federation differs from the one the loaded checkpoint was saved with: all of
        :meth:`fingerprint`, or only the keys of ``current`` (in evaluation, the clients:
        ``clients_fingerprint``)."""
        return fingerprint_changes(self.saved_federation, self.fingerprint() if current is None else current)

    def state_dict(self, round_state: dict[str, Any]) -> dict[str, Any]:
        """Everything needed to resume the federation exactly (tensors, ints, strings, lists, dicts), with
        ``round_state`` (the round's part, :meth:`RoundTransaction.state_dict`) as its ``"round"``."""
        self.require_state()
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "algorithm": self.algorithm.name,
            "algorithm_state": self.algorithm.state_dict(),
            "shared_names": list(self.shared_names),
            "local_names": list(self.local_names),
            "global": [t.detach().clone() for t in self.global_state],
            "server": {n: t.detach().clone() for n, t in self.server_tensors.items()},
            "clients": self.store.state_dict(),
            "history": self.history.state_dict(),
            "faults": [asdict(f) for f in self.faults],
            "federation": self.fingerprint() if self.client_sizes is not None else self.saved_federation,
            "round": round_state,
            "torch_rng": torch.get_rng_state(),
        }
        if self.config.privacy is not None:
            state["privacy"] = self.config.privacy.state_dict()
        if torch.cuda.is_available():
            state["cuda_rng"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(
        self,
        state: dict[str, Any],
        named: Mapping[str, Any],
        device: torch.device | None = None,
        path: Any = "The checkpoint",
    ) -> None:
        """Restore the global state, every client and the history (any stage); ``named``: the attached
        module's tensors by name. The open round is restored separately
        (:meth:`RoundTransaction.restore_round`), once the optimizers exist. A state that lacks
        tensors the algorithm declares (a version-2 file) is refused (:meth:`check_declared`)."""
        self.check_declared(state, path, named)
        if list(state["shared_names"]) != list(self.shared_names) or list(state["local_names"]) != list(
            self.local_names
        ):
            raise ValueError(
                f"The checkpoint's federated state was saved with algorithm {state['algorithm']!r} sharing "
                f"{state['shared_names']} and keeping {state['local_names']} local, but this strategy shares "
                f"{list(self.shared_names)} and keeps {list(self.local_names)}. Use the same algorithm and head "
                "as when saving."
            )
        self.global_state = [t.to(device) if device is not None else t for t in state["global"]]
        self.store = ClientStore([])
        self.store.load_state_dict(state["clients"], device)
        self.server_tensors = {
            n: t.to(device) if device is not None else t for n, t in state.get("server", {}).items()
        }
        self.history = History()
        self.history.load_state_dict(state.get("history", []))
        self.faults = [ClientFault(**f) for f in state.get("faults", [])]
        self.saved_federation = state.get("federation")
        self.algorithm.load_state_dict(state.get("algorithm_state", {}))
        if self.config.privacy is not None:
            self.config.privacy.load_state_dict(self._privacy_state(state, path))

    @staticmethod
    def _privacy_state(state: Mapping[str, Any], path: Any) -> Mapping[str, Any]:
        """The privacy mechanism's part of a saved ``state``; a state saved without a mechanism gives ``{}``
        (the mechanism starts fresh), with a warning: its rounds were not private and no accountant counted them."""
        if "privacy" in state:
            return state["privacy"]
        warnings.warn(
            f"{path} was saved without a privacy mechanism: this run's mechanism starts fresh from it, and the "
            "rounds before it were not private (no accountant counted them; an epsilon reported from here on "
            "covers only the rounds run under the mechanism).",
            UserWarning,
            stacklevel=3,
        )
        return {}

    @property
    def evaluation_spec(self) -> EvaluationSpec:
        """What evaluation scores: ``algorithm.evaluation()`` (asked once)."""
        if self._evaluation_spec is None:
            self._evaluation_spec = evaluation_spec(self.algorithm)
        return self._evaluation_spec

    def scored_tensors(self, client: int) -> dict[str, Tensor]:
        """What evaluation scores for ``client`` on top of the global shared part, before any adaptation
        (the algorithm's :class:`EvaluationSpec`: its local part, nothing, a slot, a mixture). Not copies."""
        return scored_tensors(
            self.evaluation_spec,
            client,
            self.global_view(),
            self.store.personal(client, self.local_names),
            lambda: self.store.client_state(client),
        )

    def require_data(self) -> tuple[int, ...]:
        """The clients' training-set sizes; refused before the training data is bound."""
        if self.client_sizes is None:
            raise RuntimeError(
                "The federation has not seen the training data yet (it does at the start of fit)."
            )
        return self.client_sizes

    def require_state(self) -> None:
        """Refuse to go on before the global and client state exist."""
        if self.store is None:
            raise RuntimeError("No federated state yet: call trainer.fit(...) or load a checkpoint first.")
