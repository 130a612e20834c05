"""``python -m lightning_fedrep.cli`` (the ``torchrun`` command of docs/distributed.md): the ``lightning-fedrep`` command,
which lives in :mod:`lightning_fedrep.app.cli`."""

from lightning_fedrep.app.cli import main

if __name__ == "__main__":
    main()
