"""The checkpoint format of a federated fit, with no Lightning: the federated entry the strategy writes into a
checkpoint and reads back (:mod:`.entry`), the checks a stored checkpoint passes before any of it is used
(:mod:`.reading`), and a client's personalized model read out of one without a Trainer (:mod:`.export`).
"""
