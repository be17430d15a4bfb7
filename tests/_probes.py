"""What the tests read of the workers that a run never needs: logprobs of rollouts under a plain HF model on the
trainer's batching path (an independent scorer beside ``PolicyWorker.score``), and the K/V/Q scales an in-process
engine's attention layers hold. Loaded with ``sys.path`` as tests/_hub.py is."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from trainer.batch import Batch, by_length, token_logprobs


@torch.no_grad()
def model_logprobs(model, rollouts: Sequence[Mapping], *, pad_id: int, temperature: float = 1.0,
                   batch_size: int = 16) -> tuple[torch.Tensor, Batch]:
    """Teacher-forced logprobs ``[B, L]`` of ``rollouts`` (RolloutWorker.generate output) under a plain HF causal
    LM ``model`` (no trainer around it: its own dtype, no autocast), on the trainer's batches (``Batch``,
    ``by_length``, ``token_logprobs``); returns them with the batch (``mask``, ``rollout_logp``). The trainer's
    own numerics are ``PolicyWorker.score``."""
    b = Batch.from_rollouts(rollouts, pad_id=pad_id)
    device = next(model.parameters()).device

    def forward(mb: Batch):
        logits = model(input_ids=mb.tokens.to(device), attention_mask=mb.attn.to(device)).logits
        return token_logprobs(logits, mb.tokens.to(device), temperature=temperature)[0], None

    return by_length(b, batch_size, forward)[0], b


def engine_kv_scales(worker) -> dict[str, list[float]]:
    """The K/V/Q scales an in-process ``RolloutWorker``'s attention layers hold now (read back from the layers)."""
    from rollout.kv_cache import _attention_layers

    names = worker._attn_names

    def read(model):
        layers = _attention_layers(model)
        return {f"{key}_scale": [float(getattr(layers[n], f"_{key}_scale_float")) for n in names] for key in "kvq"}

    return worker.llm.apply_model(read)[0]
