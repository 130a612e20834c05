"""The application layer on top of the library: the ``lightning-fedrep`` command (:mod:`.cli`), its run
folders (:mod:`.runfolder`) and seed sweeps (:mod:`.seeds`), the figures and tables of finished runs
(:mod:`.report`, :mod:`.table`), the quickstart (:mod:`.quickstart`) and the silencing of messages a user
cannot act on (:mod:`.quiet`). Nothing in the library imports this package.
"""
