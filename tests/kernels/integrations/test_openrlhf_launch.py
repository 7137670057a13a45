"""The OpenRLHF launcher (sage_kernels.integrations.openrlhf_launch): OpenRLHF's own ``PolicyLoss``
replaced in the driver and in a local Ray actor with no OpenRLHF file edited, equal to OpenRLHF
0.11.2's on the padded and packing_samples layouts. The tests that import OpenRLHF run in its side
environment (scripts/openrlhf_suite.sh, `make openrlhf-suite`) and are skipped without it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sage_kernels.integrations import openrlhf_launch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def _env() -> dict:
    """This process's environment with the repository and this folder (the driver and its cases) on PYTHONPATH."""
    path = [str(ROOT), str(HERE), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path))


def _launch(*args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "sage_kernels.integrations.openrlhf_launch", *args],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--loss_type", "nope", "m"], "loss_type"),
        (["--loss_options", "{not json", "m"], "--loss_options must be a JSON object"),
        (["--loss_options", "[1]", "m"], "--loss_options must be a JSON object"),
        (["--loss_options", '{"importance_sampling": "bogus"}', "m"], "importance_sampling"),
        (["--loss_options", '{"nope": 1}', "m"], "nope"),
    ],
)
def test_bad_choices_fail_in_one_line_before_anything_runs(args, message, capsys, monkeypatch):
    monkeypatch.delenv(openrlhf_launch.ENV, raising=False)
    with pytest.raises(SystemExit) as stop:
        openrlhf_launch.main(args)
    assert stop.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in last and last.startswith("python -m sage_kernels.integrations.openrlhf_launch: error:")
    assert openrlhf_launch.ENV not in os.environ and "class" not in openrlhf_launch._installed


def test_runtime_env_keeps_the_callers_and_refuses_a_second_hook():
    value = openrlhf_launch.choice("dppo_tv", {"tau": 0.5})
    base = {"env_vars": {"NCCL_DEBUG": "WARN"}, "pip": ["x"]}
    env = openrlhf_launch.runtime_env(base, value)
    assert env == {
        "env_vars": {"NCCL_DEBUG": "WARN", openrlhf_launch.ENV: value},
        "pip": ["x"],
        "worker_process_setup_hook": "sage_kernels.integrations.openrlhf_launch.worker_setup",
    }
    assert base == {"env_vars": {"NCCL_DEBUG": "WARN"}, "pip": ["x"]}  # not changed in place
    assert json.loads(value) == {"loss_type": "dppo_tv", "loss_options": {"tau": 0.5}, "fused_actor": False}
    with pytest.raises(ValueError, match="worker_process_setup_hook"):
        openrlhf_launch.runtime_env({"worker_process_setup_hook": "theirs.setup"}, value)


@pytest.fixture(scope="module")
def openrlhf_loss():
    """OpenRLHF 0.11.2's models.loss, imported as OpenRLHF's actor imports it (never hooked in this process)."""
    module = pytest.importorskip("openrlhf.models.loss", reason="OpenRLHF's side environment: make openrlhf-suite")
    assert not hasattr(module.PolicyLoss, "sage_loss")
    return module


def test_install_before_and_after_openrlhf_is_imported(openrlhf_loss):
    script = """
import sys
from sage_kernels.integrations import openrlhf_launch
if sys.argv[1] == "after":
    import openrlhf.models
openrlhf_launch.install("dppo_tv", tau=0.5)
import openrlhf.models, openrlhf.models.loss
assert openrlhf.models.PolicyLoss is openrlhf.models.loss.PolicyLoss
print(openrlhf.models.PolicyLoss.sage_loss, openrlhf.models.PolicyLoss(0.1, 0.1).config.loss_type)
"""
    for when in ("before", "after"):
        done = subprocess.run(
            [sys.executable, "-c", script, when], capture_output=True, text=True, env=_env(), timeout=300
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip().splitlines()[-1] == "('dppo_tv', {'tau': 0.5}) dppo_tv", when


def test_fused_actor_equals_openrlhfs_actor(openrlhf_loss, tmp_path):
    """--fused_actor: OpenRLHF's own Actor, built as OpenRLHF builds it, runs the fused head (no logits
    in its output) and gives OpenRLHF's log-probs, entropies and gradients."""
    import openrlhf_policy_cases as cases
    from openrlhf.models import Actor

    out = tmp_path / "fused.pt"
    script = f"""
import torch
from sage_kernels.integrations import openrlhf_launch
openrlhf_launch.install(fused_actor=True)
import openrlhf_policy_cases as cases
from openrlhf.models import Actor
torch.save({{layout: cases.actor_run(Actor, layout == "packed") for layout in ("padded", "packed")}}, {str(out)!r})
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    fused = torch.load(out, weights_only=False)
    want = cases.actor_run(Actor)  # OpenRLHF's own forward, padded (its packed one needs flash-attn)
    assert "logits" in want[3]
    for layout, got in fused.items():
        assert "logits" not in got[3], layout
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6, msg=layout)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6, msg=layout)
        for a, b in zip(got[2], want[2]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=layout)


def test_a_ray_actor_gets_our_loss_through_the_launcher_alone(openrlhf_loss, tmp_path):
    """Ray on 2 CPUs; the driver calls plain ray.init and its actor imports OpenRLHF's PolicyLoss."""
    pytest.importorskip("ray")
    import openrlhf_policy_cases as cases

    out = tmp_path / "report.pt"
    done = _launch("--loss_options", '{"importance_sampling": "token"}', "openrlhf_ray_driver", str(out), timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    report = torch.load(out, weights_only=False)
    assert report["sage_loss"] == ("grpo", {"importance_sampling": "token"}) == report["driver"]["sage_loss"]
    assert report["pid"] != report["driver"]["pid"]  # a Ray worker process, not the driver
    assert report["shapes"] == {"padded": (4, 6), "packed": (4, 5)}  # packing_samples trimmed the padding
    padded = cases.padded_batch()
    for layout, batch in (("padded", padded), ("packed", cases.packed_batch(padded))):
        want = cases.run(openrlhf_loss.PolicyLoss, batch)
        for case, got in report["results"][layout].items():
            for index, (a, b) in enumerate(zip(got, want[case])):
                if b is None:
                    assert a is None, (layout, case, index)
                else:
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=f"{layout} {case} output {index}")
            assert float(want[case][1]) > 0 or case.startswith("gspo"), (layout, case)  # the clip binds
