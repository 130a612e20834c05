"""FedRep (Collins et al., ICML 2021): Figs. 1 and 4 on the low-rank linear problem, the family on digits."""
