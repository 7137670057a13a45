"""The closed-form toys on an enumerable task (docs/convergence.md, docs/results/toy.md): the task
(`enumerable`), the tabular toy and its ways of training (`tabular`), the coverage toy (`coverage`),
their summaries and figures (`report`), all run by `command` (``sage-study --toy``); and the coverage
toy trained with sampled groups (`sampled`, docs/results/toy-sampled)."""
