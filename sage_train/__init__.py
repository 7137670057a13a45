"""sage_train: a thin RLVR trainer around the SAGE loss (`run.train` is a run, `step.rl_step` one step)."""
