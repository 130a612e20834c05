"""The runners of a round's local work, behind :class:`~lightning_fedrep.federation.run.Runner`:
:mod:`~lightning_fedrep.runners.sequential` (one client step per Lightning step),
:mod:`~lightning_fedrep.runners.lockstep` (the vectorized runner), both
wrapped by :mod:`~lightning_fedrep.runners.sharded` (one process's share of a round), chosen by
:mod:`~lightning_fedrep.runners.selection` (which reports why: :mod:`~lightning_fedrep.runners.runner_report`).
No Lightning here: the face hands in :class:`~lightning_fedrep.runners.constraints.Constraints`.
"""
