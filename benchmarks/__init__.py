"""The project's speed and reproduction scripts (never installed: ``pyproject.toml`` packages only
``lightning_fedrep``).

This file makes ``benchmarks`` a regular package. A folder without ``__init__.py`` is a namespace package,
and a namespace package loses to a regular package of the same name ANYWHERE on ``sys.path``: Opacus's
wheel (1.6.0) installs a top-level ``benchmarks`` package into site-packages, which then shadowed this
folder and broke every ``from benchmarks.fedrep ... import``. As a regular package, the repository's
``benchmarks`` wins whenever the repository comes first on the path, which the tests (pytest's
``pythonpath``) and the scripts (they insert the repository at ``sys.path[0]``) ensure.
"""
