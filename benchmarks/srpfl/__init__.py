"""SRPFL (Tziotis et al., TMLR 2023): FedRep-SRPFL vs FedRep on the low-rank linear problem."""
