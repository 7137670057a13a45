"""Studies that compare algorithms: `sage-study`'s grid of runs over seeds (`grid`), its report with
crossed seeds x problems intervals (`report`, `intervals`), and the closed-form toys on an enumerable
task (the `toy` package)."""
