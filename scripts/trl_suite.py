"""TRL's own GRPO tests (``tests/test_grpo_trainer.py``) run on `SAGEGRPOTrainer`, offline, on CPU.

    python scripts/trl_suite.py --trl-git PATH_TO_A_TRL_CLONE       (or `make trl-suite TRL_GIT=...`)

1. Fetch: TRL's test file and the helpers it imports (``tests/__init__.py``, ``conftest.py``,
   ``testing_utils.py``) at the pinned commit `TRL_COMMIT`, from a git clone of huggingface/trl
   (``--trl-git``) or, without one, GitHub's raw files at that commit; each file is checked against
   its sha256 in `TRL_FILES` and kept in the cache (``--cache``, outside the repository).
   TRL's sdist carries no tests, and the newest commit of TRL's tests reachable here is `TRL_COMMIT`
   (VERSION 1.10.0.dev0), not v1.16.0: the ``trl`` control mode tells the failures that come from
   that skew (or from the stand-ins) from those of the SAGE trainer.
2. Substitute: the file's ``from trl import GRPOConfig, GRPOTrainer`` becomes `substitutes(mode)`:
   ``sage`` (`SAGEGRPOConfig`'s defaults: branch guide, beta 0.05, no bias-corrected KL),
   ``sage-trl-defaults`` (`SAGEGRPOConfig` with TRL's defaults: guide off, beta 0,
   ``use_bias_correction_kl`` TRL's) or ``trl`` (TRL's own classes: the control).
3. Stand-ins: every hub model the tests name that `STANDINS` covers is built from a small config
   with a character-level tokenizer and a chat template, into a hub cache of its own
   (``HF_HUB_CACHE``, ``HF_HUB_OFFLINE=1``); ``trl-internal-testing/zen`` is generated in its schema
   (The Zen of Python). A test that names a hub model or data set without a stand-in is skipped
   with that reason, as TRL's own markers skip those needing a GPU, vLLM or a missing package.
4. Run pytest per mode (one process, ``--threads`` BLAS threads) and write each test's outcome
   and reason (`RESULTS` JSON, a markdown summary); the tests failing in a SAGE mode run again
   with TRL's classes (``--control failed``) to say whether TRL fails them too.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import subprocess
import sys
import urllib.request
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRL_COMMIT = "f2cd57710ae345ea6428ae95363267fcf38a3dc8"  # huggingface/trl main, VERSION 1.10.0.dev0
TRL_FILES = {
    "tests/__init__.py": "575c2f27f11ee91a39f126cc5d0a8eec51befe3bc2a72ea4077d7fed6b65ebc0",
    "tests/conftest.py": "a443a76d3816077613893cf25aaa9699a0ce623bfcf7b2df435a8336ff68cf66",
    "tests/testing_utils.py": "1786d0a83e6fe5c28e5f8f1daaab957ff1d7b4d624b42403fb33143eb04d0172",
    "tests/test_grpo_trainer.py": "d8fc6290b727744271bec990ed4141aa95870fa650b206bf80362b396b11e90e",
}
TEST_FILE = "test_grpo_trainer.py"
RAW_URL = "https://raw.githubusercontent.com/huggingface/trl/{commit}/{path}"
MODES = ("sage", "sage-trl-defaults", "trl")
IMPORT_LINE = "from trl import GRPOConfig, GRPOTrainer"
PACKAGE = "trl_tests"  # the fetched tests' package in a run folder (not `tests`, the project's own)
HUB_ORGS = ("trl-internal-testing", "Qwen", "HuggingFaceTB", "kernels-community", "meta-llama", "google")
HUB_ID = re.compile(r"""["']((?:""" + "|".join(HUB_ORGS) + r""")/[\w.-]+)["']""")
DATASET = "trl-internal-testing/zen"

#: the tests of the options issue 27 asks about, by name
FOCUS = {
    "adaptive entropy": re.compile(r"adaptive_entropy"),
    "off-policy mask": re.compile(r"off_policy_mask"),
    "MoE aux loss": re.compile(r"[Mm]oe"),
    "static entropy": re.compile(r"static_entropy|entropy_bonus"),
}

# A small model of each architecture the tests name: (class, config class, config options). The common
# sizes are in `_SMALL`; a MoE's expert sizes are its own.
_SMALL = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, output_router_logits=False)
STANDINS = {
    "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5": ("Qwen2ForCausalLM", "Qwen2Config", {}),
    "trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5": (
        "Qwen2ForSequenceClassification",
        "Qwen2Config",
        {"num_labels": 1},
    ),
    "trl-internal-testing/tiny-Qwen3ForCausalLM": ("Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 8}),
    "trl-internal-testing/tiny-Qwen3ForSequenceClassification": (
        "Qwen3ForSequenceClassification",
        "Qwen3Config",
        {"head_dim": 8, "num_labels": 1},
    ),
    "trl-internal-testing/tiny-Qwen3MoeForCausalLM": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", {"head_dim": 8, **_MOE}),
    "trl-internal-testing/tiny-LlamaForCausalLM-3.2": ("LlamaForCausalLM", "LlamaConfig", {}),
    "trl-internal-testing/tiny-LlamaForSequenceClassification-3.2": (
        "LlamaForSequenceClassification",
        "LlamaConfig",
        {"num_labels": 1},
    ),
    "trl-internal-testing/tiny-MistralForCausalLM-0.2": ("MistralForCausalLM", "MistralConfig", {}),
}

# Character-level vocabulary (printable ASCII) with Qwen2.5's special tokens and a ChatML template.
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def cache_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg).expanduser().resolve()
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "sage-trl-suite"


# ---------------------------------------------------------------------------------------------- fetch


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch_trl_tests(cache: Path, trl_git: str | None, commit: str = TRL_COMMIT, files=None) -> Path:
    """The pinned TRL test files in ``cache/trl-<commit>/``, each checked against its sha256;
    from ``trl_git`` (a clone holding the commit) or GitHub's raw files. Returns that folder."""
    files = TRL_FILES if files is None else files
    dest = cache / f"trl-{commit[:12]}"
    for path, digest in files.items():
        target = dest / path
        if target.exists() and _sha256(target.read_bytes()) == digest:
            continue
        if trl_git:
            data = subprocess.run(
                ["git", "--git-dir", _git_dir(trl_git), "show", f"{commit}:{path}"], capture_output=True, check=True
            ).stdout
        else:
            with urllib.request.urlopen(RAW_URL.format(commit=commit, path=path), timeout=60) as response:
                data = response.read()
        if _sha256(data) != digest:
            raise SystemExit(f"{path} at {commit}: sha256 {_sha256(data)}, pinned {digest}")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return dest


def _git_dir(path: str) -> str:
    path = Path(path)
    return str(path / ".git") if (path / ".git").exists() else str(path)


# ---------------------------------------------------------------------------------------- substitute


def substitutes(mode: str):
    """(config class, trainer class) that the fetched test file uses as GRPOConfig, GRPOTrainer."""
    from trl import GRPOConfig, GRPOTrainer

    if mode == "trl":
        return GRPOConfig, GRPOTrainer
    from sage_kernels.integrations.trl import SAGEGRPOConfig, SAGEGRPOTrainer

    if mode == "sage":
        return SAGEGRPOConfig, SAGEGRPOTrainer
    if mode == "sage-trl-defaults":
        return trl_defaults_config(), SAGEGRPOTrainer
    raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")


_TRL_DEFAULTS_CONFIG = None


def trl_defaults_config():
    """`SAGEGRPOConfig` whose defaults that differ from TRL's are TRL's: the guide off, TRL's
    ``beta`` and ``use_bias_correction_kl`` (the config's docstring names these two)."""
    global _TRL_DEFAULTS_CONFIG
    if _TRL_DEFAULTS_CONFIG is None:
        import dataclasses

        from trl import GRPOConfig

        from sage_kernels.integrations.trl import SAGEGRPOConfig

        trl_default = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
        overrides = {"sage_guide": "none", **{k: trl_default[k] for k in ("beta", "use_bias_correction_kl")}}
        _TRL_DEFAULTS_CONFIG = dataclasses.make_dataclass(
            "SAGEGRPOConfigTRLDefaults",
            [(name, type(value), dataclasses.field(default=value)) for name, value in overrides.items()],
            bases=(SAGEGRPOConfig,),
        )
        # a module attribute under its own name, so pickle (used by the trainer's dataloader
        # workers and deepcopy) finds the class again
        _TRL_DEFAULTS_CONFIG.__module__ = __name__
        globals()[_TRL_DEFAULTS_CONFIG.__name__] = _TRL_DEFAULTS_CONFIG
    return _TRL_DEFAULTS_CONFIG


def substitute(source: str, mode: str) -> str:
    """The test file with its GRPOConfig/GRPOTrainer import replaced (one line, so line numbers hold)."""
    if source.count(IMPORT_LINE + "\n") != 1:
        raise SystemExit(f"the test file does not import {IMPORT_LINE!r} exactly once: substitution not applied")
    if mode == "trl":
        return source
    line = f"from trl_suite import substitutes; GRPOConfig, GRPOTrainer = substitutes({mode!r})  # noqa"
    return source.replace(IMPORT_LINE + "\n", line + "\n")


def missing_imports(source: str, module_name: str) -> list[str]:
    """Names ``source`` imports from ``module_name`` that the installed module lacks."""
    import importlib

    module = importlib.import_module(module_name)
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == module_name:
            names += [alias.name for alias in node.names if not hasattr(module, alias.name)]
    return names


# ------------------------------------------------------------------------------------------ stand-ins


def build_tokenizer():
    """Character-level fast tokenizer over printable ASCII with Qwen2.5's special tokens and a
    ChatML chat template (eos <|im_end|>, pad <|endoftext|>)."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + sorted(set(string.printable)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_standin(model_id: str, path: Path, seed: int = 0) -> None:
    """Save the stand-in for ``model_id`` (a small random model of its architecture and the tokenizer)."""
    import torch
    import transformers

    class_name, config_name, options = STANDINS[model_id]
    tokenizer = build_tokenizer()
    config = getattr(transformers, config_name)(
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
        **{**_SMALL, **options},
    )
    torch.manual_seed(seed)
    model = getattr(transformers, class_name)(config)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def standin_hub(cache: Path, model_ids=None) -> Path:
    """A hub cache (``HF_HUB_CACHE``) holding a stand-in for each of ``model_ids`` (all of `STANDINS`
    by default), under refs/main as the hub would; built once."""
    hub = cache / "hub"
    for model_id in STANDINS if model_ids is None else model_ids:
        spec = json.dumps([model_id, STANDINS[model_id], _SMALL, SPECIAL, CHAT_TEMPLATE], sort_keys=True)
        revision = hashlib.sha1(spec.encode()).hexdigest()
        repo = hub / ("models--" + model_id.replace("/", "--"))
        snapshot = repo / "snapshots" / revision
        if not (snapshot / "config.json").exists():
            build_standin(model_id, snapshot)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
    return hub


def zen_rows():
    """The Zen of Python's 19 aphorisms as (prompt, completion) pairs, split before the last word."""
    import codecs
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        import this
    lines = [line for line in codecs.decode(this.s, "rot13").splitlines()[2:] if line.strip()]
    rows = []
    for line in lines:
        head, _, last = line.rpartition(" ")
        rows.append((head, " " + last))
    return rows


def zen_dataset(name: str | None = None, split: str | None = None, streaming: bool = False, **_):
    """``trl-internal-testing/zen`` generated in its schema: configs ``standard_*`` and ``conversational_*``
    (prompt-only, prompt-completion, language-modeling), splits train (17 rows) and test (2)."""
    from datasets import Dataset, DatasetDict, IterableDatasetDict

    kind, _, layout = (name or "standard_prompt_only").partition("_")
    if kind not in ("standard", "conversational"):
        raise ValueError(f"zen stand-in: no config {name!r}")

    def row(prompt, completion):
        if kind == "standard":
            text = {"prompt": prompt, "completion": completion, "text": prompt + completion}
        else:
            text = {
                "prompt": [{"role": "user", "content": prompt}],
                "completion": [{"role": "assistant", "content": completion}],
                "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}],
            }
        keys = {"prompt_only": ["prompt"], "prompt_completion": ["prompt", "completion"]}
        keys = keys.get(layout, ["text"] if kind == "standard" else ["messages"])
        return {key: text[key] for key in keys}

    rows = [row(p, c) for p, c in zen_rows()]
    splits = {"train": Dataset.from_list(rows[:17]), "test": Dataset.from_list(rows[17:])}
    if streaming:
        splits = {key: value.to_iterable_dataset() for key, value in splits.items()}
        return splits[split] if split else IterableDatasetDict(splits)
    return splits[split] if split else DatasetDict(splits)


def hub_ids(text: str) -> set[str]:
    return set(HUB_ID.findall(text))


def _body(test_function) -> str:
    import inspect

    try:
        source = inspect.getsource(test_function)
    except (OSError, TypeError):
        return ""
    return source[source.find("def ") :]  # not the parametrize lists: each parameter is its own item


def trains_with_liger(test_function, params: dict) -> bool:
    """Whether the test trains with ``use_liger_kernel=True``: Liger's Triton kernels need a GPU, and
    its patch of the model classes (RMSNorm, ...) stays for the rest of the process, so on CPU every
    later training test would fail too."""
    body = _body(test_function)
    on = params.get("use_liger_kernel") is True or "use_liger_kernel=True" in body
    return on and ".train()" in body


def unresolved(test_function, params: dict) -> list[str]:
    """The hub ids this test (its body and its parameters) names that have no stand-in."""
    names = hub_ids(_body(test_function)) | hub_ids(" ".join(repr(value) for value in params.values()))
    return sorted(name for name in names if name not in STANDINS and name != DATASET)


# ------------------------------------------------------------------------------------ pytest plugin
# Loaded by the run folder's conftest.py (`ROOT_CONFTEST`) inside the pytest process.

ROOT_CONFTEST = '''"""Written by scripts/trl_suite.py: stand-ins, compatibility shims and the results file."""
import sys

sys.path.insert(0, {scripts!r})
from trl_suite import install_plugin  # noqa: E402

install_plugin(globals(), missing={missing!r})
'''


def install_plugin(namespace: dict, missing: list[str]) -> None:
    """Into the run folder's conftest: zen served locally, shims for the trl.import_utils names the
    fetched helpers import and TRL 1.16 lacks (their tests skip), the skip of tests naming hub
    resources without a stand-in, and a JSON line per test outcome."""
    import importlib

    import datasets
    import pytest

    import_utils = importlib.import_module("trl.import_utils")
    for name in missing:
        setattr(import_utils, name, lambda: False)

    original = datasets.load_dataset

    def load_dataset(path, name=None, *args, **kwargs):
        if path == DATASET:
            return zen_dataset(name, *args, **kwargs)
        return original(path, name, *args, **kwargs)

    datasets.load_dataset = load_dataset
    results = open(os.environ["SAGE_TRL_SUITE_RESULTS"], "a")

    import torch

    def pytest_collection_modifyitems(config, items):
        for item in items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            function = getattr(item, "function", None)
            names = unresolved(function, params)
            if names:
                item.add_marker(pytest.mark.skip(reason=f"needs the hub's {', '.join(names)} (no local stand-in)"))
            elif not torch.cuda.is_available() and trains_with_liger(function, params):
                item.add_marker(
                    pytest.mark.skip(reason="trains with use_liger_kernel=True: Liger's Triton kernels need a GPU")
                )

    def pytest_runtest_logreport(report):
        if report.when == "call" or report.outcome != "passed":
            results.write(json.dumps(outcome_of(report)) + "\n")
            results.flush()

    namespace["pytest_collection_modifyitems"] = pytest_collection_modifyitems
    namespace["pytest_runtest_logreport"] = pytest_runtest_logreport


def outcome_of(report) -> dict:
    """(nodeid, outcome, one-line reason) of a pytest report; a setup error counts as failed."""
    reason = ""
    outcome = report.outcome
    if hasattr(report, "wasxfail"):
        outcome, reason = ("xfailed" if report.skipped else "xpassed"), report.wasxfail
    elif report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
    elif report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        reason = crash.message if crash is not None else str(report.longrepr)
        if report.when != "call":
            reason = f"[{report.when}] {reason}"
    reason = " ".join(reason.split())[:300]
    return {"test": report.nodeid.split("::", 1)[-1], "outcome": outcome, "reason": reason, "s": report.duration}


# ---------------------------------------------------------------------------------------------- run


def prepare_run(cache: Path, source_dir: Path, mode: str) -> Path:
    """A run folder for ``mode``: the fetched tests (substituted) as package `PACKAGE`, a root
    conftest installing the plugin, a pytest.ini of its own."""
    run = cache / "runs" / mode
    package = run / PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    for path in TRL_FILES:
        text = (source_dir / path).read_text()
        if Path(path).name == TEST_FILE:
            text = substitute(text, mode)
        (package / Path(path).name).write_text(text)
    helpers = (source_dir / "tests" / "testing_utils.py").read_text()
    missing = missing_imports(helpers, "trl.import_utils")
    (run / "conftest.py").write_text(ROOT_CONFTEST.format(scripts=str(Path(__file__).parent), missing=missing))
    (run / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\nmarkers =\n    slow\n    low_priority\n")
    return run


def run_mode(cache: Path, source_dir: Path, hub: Path, mode: str, args, tests=None) -> list[dict]:
    run = prepare_run(cache, source_dir, mode)
    results = cache / "results" / f"{mode}.jsonl"
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text("")
    threads = str(args.threads)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_CACHE": str(hub),
        "HF_HOME": str(cache / "hf-home"),
        "SAGE_TRL_SUITE_RESULTS": str(results),
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_MODE": "disabled",
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
    }
    selection = [f"{PACKAGE}/{TEST_FILE}::{test}" for test in tests] if tests else [f"{PACKAGE}/{TEST_FILE}"]
    command = [sys.executable, "-m", "pytest", "-q", "-rN", f"--timeout={args.timeout}"]
    command += ["-k", args.k] if args.k else []
    print(f"== {mode}: {len(tests) if tests else 'all'} tests, log {cache / 'results' / f'{mode}.log'}", flush=True)
    with open(cache / "results" / f"{mode}.log", "w") as log:
        status = subprocess.run(command + selection, cwd=run, env=env, stdout=log, stderr=subprocess.STDOUT)
    rows = [json.loads(line) for line in results.read_text().splitlines() if line]
    if not rows and status.returncode not in (0, 5):  # 5: nothing selected
        tail = (cache / "results" / f"{mode}.log").read_text()[-3000:]
        raise SystemExit(f"pytest exited {status.returncode} with no test run ({mode}):\n{tail}")
    print(f"   {mode}: {format_counts(counts(rows))}", flush=True)
    return rows


def counts(rows) -> Counter:
    final = {row["test"]: row["outcome"] for row in rows}
    return Counter(final.values())


def format_counts(count: Counter) -> str:
    total = sum(count.values())
    parts = [f"{count[k]} {k}" for k in ("passed", "failed", "skipped", "xfailed", "xpassed") if count[k]]
    return f"{total} tests: " + ", ".join(parts)


def summary(by_mode: dict[str, list[dict]], control: dict[str, dict]) -> str:
    """Markdown: counts per mode, the focus tests' outcomes, each failure with its reason (and
    whether TRL's own classes fail it too)."""
    out = [f"TRL tests at {TRL_COMMIT[:12]} ({TEST_FILE}), {trl_versions()}", ""]
    out += ["| mode | " + " | ".join(("total", "passed", "failed", "skipped", "xfailed")) + " |", "|---" * 6 + "|"]
    for mode, rows in by_mode.items():
        c = counts(rows)
        cells = [sum(c.values()), c["passed"], c["failed"], c["skipped"], c["xfailed"]]
        out.append(f"| {mode} | " + " | ".join(map(str, cells)) + " |")
    for mode, rows in by_mode.items():
        final = {row["test"]: row for row in rows}
        out += ["", f"### {mode}", ""]
        for focus, pattern in FOCUS.items():
            hits = {t: r["outcome"] for t, r in final.items() if pattern.search(t)}
            listed = ", ".join(f"{t.split('::')[-1]} {o}" for t, o in sorted(hits.items()))
            out.append(f"- {focus}: {format_counts(Counter(hits.values()))} ({listed})")
        for test, row in sorted(final.items()):
            if row["outcome"] == "failed":
                trl = control.get(test)
                also = "" if trl is None else f" [TRL's GRPOTrainer: {trl['outcome']}]"
                out.append(f"- FAILED {test}{also}: {row['reason']}")
    return "\n".join(out) + "\n"


def trl_versions() -> str:
    import torch
    import transformers
    import trl

    return f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl-git", default=os.environ.get("TRL_GIT"), help="a git clone of huggingface/trl")
    parser.add_argument("--cache", help="fetched files, stand-ins, runs, results (default ~/.cache/sage-trl-suite)")
    parser.add_argument("--modes", default="sage,sage-trl-defaults", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument(
        "--control", choices=("failed", "none"), default="failed", help="rerun a SAGE mode's failures with TRL's"
    )
    parser.add_argument("-k", help="pytest -k expression")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per test")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    for mode in modes:
        if mode not in MODES:
            parser.error(f"mode {mode!r}: one of {', '.join(MODES)}")
    cache = cache_dir(args.cache)
    source_dir = fetch_trl_tests(cache, args.trl_git)
    hub = standin_hub(cache)
    by_mode = {mode: run_mode(cache, source_dir, hub, mode, args) for mode in modes}
    control = {}
    failed = sorted({r["test"] for m, rows in by_mode.items() if m != "trl" for r in rows if r["outcome"] == "failed"})
    if failed and args.control == "failed" and "trl" not in by_mode:
        control = {row["test"]: row for row in run_mode(cache, source_dir, hub, "trl", args, failed)}
    elif "trl" in by_mode:
        control = {row["test"]: row for row in by_mode["trl"]}
    text = summary(by_mode, control)
    (cache / "results" / "summary.md").write_text(text)
    (cache / "results" / "results.json").write_text(json.dumps({"by_mode": by_mode, "control": control}, indent=1))
    print(text)
    print(f"results: {cache / 'results'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
