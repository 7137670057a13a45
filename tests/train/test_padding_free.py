"""The padding-free trainer (`sage_train.micro_batches`): each micro-batch's sequences packed into
one row, positions restarting per sequence, attention kept within each, the loss on ``cu_seqlens``.

On a tiny Qwen2 and on the SmolLM2-layout GGUF fixture (Llama, tied embeddings), full fine-tuning
and LoRA, in a real DeepSpeed engine: one optimizer step packed has the padded step's loss, metrics
and the gradients handed to the optimizer (guides inside and outside the loss, a token budget); a
packed sequence's log-probs are its log-probs alone, whatever its neighbours hold; the token
budget deals rows evenly and keeps to the budget; which models pack, and the refusals."""

import copy
import random

import pytest
import torch
import transformers
from hypothesis import given
from hypothesis import strategies as st
from tiny_models import completions, step_context, tiny_model

from sage_train.build import build_engines
from sage_train.config import ConfigError
from sage_train.guide import make_guide
from sage_train.inputs import engine_config, run_settings
from sage_train.micro_batches import padding_free, split, token_budget_groups
from sage_train.models.loading import build_char_tokenizer, load_pretrained
from sage_train.models.lora import with_lora
from sage_train.policy import PolicyHead, make_batch, score
from sage_train.rollout import Completion
from sage_train.step import policy_update, step_micro_batches

CPU = torch.device("cpu")


def load(kind: str, gguf_path, seed: int = 3):
    """(a fresh model, its pad id, its token ids to draw from) of `kind`: "qwen2" or "gguf"."""
    if kind == "gguf":
        model, _ = load_pretrained(str(gguf_path))
        return model, 2, list(range(3, 261))
    tokenizer = build_char_tokenizer()
    return tiny_model(tokenizer, seed=seed, max_positions=64), tokenizer.pad_token_id, list(range(3, len(tokenizer)))


def ragged_batch(pad_id: int, vocab: list, seed: int = 1, rows: int = 8):
    rng = random.Random(seed)
    out = []
    for row in range(rows):
        prompt = [rng.choice(vocab) for _ in range(rng.randint(1, 9))]
        completion = [rng.choice(vocab) for _ in range(rng.randint(0 if row == 6 else 1, 9))]
        out.append(Completion(prompt_index=row // 4, prompt_ids=prompt, completion_ids=completion, text=""))
    return make_batch(out, CPU, pad_id)


def one_step(cfg, kind, gguf_path, batch, packed: bool):
    """One optimizer step on `batch`: the gradients DeepSpeed hands the optimizer, the step's
    metrics and the behaviour log-probs, with the micro-batches packed or padded."""
    model, _, _ = load(kind, gguf_path)
    reference, s = None, run_settings(cfg)
    if cfg.lora_rank:
        torch.manual_seed(5)  # the same fresh adapter for both layouts
        model = with_lora(model, s.lora)
    else:
        reference = copy.deepcopy(model).requires_grad_(False)
        with torch.no_grad():  # a reference that differs from the policy: the KL term is not 0
            for p in reference.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    engine, reference = build_engines(s.optim, model, reference, engine_config(s, 1, CPU), CPU, s.reward.beta != 0)
    grads = {}

    def capture(optimizer, args, kwargs):
        grads.update({n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None})

    engine.optimizer.register_step_pre_hook(capture)
    guide = make_guide(s.run.guide, s.loss, s.guide, steps=s.run.steps, seed=s.run.seed, rank=0)
    ctx = step_context(cfg, engine, reference, guide=guide, device=CPU, padding_free=packed)
    micro_batches = step_micro_batches(ctx, batch)
    old_logp, _ = score(engine, batch, micro_batches, cfg.temperature)
    ref_logp = None if reference is None else score(reference, batch, micro_batches, cfg.temperature)[0]
    noise = torch.randn(old_logp.shape, generator=torch.Generator().manual_seed(7))
    old_logp = old_logp + 0.2 * noise * batch.completion_mask  # ratios away from 1: the clip is active
    advantages = torch.randn(batch.rows, generator=torch.Generator().manual_seed(2))
    in_loss = guide if guide is not None and guide.loss_option == "none" else None
    totals = policy_update(ctx, batch, advantages, old_logp, ref_logp, in_loss)
    return grads, totals.metrics(1), old_logp


@pytest.mark.parametrize(
    "kind, lora, algorithm, budget",
    [
        ("qwen2", False, "sage-branch", 0),
        ("qwen2", True, "sage-token", 0),  # a guide outside the loss: per-row quantiles of the surprisal
        ("qwen2", False, "sage-random", 40),  # its draws per micro-batch, micro-batches by a token budget
        ("gguf", False, "dapo", 0),
        ("gguf", True, "sage-branch", 40),
    ],
)
def test_a_packed_step_has_the_padded_loss_and_gradients(
    tiny_config, distributed, cache, gguf_path, kind, lora, algorithm, budget
):
    _, pad_id, vocab = load(kind, gguf_path)
    batch = ragged_batch(pad_id, vocab)
    batch.completion_mask[5] = False  # a row dropped by overlong filtering
    cfg = tiny_config(
        algorithm=algorithm,
        lora_rank=4 if lora else 0,
        prompts_per_step=2,
        group_size=4,
        micro_batch_size=4,
        max_tokens_per_micro_batch=budget,
        max_grad_norm=0.0,
        temperature=0.8,
        max_new_tokens=9,
    )
    padded = one_step(cfg, kind, gguf_path, batch, packed=False)
    packed = one_step(cfg, kind, gguf_path, batch, packed=True)
    real = batch.attention_mask[:, batch.prompt_length :].bool()
    torch.testing.assert_close(packed[2][real], padded[2][real], rtol=1e-5, atol=1e-5)
    assert padded[0].keys() == packed[0].keys() and len(padded[0]) > 0
    assert all("lora_" in name for name in padded[0]) == lora
    for name, grad in padded[0].items():
        scale = grad.abs().max().clamp(min=1e-3)
        torch.testing.assert_close(packed[0][name] / scale, grad / scale, rtol=0, atol=2e-5, msg=name)
    assert max(g.abs().max() for g in padded[0].values()) > 1e-4
    for name, value in padded[1].items():
        value = torch.as_tensor(value, dtype=torch.float64)
        torch.testing.assert_close(torch.as_tensor(packed[1][name], dtype=torch.float64), value, rtol=1e-5, atol=1e-6)
    assert float(padded[1]["clip_ratio/region_mean"]) > 0 and float(padded[1]["kl"]) != 0


@pytest.mark.parametrize("kind", ["qwen2", "gguf"])
def test_a_packed_sequence_sees_only_itself(cache, gguf_path, kind):
    """Changing one packed sequence's tokens (then its length too) leaves every other sequence's
    log-probs and entropies as they were; each one's equal its log-probs scored alone."""
    model, pad_id, vocab = load(kind, gguf_path)
    head = PolicyHead(model.eval(), backend="cpu")
    rng = random.Random(4)

    def sequences(changed=None, length=None):
        out = []
        for row in range(5):
            draw = random.Random(row)
            prompt = [draw.choice(vocab) for _ in range(3 + row % 3)]
            completion = [draw.choice(vocab) for _ in range(2 + row)]
            if row == changed:
                prompt = [rng.choice(vocab) for _ in prompt]
                completion = [rng.choice(vocab) for _ in range(length or len(completion))]
            out.append(Completion(prompt_index=0, prompt_ids=prompt, completion_ids=completion, text=""))
        return make_batch(out, CPU, pad_id)

    def packed_scores(batch):
        micro_batches = split(batch, rows=batch.rows, packed=True)
        assert len(micro_batches) == 1 and micro_batches[0].packed.input_ids.shape[1] == batch.attention_mask.sum()
        return score(head, batch, micro_batches, 0.9)

    batch = sequences()
    before = packed_scores(batch)
    real = batch.attention_mask[:, batch.prompt_length :].bool()
    for row in range(batch.rows):  # alone: a batch of one row has no padding
        alone = make_batch([completion_of(batch, row)], CPU, pad_id)
        logp, entropy = score(head, alone, 1, 0.9)
        torch.testing.assert_close(before[0][row, real[row]], logp[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(before[1][row, real[row]], entropy[0], rtol=1e-5, atol=1e-5)
    others = torch.arange(batch.rows) != 2
    for length in (None, 9):
        changed = sequences(changed=2, length=length)
        after = packed_scores(changed)
        width = min(after[0].shape[1], before[0].shape[1])
        keep = real[others, :width]
        for old, new in zip(before, after):
            torch.testing.assert_close(new[others, :width][keep], old[others, :width][keep], rtol=1e-6, atol=1e-6)
        assert (after[0][2, :3] - before[0][2, :3]).abs().max() > 1e-2  # the changed one did change


def completion_of(batch, row: int) -> Completion:
    P, mask = batch.prompt_length, batch.attention_mask[row].bool()
    ids = batch.input_ids[row]
    return Completion(0, ids[:P][mask[:P]].tolist(), ids[P:][mask[P:]].tolist(), text="")


@given(
    st.lists(st.integers(1, 60), min_size=1, max_size=40),
    st.integers(10, 200),
)
def test_a_token_budget_deals_rows_evenly_within_it(lengths, budget):
    tokens = torch.tensor(lengths)
    groups = token_budget_groups(tokens, budget, CPU, world=1)
    assert sorted(torch.cat(groups).tolist()) == list(range(len(lengths)))  # every row once
    loads = [int(tokens[g].sum()) for g in groups]
    assert all(load <= budget or len(g) == 1 for load, g in zip(loads, groups))
    assert len(groups) >= min(len(lengths), -(-sum(lengths) // budget))
    # longest first to the lightest: no micro-batch exceeds another by more than the longest row
    assert max(loads) - min(loads) <= max(lengths)


def test_a_micro_batch_of_empty_completions_scores_one_masked_slot():
    tokenizer = build_char_tokenizer()
    model = tiny_model(tokenizer, seed=0, max_positions=64)
    rows = [Completion(0, [5, 6, 7], [], text=""), Completion(0, [8, 9], [], text=""), *completions(tokenizer, 2, 3)]
    batch = make_batch(rows, CPU, tokenizer.pad_token_id)
    head = PolicyHead(model.eval(), backend="cpu")
    packed, padded = score(head, batch, split(batch, rows=2, packed=True), 1.0), score(head, batch, 2, 1.0)
    real = batch.attention_mask[:, batch.prompt_length :].bool()
    torch.testing.assert_close(packed[0][real], padded[0][real], rtol=1e-5, atol=1e-5)
    first = split(batch, rows=2, packed=True)[0].packed
    assert first.cu_seqlens.tolist() == [0, 1, 1] and first.hidden_rows.tolist() == [2]  # the first prompt's last
    empty_prompt = make_batch([Completion(0, [], [5, 6], text="")], CPU, tokenizer.pad_token_id)
    with pytest.raises(ValueError, match="padding_free: row 0 has no prompt token"):
        split(empty_prompt, rows=1, packed=True)


def test_which_models_pack_and_the_refusals(tiny_config):
    tokenizer = build_char_tokenizer()

    def packs(cfg, lm):  # `padding_free` as `build_context` asks it: the step's shape, the loss's luspo option
        s = run_settings(cfg)
        return padding_free(s.step, s.loss.luspo_include_padding, lm)

    assert packs(tiny_config(padding_free=True), tiny_model(tokenizer)) == (True, "")
    assert packs(tiny_config(padding_free=False), tiny_model(tokenizer)) == (False, "padding_free: false")
    # sdpa: a dense mask over the packed row costs more than the padding; padded without a word
    assert packs(tiny_config(), tiny_model(tokenizer)) == (False, "")
    assert packs(tiny_config(micro_batch_size=1), tiny_model(tokenizer)) == (True, "")  # one causal row each
    bloom = transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=64, hidden_size=16, n_layer=1, n_head=2))
    bloom.config._attn_implementation = "flash_attention_2"  # as loaded with flash-attn: null would pack
    packed, why = packs(tiny_config(), bloom)  # ALiBi, no position ids: padded, and why
    assert not packed and "BloomForCausalLM" in why
    with pytest.raises(ConfigError, match="config key 'padding_free' must be false or null here: BloomForCausalLM"):
        packs(tiny_config(padding_free=True), bloom)
    luspo = tiny_config(padding_free=True, loss_type="luspo", luspo_include_padding=True)
    with pytest.raises(ConfigError, match="padding_free.*luspo_include_padding"):
        packs(luspo, tiny_model(tokenizer))
