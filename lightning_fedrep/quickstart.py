"""``python -m lightning_fedrep.quickstart`` (the README's quickstart): runs
:mod:`lightning_fedrep.app.quickstart`."""

from lightning_fedrep.app.quickstart import main

if __name__ == "__main__":
    main()
