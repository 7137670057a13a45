"""sage_train: a thin RLVR trainer around the SAGE loss (see `trainer.py` for the loop)."""
