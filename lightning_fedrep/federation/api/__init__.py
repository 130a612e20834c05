"""The algorithm API: what an algorithm module (and a federated callback's objective) is written on.

:mod:`.algorithm` (``Phase``, ``Algorithm``: what is shared, the local phases, the server step),
:mod:`.registry` (algorithms by name), :mod:`.epochs` (the epoch shorthands), :mod:`.declared` (extra per-client
and server tensors), :mod:`.exchange` (what a client hands back, the server state, the round's results),
:mod:`.scoring` (what evaluation scores), :mod:`.objective` (loss terms and step rules),
:mod:`.aggregation` (the aggregators), :mod:`.server_optimizer` (a server step after ``aggregate``: FedOpt) and :mod:`.arguments` (the checks of constructor arguments every public class runs). No Lightning here.
"""
