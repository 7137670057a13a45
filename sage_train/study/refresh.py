"""`refresh(study_dir)` rewrites a committed study's study.json endpoints and study.md from its stored
counts alone (nothing is rerun): how the studies run before p-values were reported got theirs."""

from __future__ import annotations

import json
from pathlib import Path

from ..environment import package_commit
from ..safe_files import write_file
from .design import Arm, Study
from .endpoints import endpoint_rows
from .report import markdown


def refresh(study_dir) -> dict:
    """Recompute a committed study's endpoints (intervals, p, Holm) from the counts in its study.json,
    store them there, and rewrite study.md (the plots are left as they are). Returns the report."""
    study_dir = Path(study_dir)
    report = json.loads((study_dir / "study.json").read_text())
    spec = report["study"]
    report["endpoints"] = endpoint_rows(report["counts"], spec["endpoints"])
    report["refreshed_at_commit"] = package_commit()
    write_file(study_dir / "study.json", json.dumps(report, indent=1) + "\n")
    report = json.loads((study_dir / "study.json").read_text())
    arms = [
        Arm(name, s["algorithm"], {k: v for k, v in s.items() if k != "algorithm"}) for name, s in spec["arms"].items()
    ]
    keys = ("seeds", "baseline", "eval_n", "eval_problems", "train_config", "train", "endpoints")
    study = Study(arms=arms, out=study_dir, **{key: spec[key] for key in keys})
    write_file(study_dir / "study.md", markdown(report, study) + "\n")
    return report
