"""``python -m lightning_fedrep.cli`` (the README's ``torchrun`` command): the ``lightning-fedrep`` command,
which lives in :mod:`lightning_fedrep.app.cli`."""

from lightning_fedrep.app.cli import main

if __name__ == "__main__":
    main()
