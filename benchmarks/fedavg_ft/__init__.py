"""FedAvg with Fine Tuning (Collins et al., NeurIPS 2022): local steps learn the representation."""
