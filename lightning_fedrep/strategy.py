"""``FedRepStrategy``: a whole federated training inside one ``Trainer.fit``.

One Lightning epoch is one communication round. Per round the strategy samples clients, and for
every step of the round (one Lightning batch) it makes sure the live module holds the right
client: the round's global shared part plus that client's local part, with only the current phase's
parameters trainable. After the round's last optimizer step it replaces the shared part with the
sample-weighted average of the clients' shared parts. The user's ``configure_optimizers``,
``training_step`` and ``validation_step`` run unchanged.

Where each piece runs (Lightning 2.6 hook order, see ``reference/lightning-internals.md``):

* ``connect``: resolve the body/head split from parameter names.
* ``setup``: refuse trainer settings that would cut or merge rounds; snapshot the global state
  and the template of the local part.
* ``process_dataloader``: bind the data module's ``RoundLoader`` to the round planner.
* ``on_train_batch_start``: switch client and phase.
* ``optimizer_step`` (automatic) / ``training_step`` (manual optimization): close the round.
* ``validation_step``/``test_step``: swap in the batch's client and record per-client metrics.
* ``save_checkpoint``/``load_*``: every client's state, the open round, RNG.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_fedrep.algorithms import Algorithm, Phase, get_algorithm, parse_phases
from lightning_fedrep.clients import ClientStore, OptimizerState
from lightning_fedrep.data.loaders import EvalLoader, RoundLoader
from lightning_fedrep.evaluation import (
    SUMMARY_SUFFIXES,
    ClientMetrics,
    batch_size_of,
    capture_logs,
    headline_sums,
)
from lightning_fedrep.plan import RoundPlan, RoundSpec, plan_round, sample_clients
from lightning_fedrep.server import WeightedAverage
from lightning_fedrep.split import HeadSpec, ParameterSplit, SplitError, resolve_split

CHECKPOINT_KEY = "lightning_fedrep"
_PART_GROUPS = {"head": ("head",), "body": ("body",), "all": ("head", "body")}
_STATE_VERSION = 1


class FedRepStrategy(SingleDeviceStrategy):
    """Personalized federated learning (FedRep and its family) on one device.

    Args:
        head: the per-client part: module name(s) / parameter-name prefixes, or a compiled regex.
            ``None`` uses the module's own ``fedrep_head`` attribute.
        algorithm: ``"fedrep"``, ``"fedper"``, ``"lg_fedavg"``, ``"fedavg"`` or ``"local"``.
        clients_per_round: a fraction in (0, 1] of the clients, or a count, sampled each round.
        head_epochs, body_epochs: FedRep's local work (head epochs with the body frozen, then body
            epochs with the head frozen).
        local_epochs: local epochs of the other algorithms (everything trains jointly).
        phases: explicit local phases instead of the shorthands, e.g.
            ``[Phase("head", steps=10), Phase("body", steps=1)]`` (dicts are accepted too).
        weighting: ``"samples"`` weights clients by their training-set size (the official code),
            ``"uniform"`` averages them equally (the paper's Algorithm 1).
        client_optimizer_state: ``"reset"`` gives every client a fresh optimizer state every round (the
            official FedRep recipe); ``"keep"`` keeps the optimizer state of each client's *local*
            part (its head, for FedRep) across rounds; the shared part's state restarts every round.
        buffers: ``"shared"``: buffers (BatchNorm statistics) follow the body, averaged when the
            algorithm shares the body; ``"local"`` keeps them per client for every algorithm (FedBN).
        allow_frozen: keep parameters that are frozen at setup fixed, instead of raising.
        seed: seeds client sampling (data order is seeded by the data module).
        headline_metrics: compute ``val/acc`` and ``val/loss`` (``test/``...) from ``model(x)`` on
            ``(x, y)`` batches, in addition to what the module logs.
        device: the device to train on; by default the one the Trainer's accelerator picks.
    """

    strategy_name = "fedrep"

    def __init__(
        self,
        head: HeadSpec = None,
        algorithm: str = "fedrep",
        clients_per_round: float | int = 0.1,
        head_epochs: int = 10,
        body_epochs: int = 1,
        local_epochs: int = 1,
        phases: Sequence[Phase | dict] | None = None,
        weighting: Literal["samples", "uniform"] = "samples",
        client_optimizer_state: Literal["reset", "keep"] = "reset",
        buffers: Literal["shared", "local"] = "shared",
        allow_frozen: bool = False,
        seed: int = 0,
        headline_metrics: bool = True,
        device: str | torch.device | None = None,
        **kwargs: Any,
    ):
        super().__init__(device=device or "cpu", **kwargs)
        # Lightning fills ``parallel_devices`` from ``Trainer(accelerator=..., devices=...)``; the
        # device then comes from there (SingleDeviceStrategy alone would stay on the CPU).
        self.parallel_devices = [torch.device(device)] if device is not None else None
        self.algorithm: Algorithm = get_algorithm(algorithm)
        if weighting not in ("samples", "uniform"):
            raise ValueError(f"weighting must be 'samples' or 'uniform', got {weighting!r}.")
        if client_optimizer_state not in ("reset", "keep"):
            raise ValueError(
                f"client_optimizer_state must be 'reset' or 'keep', got {client_optimizer_state!r}."
            )
        if buffers not in ("shared", "local"):
            raise ValueError(f"buffers must be 'shared' or 'local', got {buffers!r}.")
        self.head = head
        self.clients_per_round = clients_per_round
        self.phases = (
            parse_phases(phases)
            if phases is not None
            else self.algorithm.default_phases(head_epochs, body_epochs, local_epochs)
        )
        self.weighting = weighting
        self.client_optimizer_state = client_optimizer_state
        self.buffers = buffers
        self.allow_frozen = allow_frozen
        self.seed = seed
        self.headline_metrics = headline_metrics

        self.split: ParameterSplit | None = None
        self.shared_names: list[str] = []
        self.local_names: list[str] = []
        self.store: ClientStore | None = None
        self.global_state: list[Tensor] | None = None
        self._tensors_cache: dict[str, Tensor] | None = None
        self._client_sizes: list[int] | None = None
        self._batch_size = 1
        self._plans: dict[int, RoundPlan] = {}
        self._round_open = False
        self._round_index = -1
        self._average = None
        self._live_client: int | None = None
        self._live_part: str | None = None
        self._pending: dict[str, Any] | None = None
        self._eval_loader: EvalLoader | None = None
        self._eval_client: int | None = None
        self._eval_stash: list[Tensor] | None = None
        self._eval_metrics: ClientMetrics | None = None
        self.client_metrics: dict[str, ClientMetrics] = {}
        self.history: list[dict[str, Any]] = []
        """One entry per validated federated round: ``{"round": r, "val/acc": ..., ...}`` (client means)."""
        self._round_specs: dict[int, RoundSpec] = {}
        self._client_selector: Callable[[int, list[int]], list[int]] | None = None
        self._loss_terms: list[Callable[..., Tensor | None]] = []
        self._aggregating = True
        self._finetune_summary: dict[str, float] = {}

    # ------------------------------------------------------------------ devices (P15)
    @property
    def root_device(self) -> torch.device:
        if self.parallel_devices:
            return self.parallel_devices[0]
        return self._root_device

    # ------------------------------------------------------------------ public surface
    @property
    def current_client(self) -> int | None:
        """The client whose state the live module holds during training (``None`` between rounds)."""
        return self._live_client

    @property
    def current_phase(self) -> str | None:
        """What trains right now: ``"head"``, ``"body"`` or ``"all"``."""
        return self._live_part

    @property
    def num_clients(self) -> int:
        self._require_data()
        return len(self._client_sizes)

    def round_plan(self, round_index: int) -> RoundPlan:
        """The frozen plan of a round: sampled clients, in order, with their phases' step counts."""
        self._require_data()
        plan = self._plans.get(round_index)
        if plan is None:
            spec = self._round_specs.get(round_index)
            if spec is not None:
                clients = (
                    list(spec.clients) if spec.clients is not None else list(range(len(self._client_sizes)))
                )
                phases = spec.phases
            else:
                clients = sample_clients(
                    len(self._client_sizes), self.clients_per_round, self.seed, round_index
                )
                if self._client_selector is not None:
                    clients = self._checked_selection(round_index, clients)
                phases = self.phases
            plan = plan_round(round_index, clients, phases, self._client_sizes, self._batch_size, spec)
            self._plans = {r: p for r, p in self._plans.items() if r >= round_index - 1}
            self._plans[round_index] = plan
        return plan

    def _checked_selection(self, round_index: int, pool: list[int]) -> list[int]:
        selected = sorted(self._client_selector(round_index, list(pool)))
        if not selected or not set(selected) <= set(pool):
            raise ValueError(
                f"The client selector chose {selected} for round {round_index}; it must choose a non-empty "
                f"subset of the round's sampled clients {pool}."
            )
        return selected

    def schedule_round(self, round_index: int, spec: RoundSpec) -> None:
        """Run round ``round_index`` as ``spec`` says instead of as a usual round of the algorithm.

        For callbacks such as :class:`~lightning_fedrep.callbacks.HeadFineTuning`; call it before the
        round starts (e.g. in ``on_fit_start``) and extend ``trainer.fit_loop.max_epochs`` to include it.
        """
        self._round_specs[round_index] = spec
        self._plans.pop(round_index, None)

    def set_client_selector(self, selector: Callable[[int, list[int]], list[int]] | None) -> None:
        """Choose which of a round's sampled clients train: ``selector(round, pool) -> subset``.

        It is called once per round, when the round is planned (at its start), so it may use what
        was measured in earlier rounds (latency-aware participation). It must be deterministic given
        its own state for a resumed run to repeat the same rounds.
        """
        self._client_selector = selector
        self._plans = {}

    def add_loss_term(self, term: Callable[..., Tensor | None]) -> None:
        """Add ``term(module, batch, batch_idx, client, phase) -> Tensor | None`` to every training loss.

        It runs in the strategy's ``training_step`` right after the user's, with the live client and
        phase; returning ``None`` adds nothing. Automatic optimization only.
        """
        self._loss_terms.append(term)

    def client_tensors(self, client: int) -> dict[str, Tensor]:
        """The tensors specific to ``client`` (its local part and any fine-tuned part), by name. A copy."""
        self._require_state()
        tensors = {n: t.detach().clone() for n, t in zip(self.local_names, self.store.get(client))}
        tensors.update({n: t.detach().clone() for n, t in self.store.finetuned.get(client, {}).items()})
        return tensors

    def update_client(self, client: int, tensors: dict[str, Tensor]) -> None:
        """Overwrite some of ``client``'s local tensors (e.g. a server step on the heads)."""
        self._require_state()
        unknown = set(tensors) - set(self.local_names)
        if unknown:
            raise KeyError(
                f"{sorted(unknown)} are not local to a client; local tensors are {self.local_names}."
            )
        current = [t.detach().clone() for t in self.store.get(client)]
        for i, name in enumerate(self.local_names):
            if name in tensors:
                current[i] = tensors[name].detach().to(current[i].device, current[i].dtype)
        self.store.put(client, current)
        if client == self._live_client:
            self._write(self.local_names, current)

    def global_tensors(self) -> dict[str, Tensor]:
        """The global shared part, by name (a copy)."""
        self._require_state()
        return {n: t.detach().clone() for n, t in zip(self.shared_names, self.global_state)}

    def update_global(self, tensors: dict[str, Tensor]) -> None:
        """Overwrite some of the global shared tensors (e.g. a server-side step after aggregation)."""
        self._require_state()
        index = {n: i for i, n in enumerate(self.shared_names)}
        unknown = set(tensors) - set(index)
        if unknown:
            raise KeyError(f"{sorted(unknown)} are not shared; shared tensors are {self.shared_names}.")
        for name, value in tensors.items():
            self.global_state[index[name]].copy_(value.detach())
        if not self._round_open:
            self._write(self.shared_names, self.global_state)

    def results(self) -> dict[str, dict[str, float]]:
        """The papers' figures: the last validated federated round (``final``) and the mean over the
        last 10 validated rounds (``last10``) of every metric, plus the last fine-tuning evaluation."""
        out: dict[str, dict[str, float]] = {}
        if self.history:
            out["final"] = {k: v for k, v in self.history[-1].items() if k != "round"}
            last = self.history[-10:]
            out["last10"] = {
                k: sum(h[k] for h in last) / len(last) for k in out["final"] if all(k in h for h in last)
            }
        if self._finetune_summary:
            out["finetune"] = dict(self._finetune_summary)
        return out

    def client_for(self, batch_idx: int, round_index: int | None = None) -> int:
        """The client that trains on the ``batch_idx``-th batch of a round (the current one by default).

        Callbacks' ``on_train_batch_start`` runs before the strategy switches clients; they call this
        to know which client the batch is for.
        """
        r = self.lightning_module.trainer.current_epoch if round_index is None else round_index
        return self.round_plan(r).locate(batch_idx).client

    def client_state_dict(self, client: int) -> dict[str, Tensor]:
        """A ``state_dict`` of the user's module personalized for ``client``: the global shared part
        plus that client's local part. Load it into a fresh instance of the module to predict."""
        self._require_state()
        state = {k: v.detach().clone() for k, v in self.lightning_module.state_dict().items()}
        for name, value in zip(self.shared_names, self.global_state):
            state[name] = value.detach().clone()
        for name, value in self.client_tensors(client).items():
            state[name] = value
        return state

    def client_model(self, client: int) -> L.LightningModule:
        """A copy of the user's module holding ``client``'s personalized model (for prediction or export)."""
        module = copy.deepcopy(self.lightning_module)
        module.load_state_dict(self.client_state_dict(client))
        return module

    def new_client_model(self) -> L.LightningModule:
        """What the federation gives a client that never trained: the global shared part with the
        initial local part (for FedAvg, the global model). The starting point of new clients."""
        return self.client_model(-1)

    # ------------------------------------------------------------------ set-up
    def connect(self, model: L.LightningModule) -> None:
        """Resolve the body/head split as soon as the Trainer hands over the module."""
        super().connect(model)
        _use_federated_progress_bar(model.trainer)
        self.split = None
        if any(True for _ in model.parameters()):  # else the module builds its layers in configure_model
            self._resolve_split(model)

    def _resolve_split(self, model: torch.nn.Module) -> None:
        needs_head = self.algorithm.needs_split or any(p.train != "all" for p in self.phases)
        has_marking = self.head is not None or getattr(model, "fedrep_head", None) is not None
        if needs_head or has_marking:
            self.split = resolve_split(model, self.head, allow_frozen=self.allow_frozen)
        else:
            frozen = tuple(n for n, p in model.named_parameters() if not p.requires_grad)
            if frozen and not self.allow_frozen:
                raise SplitError(
                    f"Parameters {list(frozen)} have requires_grad=False; unfreeze them or pass allow_frozen=True."
                )
            body = tuple(n for n, p in model.named_parameters() if p.requires_grad)
            self.split = ParameterSplit(head=(), body=body, frozen=frozen)
        shared_parts = {"body": ("body",), "head": ("head",), "all": ("body", "head"), "none": ()}
        shared = shared_parts[self.algorithm.shared]
        names = [n for n, _ in model.named_parameters()]
        self.shared_names = [n for n in names if self.split.group(n) in shared]
        self.local_names = [
            n for n in names if self.split.group(n) in ("body", "head") and n not in self.shared_names
        ]
        buffer_names = [n for n, _ in model.named_buffers() if n in model.state_dict()]
        buffers_shared = self.buffers == "shared" and self.algorithm.shared in ("body", "all")
        (self.shared_names if buffers_shared else self.local_names).extend(buffer_names)
        self._tensors_cache = None

    def setup(self, trainer: L.Trainer) -> None:
        """Check the Trainer's settings (fit only), then snapshot the global and template state."""
        if trainer.training or trainer.state.fn == "fit":
            self._check_trainer_flags(trainer)
        if self.split is None:
            self._resolve_split(self.lightning_module)
        super().setup(trainer)
        self._tensors_cache = None
        if trainer.state.fn == "fit":
            self._check_optimizers()
        if self.store is None:
            self.global_state = [t.detach().clone() for t in self._tensors(self.shared_names)]
            self.store = ClientStore(self._tensors(self.local_names))
        else:
            self.global_state = [t.to(self.root_device) for t in self.global_state]
            self.store.to(self.root_device)

    def _check_trainer_flags(self, trainer: L.Trainer) -> None:
        if any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks):
            raise ValueError(
                "GradientAccumulationScheduler would accumulate gradients across different clients' batches. "
                "Remove it and use a larger batch_size in the data module instead."
            )
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"accumulate_grad_batches={trainer.accumulate_grad_batches} would accumulate gradients across "
                "different clients' batches. Use a larger batch_size in the data module instead."
            )
        if trainer.overfit_batches:
            raise ValueError(
                "overfit_batches is not supported: rounds are planned per client, not per batch."
            )
        limit = trainer.limit_train_batches
        if not trainer.fast_dev_run and (isinstance(limit, int) or limit != 1.0):
            raise ValueError(
                f"limit_train_batches={trainer.limit_train_batches} would cut every round short, so later "
                "clients of the round would never train. Use clients_per_round or fewer local epochs/steps "
                "for shorter rounds (fast_dev_run=True is allowed for smoke tests)."
            )
        if trainer.reload_dataloaders_every_n_epochs != 1:
            # Rounds may differ in length (clients differ in size); Lightning fixes the epoch length
            # when it loads the data, so the round loader is re-read every round (it is cheap).
            trainer.reload_dataloaders_every_n_epochs = 1

    def _check_optimizers(self) -> None:
        in_optimizer = {id(p) for opt in self.optimizers for g in opt.param_groups for p in g["params"]}
        named = dict(self.lightning_module.named_parameters())
        missing = [n for n in self.split.head + self.split.body if id(named[n]) not in in_optimizer]
        if missing:
            raise ValueError(
                f"Parameters {missing} are in no optimizer returned by configure_optimizers, so they would never "
                "train. Pass self.parameters() to the optimizer (the strategy freezes what each phase must not train)."
            )

    def process_dataloader(self, dataloader: object) -> object:
        """Bind the training ``RoundLoader`` to the round planner; remember the evaluation loader."""
        if isinstance(dataloader, RoundLoader):
            self._client_sizes = dataloader.client_sizes()
            self._batch_size = dataloader.batch_size
            self._plans = {}
            trainer = self.lightning_module.trainer
            dataloader.bind(lambda: self.round_plan(trainer.current_epoch))
            if self.round_plan(trainer.current_epoch).length == 0:
                raise ValueError(
                    "The round plan is empty: every phase has a zero budget. Give epochs or steps > 0."
                )
            return dataloader
        if isinstance(dataloader, EvalLoader):
            self._eval_loader = dataloader
            return dataloader
        if self.lightning_module.trainer.state.fn == "predict":
            return dataloader
        raise TypeError(
            f"{type(self).__name__} needs the data of a FederatedDataModule (a RoundLoader for training and an "
            f"EvalLoader for evaluation), got {type(dataloader).__name__}. Build the data with "
            "lightning_fedrep.FederatedDataModule(train_set, test_set, partitioner=...) and pass it as datamodule=."
        )

    # ------------------------------------------------------------------ live-module tensors
    def _tensors(self, names: Sequence[str]) -> list[Tensor]:
        if self._tensors_cache is None:
            module = self.lightning_module
            self._tensors_cache = {**dict(module.named_buffers()), **dict(module.named_parameters())}
        return [self._tensors_cache[n] for n in names]

    @torch.no_grad()
    def _write(self, names: Sequence[str], values: Sequence[Tensor]) -> None:
        targets = self._tensors(names)
        if targets:
            torch._foreach_copy_(targets, list(values))

    def _require_data(self) -> None:
        if self._client_sizes is None:
            raise RuntimeError(
                "The strategy has not seen the training data yet (it does at the start of fit)."
            )

    def _require_state(self) -> None:
        if self.store is None:
            raise RuntimeError("No federated state yet: call trainer.fit(...) or load a checkpoint first.")

    # ------------------------------------------------------------------ rounds
    def _begin_round(self, round_index: int) -> None:
        self._round_index = round_index
        self._round_open = True
        spec = self.round_plan(round_index).spec
        self._aggregating = spec is None or spec.aggregate
        if self._aggregating:
            self.store.finetuned.clear()  # a new federated round makes earlier fine-tuning stale
        self._average = (
            WeightedAverage(self.global_state) if self.shared_names and self._aggregating else None
        )

    def _client_weight(self, client: int) -> float:
        return float(self._client_sizes[client]) if self.weighting == "samples" else 1.0

    def _load_client_tensors(self, client: int) -> None:
        self._write(self.shared_names, self.global_state)
        self._write(self.local_names, self.store.get(client))
        finetuned = self.store.finetuned.get(client)
        if finetuned:
            self._write(list(finetuned), list(finetuned.values()))

    def _load_client(self, client: int) -> None:
        self._load_client_tensors(client)
        self._live_client = client
        self._live_part = None
        for index, optimizer in enumerate(self.optimizers):
            optimizer.state.clear()
            kept = self.store.optimizer_states.get(client, {}).get(index)
            if kept:
                params = [p for g in optimizer.param_groups for p in g["params"]]
                for param_index, state in kept.items():
                    optimizer.state[params[param_index]] = {
                        k: v.clone() if isinstance(v, Tensor) else v for k, v in state.items()
                    }

    def _finish_client(self) -> None:
        client = self._live_client
        if client is None:
            return
        if self._average is not None:
            self._average.add(self._tensors(self.shared_names), self._client_weight(client))
        if not self._aggregating:
            trained = {
                g for p in self.round_plan(self._round_index).spec.phases for g in _PART_GROUPS[p.train]
            }
            names = [n for n in self.shared_names if self.split.group(n) in trained]
            self.store.finetuned[client] = {
                n: t.detach().clone() for n, t in zip(names, self._tensors(names))
            }
        self.store.put(client, self._tensors(self.local_names))
        if self.client_optimizer_state == "keep":
            self.store.optimizer_states[client] = self._optimizer_snapshot()
        self._live_client = None
        self._live_part = None

    def _optimizer_snapshot(self) -> OptimizerState:
        """The optimizer state of the client's local parameters (the shared part restarts every round)."""
        local = {id(t) for t in self._tensors(self.local_names)}
        snapshot: OptimizerState = {}
        for index, optimizer in enumerate(self.optimizers):
            params = [p for g in optimizer.param_groups for p in g["params"]]
            snapshot[index] = {
                i: {
                    k: v.detach().clone() if isinstance(v, Tensor) else v
                    for k, v in optimizer.state[p].items()
                }
                for i, p in enumerate(params)
                if id(p) in local and optimizer.state.get(p)
            }
        return snapshot

    def _set_phase(self, part: str) -> None:
        trains = _PART_GROUPS[part]
        for name, param in self.lightning_module.named_parameters():
            group = self.split.group(name)
            if group != "frozen":
                param.requires_grad_(group in trains)
                if group not in trains:
                    param.grad = None
        self._live_part = part

    @torch.no_grad()
    def close_round(self) -> None:
        """Aggregate the round: average the clients' shared parts into the new global state.

        Runs after the round's last optimizer step; idempotent. Also runs at the end of training for
        a round cut short by ``max_steps`` or a stop request, averaging the clients that trained.
        """
        if not self._round_open:
            return
        self._finish_client()
        if self._average is not None and not self._average.empty:
            self.global_state = self._average.mean(self.global_state)
        self._write(self.shared_names, self.global_state)
        self._round_open = False
        self._average = None

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Switch the live module to the batch's client and phase (runs right before the step)."""
        round_index = self.lightning_module.trainer.current_epoch
        if self._round_open and self._round_index != round_index:
            self.close_round()
        if not self._round_open:
            self._begin_round(round_index)
        location = self.round_plan(round_index).locate(batch_idx)
        if location.client != self._live_client:
            self._finish_client()
            self._load_client(location.client)
        if location.part != self._live_part:
            self._set_phase(location.part)

    def _round_ends_now(self) -> bool:
        return self.lightning_module.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.lightning_module.automatic_optimization and self._round_ends_now():
            self.close_round()
        return output

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        if self._loss_terms:
            output = self._add_loss_terms(output, args, kwargs)
        if not self.lightning_module.automatic_optimization and self._round_ends_now():
            self.close_round()
        return output

    def _add_loss_terms(self, output: Any, args: tuple, kwargs: dict) -> Any:
        if not self.lightning_module.automatic_optimization:
            raise RuntimeError("Loss terms (add_loss_term) need automatic optimization.")
        batch = args[0] if args else kwargs["batch"]
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        loss = output["loss"] if isinstance(output, dict) else output
        if loss is None:
            return output
        for term in self._loss_terms:
            extra = term(self.lightning_module, batch, batch_idx, self._live_client, self._live_part)
            if extra is not None:
                loss = loss + extra
        if isinstance(output, dict):
            return {**output, "loss": loss}
        return loss

    def on_train_end(self) -> None:
        if self._round_open:
            rank_zero_warn(
                f"Training stopped inside round {self._round_index}; averaging the clients that trained in it."
            )
            self.close_round()
        for name, param in self.lightning_module.named_parameters():
            if self.split.group(name) != "frozen":
                param.requires_grad_(True)
        self._live_part = None
        super().on_train_end()

    # ------------------------------------------------------------------ evaluation
    def _eval_start(self) -> None:
        self._require_state()
        if self._round_open and self._live_client is not None:
            self._eval_stash = [
                t.detach().clone() for t in self._tensors(self.shared_names + self.local_names)
            ]
        self._write(self.shared_names, self.global_state)
        self._eval_client = None
        self._eval_metrics = ClientMetrics()

    def _eval_end(self, stage: str) -> None:
        if self._eval_metrics is not None and self._eval_metrics.samples:
            self.client_metrics[stage] = self._eval_metrics
        self._eval_metrics = None
        if self._eval_stash is not None:
            self._write(self.shared_names + self.local_names, self._eval_stash)
            self._eval_stash = None
        elif self._live_client is not None:
            self._write(self.local_names, self.store.get(self._live_client))
        self._eval_client = None

    def on_validation_start(self) -> None:
        self._eval_start()
        super().on_validation_start()

    def on_validation_end(self) -> None:
        trainer = self.lightning_module.trainer
        self._eval_end("sanity" if trainer.sanity_checking else "val")
        super().on_validation_end()

    def on_test_start(self) -> None:
        self._eval_start()
        super().on_test_start()

    def on_test_end(self) -> None:
        self._eval_end("test")
        super().on_test_end()

    def on_predict_start(self) -> None:
        """Predict with the model a new client gets (global shared part, initial local part); for a
        client's personalized predictions use ``client_model(i)``."""
        if self.store is not None:
            self._load_client_tensors(-1)
        super().on_predict_start()

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._personalized_step("val", super().validation_step, args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._personalized_step("test", super().test_step, args, kwargs)

    def _personalized_step(self, stage: str, step: Callable, args: tuple, kwargs: dict) -> Any:
        batch = args[0] if args else kwargs["batch"]
        batch_idx = args[1] if len(args) > 1 else kwargs["batch_idx"]
        client = self._eval_loader.client_of(batch_idx)
        if client != self._eval_client:
            if self.store.finetuned:
                self._load_client_tensors(client)
            else:
                self._write(self.local_names, self.store.get(client))
            self._eval_client = client
        metrics = self._eval_metrics
        size = batch_size_of(batch)
        metrics.samples[client] += size
        with capture_logs(self.lightning_module, metrics, client, size) as user_keys:
            output = step(*args, **kwargs)
        if self.headline_metrics and isinstance(batch, list | tuple) and len(batch) == 2:
            self._add_headline(stage, batch, client, size, user_keys)
        if self._evaluation_loop().batch_progress.is_last_batch:
            self._log_summary(stage, metrics)
        return output

    def _add_headline(self, stage: str, batch: Any, client: int, size: int, user_keys: set[str]) -> None:
        plugin = self.precision_plugin
        context = plugin.val_step_context if stage == "val" else plugin.test_step_context
        try:
            with torch.no_grad(), context():
                sums = headline_sums(self.lightning_module(batch[0]), batch[1])
        except Exception as error:  # the module's forward may not take ``x`` alone
            self.headline_metrics = False
            rank_zero_warn(
                f"Could not compute {stage}/acc and {stage}/loss from model(x) on (x, y) batches ({error!r}); "
                "they are turned off. Log your own metrics in validation_step/test_step, or pass "
                "headline_metrics=False to silence this."
            )
            return
        for name, total in (sums or {}).items():
            key = f"{stage}/{name}"
            if key not in user_keys:
                self._eval_metrics.add(key, client, total.item(), size)

    def _evaluation_loop(self) -> Any:
        trainer = self.lightning_module.trainer
        if trainer.state.fn == "fit":
            return trainer.fit_loop.epoch_loop.val_loop
        return trainer.validate_loop if trainer.state.fn == "validate" else trainer.test_loop

    def _log_summary(self, stage: str, metrics: ClientMetrics) -> None:
        """Log every metric's summary over clients; keep the federated rounds' history (validation)."""
        module = self.lightning_module
        trainer = module.trainer
        spec = self._round_specs.get(self._round_index) if stage == "val" else None
        prefix = spec.prefix if spec is not None else ""
        summaries = {name: metrics.summary(name) for name in list(metrics.sums)}
        values = {
            prefix + name + suffix: s[suffix] for name, s in summaries.items() for suffix in SUMMARY_SUFFIXES
        }
        if stage == "val" and not trainer.sanity_checking and trainer.state.fn == "fit":
            if prefix:
                self._finetune_summary = dict(values)
            else:
                entry = {"round": self._round_index, **values}
                self.history = [h for h in self.history if h["round"] != self._round_index] + [entry]
                last = self.history[-10:]
                for name in summaries:
                    if all(name in h for h in last):
                        values[name + "_last10"] = sum(h[name] for h in last) / len(last)
        for key, value in values.items():
            options = metrics.options.get(key.removeprefix(prefix), {})
            module.log(
                key,
                value,
                on_step=False,
                on_epoch=True,
                batch_size=1,
                prog_bar=options.get("prog_bar", key.endswith("/acc")),
                logger=options.get("logger"),
            )

    # ------------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's ``state_dict`` with the *global* shared part and the *initial* local part,
        so ``load_from_checkpoint`` of the user's module works and does not depend on which client
        happened to be live. Every client's local part is saved separately (``save_checkpoint``)."""
        state = super().lightning_module_state_dict()
        if self.store is None:
            return state
        state = dict(state)
        for name, value in zip(self.shared_names, self.global_state):
            state[name] = value.detach().clone()
        for name, value in zip(self.local_names, self.store.template):
            state[name] = value.detach().clone()
        return state

    def federated_state_dict(self) -> dict[str, Any]:
        """Everything needed to resume the federation exactly (saved under ``checkpoint["lightning_fedrep"]``)."""
        self._require_state()
        state: dict[str, Any] = {
            "version": _STATE_VERSION,
            "algorithm": self.algorithm.name,
            "shared_names": list(self.shared_names),
            "local_names": list(self.local_names),
            "global": [t.detach().clone() for t in self.global_state],
            "clients": self.store.state_dict(),
            "round": {"open": self._round_open, "index": self._round_index},
            "history": [dict(h) for h in self.history],
            "torch_rng": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda_rng"] = torch.cuda.get_rng_state_all()
        if self._round_open:
            state["round"].update(
                live_client=-1 if self._live_client is None else self._live_client,
                live_part=self._live_part or "",
                # saved during mid-round validation, the training state is in the stash
                live_tensors=self._eval_stash
                if self._eval_stash is not None
                else [t.detach().clone() for t in self._tensors(self.shared_names + self.local_names)],
                average=self._average.state_dict() if self._average is not None else None,
            )
        return state

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self.store is not None:
            checkpoint[CHECKPOINT_KEY] = self.federated_state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._pending = checkpoint.get(CHECKPOINT_KEY)
        if self._pending is None:
            rank_zero_info(
                "The checkpoint has no federated state; every client starts from the module's head."
            )
        return checkpoint

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """Restore the module, the global state and every client's local part (all stages)."""
        super().load_model_state_dict(checkpoint, strict=strict)
        if self.split is None:
            self._resolve_split(self.lightning_module)
        state = self._pending
        if state is None:
            return
        if state["shared_names"] != self.shared_names or state["local_names"] != self.local_names:
            raise ValueError(
                f"The checkpoint's federated state was saved with algorithm {state['algorithm']!r} sharing "
                f"{state['shared_names']} and keeping {state['local_names']} local, but this strategy shares "
                f"{self.shared_names} and keeps {self.local_names}. Use the same algorithm and head as when saving."
            )
        device = self.lightning_module.device
        self.global_state = [t.to(device) for t in state["global"]]
        self.store = ClientStore([])
        self.store.load_state_dict(state["clients"], device)
        self.history = [dict(h) for h in state.get("history", [])]

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Restore an interrupted round and the RNG (fit only, after the optimizers exist)."""
        super().load_optimizer_state_dict(checkpoint)
        state, self._pending = self._pending, None
        if state is None:
            return
        torch.set_rng_state(state["torch_rng"])
        if "cuda_rng" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        round_state = state["round"]
        self._round_index = round_state["index"]
        self._round_open = round_state["open"]
        progress = self.lightning_module.trainer.fit_loop.epoch_loop.batch_progress
        if not self._round_open and progress.is_last_batch and progress.current.completed > 0:
            # Saved right after a round's last step. Lightning decides whether the restored epoch is
            # over by comparing its batch count with the *next* epoch's length, which is wrong when
            # rounds differ in length; a count no round can reach makes it start the next round at 0.
            progress.current.completed = 2**62
        if not self._round_open:
            return
        self._average = None
        if round_state["average"] is not None:
            self._average = WeightedAverage(self.global_state)
            self._average.load_state_dict(round_state["average"])
        self._write(self.shared_names + self.local_names, round_state["live_tensors"])
        self._live_client = None if round_state["live_client"] < 0 else round_state["live_client"]
        self._live_part = None
        if self._live_client is not None and round_state["live_part"]:
            self._set_phase(round_state["live_part"])


def _use_federated_progress_bar(trainer: L.Trainer) -> None:
    """Replace Lightning's default progress bar (not a user's own) by one that shows rounds and clients."""
    from lightning.pytorch.callbacks import TQDMProgressBar

    from lightning_fedrep.callbacks.progress import FederatedProgressBar

    for index, callback in enumerate(trainer.callbacks):
        if type(callback) is TQDMProgressBar:
            trainer.callbacks[index] = FederatedProgressBar(
                refresh_rate=callback.refresh_rate, leave=callback._leave
            )
