"""scripts/trl_suite.py's pieces, offline and small: the pinned fetch, the class substitution, the
TRL-defaults config, the local stand-ins (a hub id resolved from the stand-in hub cache, the zen data
set's schema) and the skip of tests naming hub resources without a stand-in."""

import hashlib
import importlib.util
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "trl_suite.py"


@pytest.fixture(scope="module")
def suite():
    spec = importlib.util.spec_from_file_location("trl_suite", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["trl_suite"] = module
    spec.loader.exec_module(module)
    return module


SOURCE = "import torch\nfrom trl import GRPOConfig, GRPOTrainer\n\nx = GRPOTrainer\n"


def test_substitute_replaces_the_import_on_one_line(suite):
    out = suite.substitute(SOURCE, "sage")
    assert out.splitlines()[1] == (
        "from trl_suite import substitutes; GRPOConfig, GRPOTrainer = substitutes('sage')  # noqa"
    )
    assert len(out.splitlines()) == len(SOURCE.splitlines())  # tracebacks keep TRL's line numbers
    assert suite.substitute(SOURCE, "trl") == SOURCE
    with pytest.raises(SystemExit, match="exactly once"):
        suite.substitute(SOURCE.replace("GRPOConfig, GRPOTrainer", "GRPOTrainer"), "sage")


def test_substitutes_per_mode(suite, tmp_path):
    pytest.importorskip("trl")
    from trl import GRPOConfig, GRPOTrainer

    from sage_kernels.integrations.trl import SAGEGRPOConfig, SAGEGRPOTrainer

    assert suite.substitutes("trl") == (GRPOConfig, GRPOTrainer)
    assert suite.substitutes("sage") == (SAGEGRPOConfig, SAGEGRPOTrainer)
    config_cls, trainer_cls = suite.substitutes("sage-trl-defaults")
    assert trainer_cls is SAGEGRPOTrainer and issubclass(config_cls, SAGEGRPOConfig)
    options = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    trl_args, sage_args, args = GRPOConfig(**options), SAGEGRPOConfig(**options), config_cls(**options)
    assert (args.sage_guide, args.beta, args.use_bias_correction_kl) == ("none", 0.0, True)
    assert (args.beta, args.use_bias_correction_kl) == (trl_args.beta, trl_args.use_bias_correction_kl)
    assert (sage_args.sage_guide, sage_args.beta, sage_args.use_bias_correction_kl) == ("branch", 0.05, False)
    assert args.loss_type == trl_args.loss_type and args.epsilon == trl_args.epsilon
    # the trainer pickles its arguments (dataloader workers, deepcopy): the class must be found again
    assert pickle.loads(pickle.dumps(args)).sage_guide == "none"
    with pytest.raises(ValueError, match="mode"):
        suite.substitutes("liger")


def test_missing_imports(suite):
    pytest.importorskip("trl")
    source = "from trl.import_utils import is_vllm_available, is_nowhere_available\nimport os\n"
    assert suite.missing_imports(source, "trl.import_utils") == ["is_nowhere_available"]


def test_fetch_checks_the_pinned_sha256(suite, tmp_path):
    repo = tmp_path / "trl"
    text = b"def test_one():\n    assert True\n"
    (repo / "tests").mkdir(parents=True)
    (repo / "tests" / "test_x.py").write_bytes(text)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", "x"], check=True)
    commit = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    pinned = {"tests/test_x.py": hashlib.sha256(text).hexdigest()}
    dest = suite.fetch_trl_tests(tmp_path / "cache", str(repo), commit, pinned)
    assert (dest / "tests" / "test_x.py").read_bytes() == text
    assert dest == tmp_path / "cache" / f"trl-{commit[:12]}"
    with pytest.raises(SystemExit, match="sha256"):
        suite.fetch_trl_tests(tmp_path / "other", str(repo), commit, {"tests/test_x.py": "0" * 64})


def test_standin_resolves_by_hub_id(suite, tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_id = "trl-internal-testing/tiny-Qwen3MoeForCausalLM"
    hub = suite.standin_hub(tmp_path, [model_id])
    model = AutoModelForCausalLM.from_pretrained(model_id, cache_dir=hub, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model_id, cache_dir=hub, local_files_only=True)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert (model.config.num_experts, model.config.num_experts_per_tok, model.config.hidden_size) == (4, 2, 16)
    assert model.config.vocab_size == len(tokenizer) == 104  # 4 special tokens + 100 printable characters
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Beautiful is better than"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nBeautiful is better than<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(prompt)["input_ids"]
    assert len(ids) == 4 + len("user\nBeautiful is better than") + len("assistant\n")  # specials are one id
    assert tokenizer.decode(ids) == prompt


def test_zen_standin_schema(suite):
    pytest.importorskip("datasets")
    from datasets import IterableDataset

    train = suite.zen_dataset("standard_prompt_only", split="train")
    assert train.column_names == ["prompt"] and len(train) == 17
    assert train[0]["prompt"] == "Beautiful is better than"
    both = suite.zen_dataset("standard_prompt_only")
    assert {k: len(v) for k, v in both.items()} == {"train": 17, "test": 2}
    chat = suite.zen_dataset("conversational_prompt_only", split="train")
    assert chat[1]["prompt"] == [{"role": "user", "content": "Explicit is better than"}]
    pc = suite.zen_dataset("standard_prompt_completion", split="test")
    assert pc.column_names == ["prompt", "completion"] and pc[0]["prompt"] + pc[0]["completion"] == (
        suite.zen_rows()[17][0] + suite.zen_rows()[17][1]
    )
    stream = suite.zen_dataset("standard_prompt_only", split="train", streaming=True)
    assert isinstance(stream, IterableDataset) and next(iter(stream)) == {"prompt": "Beautiful is better than"}
    with pytest.raises(ValueError, match="no config"):
        suite.zen_dataset("image_prompt_only")


def test_unresolved_names_hub_ids_without_a_standin(suite):
    @pytest.mark.parametrize("model_id", ["trl-internal-testing/tiny-Gemma2ForCausalLM"])
    def test_case(model_id):
        load("trl-internal-testing/zen", "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5")  # noqa: F821
        load("HuggingFaceTB/SmolVLM-Instruct", "completions/mean_length")  # noqa: F821

    assert suite.unresolved(test_case, {"model_id": "trl-internal-testing/tiny-Qwen3MoeForCausalLM"}) == [
        "HuggingFaceTB/SmolVLM-Instruct"
    ]  # the decorator's list is not the item's parameter
    assert suite.unresolved(test_case, {"model_id": "trl-internal-testing/tiny-Gemma2ForCausalLM"}) == [
        "HuggingFaceTB/SmolVLM-Instruct",
        "trl-internal-testing/tiny-Gemma2ForCausalLM",
    ]


def test_liger_training_is_recognised(suite):
    def test_liger(use_liger_kernel):
        trainer = make(use_liger_kernel=use_liger_kernel)  # noqa: F821
        trainer.train()

    def test_liger_raises():
        make(use_liger_kernel=True)  # noqa: F821

    assert suite.trains_with_liger(test_liger, {"use_liger_kernel": True})
    assert not suite.trains_with_liger(test_liger, {"use_liger_kernel": False})
    assert not suite.trains_with_liger(test_liger_raises, {})  # raises before any kernel runs
