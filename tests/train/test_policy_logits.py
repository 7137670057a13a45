"""`PolicyHead` scores and trains a model with the model's own logits: a tiny Gemma2 softcaps them
(``final_logit_softcapping``) and a tiny Cohere scales them (``logit_scale``) after the LM head, and the
log-probs of both of PolicyHead's sweeps equal log_softmax of the model's output logits / T."""

import pytest
import torch
import transformers
from tiny_models import completions

from sage_kernels import LossConfig
from sage_train.models.loading import build_char_tokenizer
from sage_train.policy import PolicyHead, make_batch, score


def tiny_transformed(kind: str, vocab: int):
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    if kind == "gemma2":
        config = transformers.Gemma2Config(**common, head_dim=8, final_logit_softcapping=1.5)
        config._attn_implementation = "eager"
        model = transformers.Gemma2ForCausalLM(config)
    else:
        model = transformers.CohereForCausalLM(transformers.CohereConfig(**common, logit_scale=0.25))
    with torch.no_grad():  # logits large enough that the softcap and the scale matter
        model.get_output_embeddings().weight.mul_(50.0)
    return model.eval()


@pytest.mark.parametrize("kind", ["gemma2", "cohere"])
def test_policy_head_uses_the_models_own_logits(kind):
    tokenizer = build_char_tokenizer()
    model = tiny_transformed(kind, len(tokenizer))
    head = PolicyHead(model, backend="cpu")
    batch = make_batch(completions(tokenizer, 4, seed=3), torch.device("cpu"), tokenizer.pad_token_id)
    T, P, L = 0.7, batch.prompt_length, batch.completion_ids.shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).logits[:, P - 1 : P - 1 + L]
    if kind == "gemma2":
        assert logits.abs().max() > 1.4  # at the softcap
    expected = torch.log_softmax(logits.double() / T, -1).gather(-1, batch.completion_ids[..., None])[..., 0]
    mask = batch.completion_mask
    logp, _ = score(head, batch, 4, T)
    torch.testing.assert_close(logp[mask].double(), expected[mask], atol=1e-4, rtol=1e-5)
    loss_inputs = {
        "mask": mask,
        "advantages": torch.ones(4),
        "config": LossConfig(beta=0.0, guide="none", temperature=T),
    }
    _, out = head(**batch.model_inputs(slice(0, 4), T), loss_inputs=loss_inputs)
    torch.testing.assert_close(out.logp[mask].double(), expected[mask], atol=1e-4, rtol=1e-5)
