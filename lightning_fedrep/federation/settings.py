"""The federated strategies' settings, checked and resolved without Lightning.

What a strategy's constructor does with its federated keyword arguments before any Trainer exists: refuse a bad
one (each error names the argument), resolve the algorithm, and build the :class:`FederationConfig` the
:class:`~lightning_fedrep.federation.Federation` runs with. Also the checks a strategy runs at ``setup`` that need
only the federation's objects or plain facts (another module than the federation's, a sharded store's callbacks,
a per-step LR schedule), and the signature decorator that gives a strategy class its federated settings. The
session (``session/session.py``) and the Lightning strategies (``lightning/strategy.py``, ``lightning/ddp.py``)
call these; the session holds the results.
"""

from __future__ import annotations

import copy
import inspect
import re
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

from lightning_fedrep.federation import Federation
from lightning_fedrep.federation.api.algorithm import Algorithm, Phase, parse_phases
from lightning_fedrep.federation.api.arguments import (
    check_bool,
    check_choice,
    check_clients_per_round,
    check_int,
)
from lightning_fedrep.federation.api.epochs import EPOCH_DEFAULTS, check_epoch_shorthands, default_phases
from lightning_fedrep.federation.api.registry import (
    ALGORITHMS,
    SERVER_OPTIMIZERS,
    get_algorithm,
    get_server_optimizer,
)
from lightning_fedrep.federation.api.server_optimizer import ServerOptimizer
from lightning_fedrep.federation.state import FederationConfig


def check_settings(
    head: Any,
    head_epochs: Any,
    body_epochs: Any,
    local_epochs: Any,
    allow_frozen: Any,
    headline_metrics: Any,
    seed: Any,
    predict: Any,
) -> None:
    """Refuse bad strategy arguments at construction (each error names the argument)."""
    check_head(head)
    for name, epochs in (
        ("head_epochs", head_epochs),
        ("body_epochs", body_epochs),
        ("local_epochs", local_epochs),
    ):
        check_int(name, epochs, minimum=0)
    for name, flag in (("allow_frozen", allow_frozen), ("headline_metrics", headline_metrics)):
        check_bool(name, flag)
    check_int("seed", seed)
    check_choice("predict", predict, ("auto", "new_client", "personalized"))


def check_evaluation_settings(
    allow_new_federation: Any, first_state: Any, evaluate_clients: Any, buffers: Any
) -> None:
    """Refuse bad strategy arguments at construction (the rest of :func:`check_settings`)."""
    check_bool("allow_new_federation", allow_new_federation)
    check_choice("first_state", first_state, ("initial", "average"))
    if evaluate_clients is not None:
        check_int("evaluate_clients", evaluate_clients, minimum=1)
    if buffers not in ("shared", "local"):
        raise ValueError(f"buffers must be 'shared' or 'local', got {buffers!r}.")


def check_head(head: Any) -> None:
    """Refuse a ``head`` that is neither ``None``, a name or prefix, a non-empty list of them nor a regex."""
    valid = head is None or isinstance(head, str | re.Pattern)
    if isinstance(head, Sequence) and not isinstance(head, str):
        valid = len(head) > 0 and all(isinstance(entry, str) and entry for entry in head)
    if not valid:
        raise TypeError(
            "head must be a module name or parameter-name prefix ('classifier'), a non-empty list of them, "
            f"a compiled regex (re.compile(...)), or None (the module's `fedrep_head`); got {head!r}."
        )


def strategy_algorithm(
    algorithm: str | Algorithm,
    server_optimizer: str | ServerOptimizer | None = None,
    owner: str = "FederatedStrategy",
) -> Algorithm:
    """The algorithm a strategy runs: a registered one is shared by name, so each strategy gets its own copy
    of its server state; an :class:`Algorithm` object is used as given. With ``server_optimizer`` (a registered
    name or a :class:`ServerOptimizer`), the algorithm's copy that steps with it (:func:`with_strategy_optimizer`)."""
    resolved = get_algorithm(algorithm)
    resolved = copy.deepcopy(resolved) if isinstance(algorithm, str) else resolved
    if server_optimizer is None:
        return resolved
    return with_strategy_optimizer(resolved, server_optimizer, owner)


def with_strategy_optimizer(
    algorithm: Algorithm, server_optimizer: str | ServerOptimizer, owner: str
) -> Algorithm:
    """``algorithm.with_server_optimizer(...)`` for a strategy's ``server_optimizer`` setting, refusing at
    construction, naming the setting, a wrong type, an unknown name, an algorithm that shares nothing and one
    that already steps with a server optimizer (``algorithm="fedadam"``)."""
    where = f"{owner}(server_optimizer=...)"
    if isinstance(server_optimizer, str):
        try:
            server_optimizer = get_server_optimizer(server_optimizer)
        except ValueError as unknown:
            raise ValueError(f"{where}: {unknown}") from None
    elif not isinstance(server_optimizer, ServerOptimizer):
        raise TypeError(
            f"{where} takes a registered name ({', '.join(map(repr, sorted(SERVER_OPTIMIZERS)))}) or a "
            f"ServerOptimizer such as FedAdam(lr=0.01), got {type(server_optimizer).__name__} ({server_optimizer!r})."
        )
    if algorithm.server_optimizer is not None:
        raise ValueError(
            f"{where}: algorithm {algorithm.name!r} already steps with {algorithm.server_optimizer!r}; pass "
            "server_optimizer with an algorithm that has none (algorithm='fedavg' for FedAvg), or drop it."
        )
    if not algorithm.shares:
        raise ValueError(
            f"{where}: algorithm {algorithm.name!r} shares nothing with the server, so a server optimizer has "
            "nothing to step; use an algorithm that shares the body, the head or both, or drop server_optimizer."
        )
    return algorithm.with_server_optimizer(server_optimizer)


def federation_config(
    algorithm: Algorithm,
    phases: Sequence[Phase | dict] | None,
    epochs: dict[str, Any],
    clients_per_round: int | float,
    owner: str,
    **settings: Any,
) -> FederationConfig:
    """The :class:`FederationConfig` of a strategy's settings: its explicit ``phases``, else the algorithm's
    default phases from the epoch shorthands (refusing a shorthand that would have no effect, named as
    ``owner``'s); ``settings`` are the config's other fields (``weighting``, ``seed``, ``privacy``, ...). A privacy
    mechanism checks the algorithm and the settings here."""
    check_epoch_shorthands(algorithm, phases is not None, epochs, EPOCH_DEFAULTS, owner=owner)
    config = FederationConfig(
        phases=parse_phases(phases) if phases is not None else default_phases(algorithm, epochs),
        clients_per_round=check_clients_per_round(clients_per_round),
        **settings,
    )
    if config.privacy is not None:  # refused at construction, not at the first round
        config.privacy.check(algorithm, config)
    return config


def takes_settings_of(settings: Callable[..., None]) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """A decorator giving an ``__init__(self, *args, <its own keyword settings>, **kwargs)`` the signature it
    really takes: the settings of ``settings`` (another ``__init__``) in place of ``*args``, then its own
    keyword-only settings, then ``**kwargs``. ``help()``, ``inspect.signature``, IDEs and LightningCLI read it."""

    def decorate(init: Callable[..., None]) -> Callable[..., None]:
        own = inspect.signature(init, eval_str=True)
        federated = inspect.signature(settings, eval_str=True)
        variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        self_parameter, *own_parameters = own.parameters.values()
        shared = [p for name, p in federated.parameters.items() if name != "self" and p.kind not in variadic]
        keywords = [p for p in own_parameters if p.kind is inspect.Parameter.KEYWORD_ONLY]
        rest = [p for p in own_parameters if p.kind is inspect.Parameter.VAR_KEYWORD]
        init.__signature__ = own.replace(parameters=[self_parameter, *shared, *keywords, *rest])
        return init

    return decorate


def refuse_another_module(federation: Federation | None, module: Any, restored: bool, call: str) -> None:
    """A federation holds a body and one head per client; a module passed to a later ``fit``/``validate``/
    ``test`` (``call``) without ``ckpt_path`` holds one model, whose weights the federation's would silently
    replace."""
    held = federation.module if federation is not None and federation.has_state else None
    if held is None or held is module or restored:
        return
    raise ValueError(
        f"trainer.{call}() was given another module than the one this strategy's federation holds (from an "
        "earlier fit or checkpoint): its weights would be replaced by the federation's global body and "
        f"per-client heads without a word. To evaluate a checkpoint, pass ckpt_path (trainer.{call}(model, "
        f"ckpt_path='best') restores its body and every client's head); to use the federation, pass the module "
        f"it was fitted with (trainer.lightning_module); to start from this module's own weights, use a new "
        "strategy (and Trainer)."
    )


def refuse_several_processes(owner: str, algorithm: str, devices: int, nodes: int) -> None:
    """Refuse several devices or nodes for the one-process strategy ``owner``, naming the DDP strategy of its
    ``algorithm`` (a registered name; else FedRep's)."""
    if devices > 1 or nodes > 1:
        name = algorithm if algorithm in ALGORITHMS else "fedrep"
        given = f"devices={devices}" if devices > 1 else f"num_nodes={nodes}"
        raise ValueError(
            f"{owner} runs on one device, but the Trainer was given {given}. For several "
            f"processes use strategy='{name}_ddp' (lightning_fedrep.FederatedDDPStrategy), or pass devices=1 "
            "and num_nodes=1."
        )


def process_settings(timeout: Any, client_store: Any) -> timedelta:
    """Refuse bad settings of the several-process strategy at construction; ``timeout`` as a ``timedelta``."""
    if not isinstance(timeout, timedelta):
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError(f"timeout must be a number of seconds > 0 or a timedelta, got {timeout!r}.")
        timeout = timedelta(seconds=timeout)
    if client_store not in ("replicated", "sharded"):
        raise ValueError(f"client_store must be 'replicated' or 'sharded', got {client_store!r}.")
    return timeout


def refuse_callbacks_needing_every_client(callbacks: Iterable[Any]) -> None:
    """With ``client_store="sharded"``, refuse callbacks that read every client's state on every process."""
    needy = [type(c).__name__ for c in callbacks if c.needs_every_client]
    if needy:
        raise ValueError(
            f"{', '.join(needy)} read(s) every client's state on every process, but client_store='sharded' "
            "keeps each client on one rank. Use client_store='replicated' (the default)."
        )


def refuse_lockstep_settings(
    owner: str, manual_fit: bool, sync_batchnorm: bool, model_averaging: bool
) -> None:
    """Refuse what would make several processes' steps drift apart or mix clients (``owner``: the strategy)."""
    problems = []
    if manual_fit:
        problems.append(
            "manual optimization (a rank with nothing to train in a step would not step its optimizer, and "
            "the ranks' step counts, on which Lightning synchronizes, would drift apart)"
        )
    if sync_batchnorm:
        problems.append(
            "sync_batchnorm=True (a collective in every forward pass, and clients' statistics mixed)"
        )
    if model_averaging:
        problems.append("DDP model averaging (it would average different clients' models every step)")
    if problems:
        raise ValueError(
            f"{owner} cannot run with {'; '.join(problems)}. Remove it, or train on one process "
            "(FederatedStrategy)."
        )


def check_lr_schedulers(lr_scheduler_configs: Sequence[Any], automatic_optimization: bool) -> None:
    """Refuse an LR scheduler that Lightning steps at every training step (``interval="step"``; of each of the
    ``lr_scheduler_configs`` only its ``interval`` and ``scheduler`` are read): a Lightning step is one client's
    local step (on the vectorized runner, a step of every client of a group), so the schedule would tick across
    the round's clients, and each client would train at another point of it, by its place in the round. Under
    manual optimization Lightning steps no scheduler (the module does)."""
    stepped = [c for c in lr_scheduler_configs if c.interval == "step"] if automatic_optimization else []
    if stepped:
        name = type(stepped[0].scheduler).__name__
        raise ValueError(
            f"The LR scheduler {name} has interval='step': Lightning would step it at every training step, "
            "across clients, so in one round each client would train at another learning rate (the first "
            "client at the schedule's start, the last one after every earlier client's steps). Return "
            "{'scheduler': ..., 'interval': 'epoch'} from configure_optimizers: it steps once per round (one "
            "Lightning epoch is one communication round), and every client of a round trains at the same rate."
        )


_LOST_PEER = re.compile(r"Connection (closed|reset) by peer|timed out|Timeout|Broken pipe|watchdog", re.I)
"""How torch.distributed reports that a peer process is gone or did not answer (gloo and NCCL)."""


def note_lost_peer(exception: BaseException, timeout: Any) -> None:
    """Say in ``exception``'s message when its cause is another process (it died, or did not answer within
    ``timeout``), whose own log holds the reason."""
    if exception.args and isinstance(exception.args[0], str) and _LOST_PEER.search(str(exception)):
        exception.args = (
            f"{exception.args[0]}\nlightning_fedrep: another process of this federated run stopped, or did not "
            f"answer within timeout={timeout}; its own output says why. A checkpoint written at the end "
            "of a round resumes on any number of processes.",
            *exception.args[1:],
        )
