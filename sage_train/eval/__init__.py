"""Evaluation: the unbiased pass@k estimator over seeds (`evaluate`), and `sage-eval` around it: its
options and settings (`settings`), models (`models`), resumable records (`records`) and the command
(`command`)."""
