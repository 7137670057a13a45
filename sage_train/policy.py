"""The model seen as a loss head: hidden states and the LM head in, log-probs or the fused loss out.

`PolicyHead` runs the decoder and hands its last hidden states, with the LM head's weight, to
`sage_kernels`: the [tokens x vocab] logits are never formed. `Batch` holds a step's sequences
(left-padded prompts, right-padded completions) and `score` computes per-token log-probs and
entropies without gradient, micro-batch by micro-batch; a micro-batch reaches the decoder as its
padded rows or packed into one row (``padding_free``, `sage_train.micro_batches`), and the loss
takes the packed completion tokens with ``cu_seqlens``.

The logits are the model's own: its config's scale and softcap after the LM head (Gemma 2/3,
Cohere: `sage_kernels.integrations.hf_logits`) go to every sweep, then the sampling temperature.

ZeRO-3. The LM head is partitioned like every other weight. The loss reads
``lm_head.weight`` inside the forward of `PolicyHead`, the module DeepSpeed wraps; ZeRO-3 then
gathers it there, registers it as an external parameter of that module, and gathers it again
for the backward, so the fused loss always sees the full [V, D] weight.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn

from sage_kernels import fused_linear_sage_loss, logprobs_and_entropy
from sage_kernels.integrations.hf_logits import logit_options

from .micro_batches import MicroBatch, PackedRows, split
from .models.loading import decoder_of
from .models.lora import base_lm


class PolicyHead(nn.Module):
    """A causal LM seen through its last hidden states and LM head, never its logits.

    forward(batch) scores the completion tokens: per-token log-probs and entropies from
    `logprobs_and_entropy`. forward(batch, loss_inputs) returns (loss, the whole
    `fused_linear_sage_loss` output) instead; a ``loss_inputs["guide"]`` (a `Guide`) is first given
    the log-probs and entropies of these same hidden states (when it reads them), without gradient,
    and its log q goes to the loss. Both run inside this module's forward so that ZeRO-3 gathers the LM head.
    """

    def __init__(self, lm: nn.Module, backend: str = "auto", gradient_checkpointing: bool = False) -> None:
        super().__init__()
        self.lm, self.backend = lm, backend
        if gradient_checkpointing:
            checkpoint_layers(decoder_of(base_lm(lm)))

    def forward(
        self,
        input_ids,
        attention_mask,
        position_ids,
        completion_ids,
        temperature: float,
        prompt_length: int | None = None,
        packing: PackedRows | None = None,
        loss_inputs: dict | None = None,
    ):
        """Padded rows (`prompt_length` P: each row's completion starts at column P) or one packed
        row (`packing`, `sage_train.micro_batches`: its completion tokens' states and ``cu_seqlens``)."""
        lm = base_lm(self.lm)  # under LoRA: the LM whose layers carry the (possibly disabled) adapter
        hidden = decoder_of(lm)(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        # the hidden state at position t predicts token t + 1
        if packing is None:
            hidden, layout = hidden[:, prompt_length - 1 : prompt_length - 1 + completion_ids.shape[1]], {}
        else:
            hidden, layout = hidden[0].index_select(0, packing.hidden_rows), {"cu_seqlens": packing.cu_seqlens}
        head = lm.get_output_embeddings()
        logits = logit_options(lm.config)
        if loss_inputs is None:
            return logprobs_and_entropy(
                hidden,
                head.weight,
                completion_ids,
                bias=head.bias,
                temperature=temperature,
                **logits,
                **layout,
                backend=self.backend,
            )
        loss_inputs = dict(loss_inputs)
        guide = loss_inputs.pop("guide", None)
        if guide is not None:
            logp = entropy = None
            if guide.reads_policy:  # the current policy's log-probs and entropies: one more sweep, no gradient
                logp, entropy = logprobs_and_entropy(
                    hidden.detach(),
                    head.weight,
                    completion_ids,
                    bias=head.bias,
                    temperature=temperature,
                    **logits,
                    **layout,
                    backend=self.backend,
                )
            loss_inputs["log_q"] = guide_log_q(guide, logp, entropy, loss_inputs["mask"], packing)
        output = fused_linear_sage_loss(
            hidden,
            head.weight,
            completion_ids,
            bias=head.bias,
            backend=self.backend,
            **loss_inputs,
            **logits,
            **layout,
        )
        return output.loss, output  # the loss as a plain tensor output, so ZeRO-3 hooks its backward


def guide_log_q(guide, logp, entropy, mask, packing: PackedRows | None) -> torch.Tensor:
    """The guide's log q of the micro-batch's tokens. A guide reads rows (the token guide's per-row
    quantiles, the random guide's draws per [rows, L] position): packed tokens are given to it on the
    padded micro-batch's grid and taken back, so it draws and normalises as it does padded."""
    if packing is None:
        return guide.log_q(logp, entropy, mask)
    grid = packing.grid
    on_grid = [None if values is None else grid.to_grid(values) for values in (logp, entropy, mask)]
    return grid.to_rows(guide.log_q(*on_grid))


def checkpoint_layers(decoder: nn.Module) -> None:
    """Activation checkpointing of each of `decoder`'s layers (``decoder.layers``): a layer's forward
    under autograd keeps only its inputs and runs again in the backward, so an update holds one
    layer's activations instead of every layer's. Whatever the module's train/eval mode (transformers'
    own checkpointing acts only in training mode, which would also turn dropout on); without autograd
    (scoring, generation) the layer runs as it is. The layer's submodules are called again in the
    recompute, so their hooks (ZeRO-3's gathers) run again too. Non-reentrant checkpointing: frozen
    inputs (the embeddings under LoRA) need no ``requires_grad``."""
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"gradient_checkpointing: {type(decoder).__name__} has no `layers` list of decoder layers to checkpoint"
        )
    for layer in layers:
        # a method bound to the layer: a deepcopy of the model (the hf engine's bf16 sampling copy)
        # rebinds it to the copied layer
        layer.forward = types.MethodType(_checkpointed_forward, layer)


def _checkpointed_forward(layer: nn.Module, *args, **kwargs):
    forward = type(layer).forward.__get__(layer)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


@dataclass
class Batch:
    """A step's sequences: left-padded prompts followed by right-padded completions."""

    input_ids: torch.Tensor  # [B, P + L]
    attention_mask: torch.Tensor  # [B, P + L]
    position_ids: torch.Tensor  # [B, P + L], as `generate` numbers left-padded rows
    completion_ids: torch.Tensor  # [B, L]
    completion_mask: torch.Tensor  # [B, L] bool: tokens that count in the loss
    prompt_length: int  # P

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    def model_inputs(self, rows: slice | torch.Tensor, temperature: float) -> dict:
        """The `PolicyHead` forward's inputs for `rows`, padded (`sage_train.micro_batches` packs them)."""
        return {
            "input_ids": self.input_ids[rows],
            "attention_mask": self.attention_mask[rows],
            "position_ids": self.position_ids[rows],
            "completion_ids": self.completion_ids[rows],
            "prompt_length": self.prompt_length,
            "temperature": temperature,
        }


def make_batch(completions: list, device: torch.device, pad_id: int) -> Batch:
    """Pack completions (each with its prompt ids) into a `Batch` on `device`."""
    P = max(len(c.prompt_ids) for c in completions)
    L = max(1, max(len(c.completion_ids) for c in completions))
    input_ids = torch.full((len(completions), P + L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, c in enumerate(completions):
        prompt, completion = torch.tensor(c.prompt_ids), torch.tensor(c.completion_ids, dtype=torch.long)
        input_ids[row, P - len(prompt) : P] = prompt
        input_ids[row, P : P + len(completion)] = completion
        attention_mask[row, P - len(prompt) : P + len(completion)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    batch = Batch(input_ids, attention_mask, position_ids, input_ids[:, P:].clone(), attention_mask[:, P:].bool(), P)
    return Batch(*(x.to(device) if isinstance(x, torch.Tensor) else x for x in dataclasses.astuple(batch)))


@torch.no_grad()
def score(model: nn.Module, batch: Batch, micro_batches: int | list[MicroBatch], temperature: float):
    """Per-token log-probs and entropies [B, L] of the completions under `model` (a PolicyHead),
    micro-batch by micro-batch: `micro_batches` from `micro_batches.split`, or a row count (padded).
    Positions that no packed micro-batch holds (padding) are 0."""
    if isinstance(micro_batches, int):
        micro_batches = split(batch, rows=micro_batches)
    logp = entropy = None
    for micro in micro_batches:
        part_logp, part_entropy = model(**micro.model_inputs(batch, temperature))
        if logp is None:
            logp, entropy = (part_logp.new_zeros(batch.completion_ids.shape) for _ in range(2))
        micro.put(logp, part_logp)
        micro.put(entropy, part_entropy)
    return logp, entropy


#: the behaviour policy's token-entropy quantiles logged per generation (a branch guide's tau is
#: often set from them, e.g. at the starting policy's 80% quantile: step 1's `entropy/p80`)
ENTROPY_QUANTILES = (0.5, 0.8, 0.9)


def entropy_quantiles(entropy: torch.Tensor, mask: torch.Tensor) -> dict:
    """`entropy/p50`, `/p80`, `/p90` over this rank's completion tokens (nats, at the sampling
    temperature); none when no token is in the loss."""
    values = entropy[mask].float()
    if values.numel() == 0:
        return {}
    levels = torch.tensor(ENTROPY_QUANTILES, device=values.device)
    # torch.quantile refuses more than 2**24 elements: past that, an evenly strided subsample
    stride = -(-values.numel() // 2**24)
    found = torch.quantile(values[::stride], levels)
    return {f"entropy/p{round(level * 100)}": value for level, value in zip(ENTROPY_QUANTILES, found)}
