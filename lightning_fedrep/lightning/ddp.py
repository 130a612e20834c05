"""``FederatedDDPStrategy``: the federated strategy on several processes (GPUs, nodes).

Lightning's DDP machinery launches the processes (``Trainer(devices=N, num_nodes=M)``, ``torchrun``,
SLURM) and creates the process group; the model is *not* wrapped in ``DistributedDataParallel``:
clients are independent, so nothing is reduced per step. Each round's clients are dealt to the ranks
(balanced by steps), every rank runs the same number of Lightning steps (idle steps pad the shorter
ranks), and the round ends with one all-reduce of the weighted sums and one all-gather of what each
rank's clients did. By default every rank then holds every client's state (``client_store=
"replicated"``), so callbacks and evaluation see the whole federation on every rank; with
``client_store="sharded"`` each rank holds only its own clients (client ``c`` on rank ``c % N``), lends
the ones another rank trains for the round, and rank 0 gathers them all for a checkpoint.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any, Literal

import lightning as L
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_fedrep.federation.api.registry import ALGORITHMS
from lightning_fedrep.federation.collective import ProcessGroupCollective
from lightning_fedrep.lightning import internals
from lightning_fedrep.lightning.strategy import FederatedStrategyMixin, takes_federated_settings

_LOST_PEER = re.compile(r"Connection (closed|reset) by peer|timed out|Timeout|Broken pipe|watchdog", re.I)
"""How torch.distributed reports that a peer process is gone or did not answer (gloo and NCCL)."""


class FederatedDDPStrategy(FederatedStrategyMixin, DDPStrategy):
    """Personalized federated learning on several processes: one round's clients sharded over ranks.

    Takes every federated setting of :class:`~lightning_fedrep.FederatedStrategy`
    (``head``, ``algorithm``, ``clients_per_round``, ``head_epochs``, ``body_epochs``, ``phases``,
    ``runner``, ...) and Lightning's DDP process settings:

    Args:
        client_store: ``"replicated"``: every rank holds every client's state (memory: the whole store per
            rank; every callback works as on one process). ``"sharded"``: each rank holds its own clients
            (client ``c`` on rank ``c % N``; memory: 1/N of the store); callbacks that read every client
            (``needs_every_client``, e.g. ``NeuralCollapse``) are refused, and after ``fit`` a client is
            read on the rank holding it, or everywhere after ``gather_clients()``.
        timeout: seconds (or a ``timedelta``) a collective waits for the other processes before failing:
            a process that died makes the others fail with an error after at most this long.
        process_group_backend: ``"nccl"`` (GPUs) or ``"gloo"`` (CPUs); by default Lightning's choice for
            the device.
        start_method: how Lightning starts the processes when it launches them itself (``"popen"``
            re-runs the script; ``"spawn"``/``"fork"``/``"forkserver"`` for notebooks and the like).

    Registered as ``"fedrep_ddp"``, ``"fedper_ddp"``, ``"lg_fedavg_ddp"``, ``"fedavg_ddp"``, ``"local_ddp"``.
    """

    strategy_name = "federated_ddp"

    @takes_federated_settings
    def __init__(
        self,
        *args: Any,
        client_store: Literal["replicated", "sharded"] = "replicated",
        timeout: float | timedelta = 1800.0,
        process_group_backend: str | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ):
        if not isinstance(timeout, timedelta):
            if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
                raise ValueError(f"timeout must be a number of seconds > 0 or a timedelta, got {timeout!r}.")
            timeout = timedelta(seconds=timeout)
        if client_store not in ("replicated", "sharded"):
            raise ValueError(f"client_store must be 'replicated' or 'sharded', got {client_store!r}.")
        self.client_store = client_store
        super().__init__(
            *args,
            timeout=timeout,
            process_group_backend=process_group_backend,
            start_method=start_method,
            **kwargs,
        )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"<algorithm>_ddp"`` for every registered algorithm (``"fedrep_ddp"``, ...)."""
        for name, algorithm in ALGORITHMS.items():
            if f"{name}_ddp" not in strategy_registry:
                strategy_registry.register(
                    f"{name}_ddp",
                    cls,
                    description=f"{algorithm.description} (several processes)",
                    algorithm=name,
                )

    @override
    def setup_environment(self) -> None:
        """Called before the data and the module are set up: create the process group (Lightning), then
        the federation's collectives on it."""
        super().setup_environment()
        self.collective = ProcessGroupCollective()

    @override
    def setup(self, trainer: L.Trainer) -> None:
        """Called after the module's and the data's ``setup``: refuse what needs every rank to step
        together (manual optimization, synchronized batch norm, model averaging), set up as on one
        process, then, with a sharded client store, keep only this rank's clients (refusing callbacks
        that read every client)."""
        self._refuse_lockstep_settings(trainer)
        super().setup(trainer)
        if self.client_store != "sharded":
            return
        needy = [type(c).__name__ for c in self._callbacks if c.needs_every_client]
        if needy:
            raise ValueError(
                f"{', '.join(needy)} read(s) every client's state on every process, but client_store='sharded' "
                "keeps each client on one rank. Use client_store='replicated' (the default)."
            )
        self.federation.shard_clients()

    def _refuse_lockstep_settings(self, trainer: L.Trainer) -> None:
        problems = []
        if trainer.state.fn == "fit" and not self.lightning_module.automatic_optimization:
            problems.append(
                "manual optimization (a rank with nothing to train in a step would not step its optimizer, and "
                "the ranks' step counts, on which Lightning synchronizes, would drift apart)"
            )
        if self._layer_sync is not None:
            problems.append(
                "sync_batchnorm=True (a collective in every forward pass, and clients' statistics mixed)"
            )
        if self._ddp_comm_state is not None or self._model_averaging_period is not None:
            problems.append("DDP model averaging (it would average different clients' models every step)")
        if problems:
            raise ValueError(
                f"{type(self).__name__} cannot run with {'; '.join(problems)}. Remove it, or train on one process "
                "(FederatedStrategy)."
            )

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Called when training fails: say so when the cause is another process (it died, or did not
        answer within ``timeout``), whose own log holds the reason."""
        super().on_exception(exception)
        text = str(exception)
        if exception.args and isinstance(exception.args[0], str) and _LOST_PEER.search(text):
            exception.args = (
                f"{exception.args[0]}\nlightning_fedrep: another process of this federated run stopped, or did not "
                f"answer within timeout={self._timeout}; its own output says why. A checkpoint written at the end "
                "of a round resumes on any number of processes.",
                *exception.args[1:],
            )

    @override
    def configure_ddp(self) -> None:
        """Called in ``setup`` (fit): no ``DistributedDataParallel`` wrapper. Clients are independent; what
        they share is aggregated once per round, not reduced at every backward. What the wrapper would
        have done at its start is done here: every rank starts from rank 0's module (else an unseeded
        run would average bodies of different initializations and hand out rank-dependent heads)."""
        internals.broadcast_module_from_rank_zero(self.model)
