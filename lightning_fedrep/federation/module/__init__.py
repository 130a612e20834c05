"""The user's module and its training batches as the federation and the runners see them, with no Lightning:
which parameters are body and head (:mod:`.split`), the module as ``head(features(x))`` (:mod:`.feature_split`),
the loss it declares (:mod:`.losses`), calls on given tensors (:mod:`.stateless`), probes that leave it as it
was (:mod:`.untouched`), how many samples one pass of a feature cache reads (:mod:`.feature_chunks`), and a
training batch as ``(inputs, targets)`` tensors (:mod:`.batches`).
"""
