"""The toy studies' command: `python -m sage_train.study.toy.command --out DIR [options]`, also
``sage-study --toy``; the tabular toy (`sage_train.study.toy.tabular`), then the coverage toy
(`sage_train.study.toy.coverage`), each with its files and plots in DIR."""

from __future__ import annotations

import json
import sys

import torch

from ...safe_files import make_dir, write_file
from .coverage import run as run_coverage
from .report import plot, plot_coverage
from .tabular import parse, run


def main(argv: list[str] | None = None) -> int:
    """`python -m sage_train.study.toy.command --out DIR [--steps N] [--seeds N] ...`; returns the exit status."""
    try:
        out, opts = parse(sys.argv[1:] if argv is None else argv)
    except ValueError as error:
        print(f"sage-study --toy: {error}")
        return 2
    except SystemExit as done:  # --help
        return int(done.code or 0)
    # The tables are tiny: a second thread only adds synchronisation (about 15x slower on a busy machine).
    torch.set_num_threads(1)
    make_dir(out)

    command = "python -m sage_train.study.toy.command " + " ".join(sys.argv[1:] if argv is None else argv)
    result = run(opts)
    result["command"] = command
    result["files"] = ["toy.json", "curves.json"] + plot(result, out)
    # The curves are most of the numbers: one compact line each, apart from the readable report.
    lines = ",\n".join(f"{json.dumps(key)}: {json.dumps(curve)}" for key, curve in result.pop("curves").items())
    write_file(out / "curves.json", "{\n" + lines + "\n}\n")
    write_file(out / "toy.json", json.dumps(result, indent=1) + "\n")
    cmp = {way: f"{c['max_abs_pass_at_k_difference']:.2e}" for way, c in result["branch_vs_grpo"].items()}
    print(
        f"tv_exact_objective {result['tv_exact_objective']:.2e}  tv_reward_expected "
        f"{result['tv_reward_expected']:.2e}  tv_kl_only_surrogate {result['tv_kl_only_surrogate']:.2e}\n"
        f"sage-branch vs grpo, max |pass@k difference| {cmp}\nwrote {out / 'toy.json'} in {result['wall_seconds']:.0f}s"
    )
    if opts.coverage:
        coverage = run_coverage(opts)
        coverage["command"] = command
        coverage["files"] = ["coverage.json"] + plot_coverage(coverage, out)
        write_file(out / "coverage.json", json.dumps(coverage, indent=1) + "\n")
        print(f"wrote {out / 'coverage.json'} in {coverage['wall_seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
