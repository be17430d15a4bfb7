"""The trainer's batch: rollouts as right-padded token tensors (``Batch``), the one form every teacher-forced
logprob pass of the project reads (trainer, diagnostics, benchmarks, tests)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence


class Batch:
    """Token tensors of one rollout batch (right-padded): ``tokens [B, L]``, ``attn [B, L]``, ``mask [B, L]`` (1 on
    response tokens), ``rollout_logp [B, L]`` (vLLM's logprob of each response token, 0 elsewhere); for MoE
    rollouts with routing, ``routing [B, L, num_moe_layers, top_k]`` (the engine's experts per token; padding
    positions hold experts 0..k-1), else None."""

    def __init__(self, tokens, attn, mask, rollout_logp, group_size: int, routing=None):
        self.tokens, self.attn, self.mask, self.rollout_logp = tokens, attn, mask, rollout_logp
        self.group_size = group_size
        self.routing = routing

    @classmethod
    def from_rollouts(cls, rollouts: Sequence[Mapping], *, pad_id: int) -> Batch:
        """From RolloutWorker.generate's output: one dict per prompt with ``prompt_token_ids`` and ``samples``."""
        seqs, lps, starts = [], [], []
        group = len(rollouts[0]["samples"])
        for r in rollouts:
            if len(r["samples"]) != group:
                raise ValueError("all prompts must have the same number of samples (GRPO groups)")
            p = list(r["prompt_token_ids"])
            for s in r["samples"]:
                if len(s["logprobs"]) != len(s["token_ids"]):
                    raise ValueError(f"a sample has {len(s['token_ids'])} tokens but {len(s['logprobs'])} logprobs")
                seqs.append(p + list(s["token_ids"]))
                lps.append(list(s["logprobs"]))
                starts.append(len(p))
        b = len(seqs)
        tokens = pad_sequence([torch.tensor(s, dtype=torch.long) for s in seqs], batch_first=True,
                              padding_value=pad_id)
        width = tokens.shape[1]
        attn = pad_sequence([torch.ones(len(s), dtype=torch.long) for s in seqs], batch_first=True)
        # response positions: mask 1 and the engine's logprob (0 on the prompt and on padding)
        mask = pad_sequence([torch.cat([torch.zeros(st), torch.ones(len(s) - st)]) for s, st in zip(seqs, starts,
                                                                                                  strict=True)],
                            batch_first=True)
        rl = pad_sequence([torch.cat([torch.zeros(st), torch.tensor(lp, dtype=torch.float32)])
                           for lp, st in zip(lps, starts, strict=True)], batch_first=True)
        routing = None
        routed = [smp.get("routed_experts") for r in rollouts for smp in r["samples"]]
        if routed and all(x is not None for x in routed):
            n_layers, k = routed[0].shape[1:]
            routing = torch.arange(k, dtype=torch.long).expand(b, width, n_layers, k).clone()
            for i, (x, sq) in enumerate(zip(routed, seqs, strict=True)):
                if x.shape[0] != len(sq):
                    raise ValueError(f"routed_experts of sample {i}: {x.shape[0]} tokens, the sequence has {len(sq)}")
                routing[i, : len(sq)] = x.long()
        return cls(tokens, attn, mask, rl, group, routing)

    def __len__(self):
        return self.tokens.shape[0]

    def slice(self, idx) -> Batch:
        return Batch(self.tokens[idx], self.attn[idx], self.mask[idx], self.rollout_logp[idx], self.group_size,
                     None if self.routing is None else self.routing[idx])

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def trimmed(self) -> Batch:
        """The same rows cut to their longest sequence: the trailing columns are padding in every row (right
        padding; causal attention), so logprobs at real positions are unchanged and no compute is spent on pad."""
        w = int(self.attn.sum(1).max()) if len(self) else 0
        if w >= self.width:
            return self
        return Batch(self.tokens[:, :w], self.attn[:, :w], self.mask[:, :w], self.rollout_logp[:, :w],
                     self.group_size, None if self.routing is None else self.routing[:, :w])


def _pad_cols(t: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad a [B, w] tensor with zeros to [B, width]."""
    if t.shape[1] == width:
        return t
    return torch.cat([t, t.new_zeros(t.shape[0], width - t.shape[1])], dim=1)


class Packed:
    """A right-padded micro-batch's sequences end to end in one row (sequence packing): ``tokens [1, T]`` (T = its
    real tokens), ``position_ids [1, T]`` restarting at 0 for each sequence -- a forward given them without an
    attention mask attends within each sequence only (transformers' packed-sequence mask) -- and ``real [B, L]``,
    the padded positions the packed ones came from (row-major: each row's tokens in order, row after row)."""

    def __init__(self, b: Batch):
        self.real = b.attn.bool()
        self.tokens = b.tokens[self.real][None]
        lengths = b.attn.sum(1).tolist()
        self.position_ids = torch.cat([torch.arange(int(n)) for n in lengths])[None]
        self.starts = self.position_ids[0] == 0  # each sequence's first token: nothing before it predicts it
        self.cu_seq_lens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)

    def attention_kwargs(self, device) -> dict:
        """The sequences' bounds in the row, for use_packed_attention (flash-attention's argument names)."""
        cu = self.cu_seq_lens.to(device)
        longest = int((self.cu_seq_lens[1:] - self.cu_seq_lens[:-1]).max())
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """``[1, T]`` (or ``[T]``) per packed token -> ``[B, L]``, zero on padding; differentiable."""
        out = packed.new_zeros(self.real.shape)
        return out.masked_scatter(self.real.to(packed.device), packed.reshape(-1))


PACKED_ATTENTION = "fp8grpo_packed_sdpa"


def use_packed_attention(model) -> bool:
    """Give an SDPA model the attention of packed batches: with ``cu_seq_lens_q`` in the forward's arguments
    (:meth:`Packed.attention_kwargs`) each sequence's queries attend causally to its own keys, one SDPA call per
    sequence -- the work of the padded batch without its padding -- instead of one call over the whole row with a
    block-diagonal mask, whose cost grows with the row's length squared (measured 3.3x the padded step's time on
    rows of 32 sequences); other forwards run SDPA as before, with its masks. Returns False (nothing changed) for
    a model whose attention is not SDPA: it then runs the packed row with transformers' block-diagonal mask."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if model.config._attn_implementation != "sdpa":
        return False

    def attention(module, query, key, value, attention_mask, **kwargs):
        cu = kwargs.pop("cu_seq_lens_q", None)
        kwargs.pop("cu_seq_lens_k", None)
        if cu is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        bounds = cu.tolist()
        kwargs.pop("is_causal", None)
        outs = [sdpa_attention_forward(module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], None,
                                       is_causal=True, **kwargs)[0] for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
        return torch.cat(outs, dim=1), None  # [1, T, heads, head_dim], as SDPA returns it

    AttentionInterface.register(PACKED_ATTENTION, attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(PACKED_ATTENTION)
    return True


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float):
    """Teacher-forced logprobs of ``tokens`` under ``logits`` (``[B, L, V]``, from a forward over ``tokens``):
    ``logp[:, j] = log softmax(z_{j-1})[tokens_j]`` for j >= 1 with ``z = logits / temperature`` in FP32, column 0
    = 0 (nothing predicts the first token; always masked). Returns ``(logp [B, L], z [B, L-1, V])`` (z for
    entropies). The temperature makes them comparable with vLLM's processed logprobs (those of ``logits / T``)."""
    z = logits[:, :-1].float() / temperature
    lp = torch.log_softmax(z, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1), z


def by_length(b: Batch, batch_size: int, forward, max_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``forward(sub_batch) -> (logp, entropy or None)`` over ``b`` in longest-first batches of ``batch_size``
    rows (of at most ``max_tokens`` tokens with sequence packing), each trimmed to its own longest sequence (less
    padding); the results ``[len(b), b.width]`` come back in ``b``'s row order, zero beyond each batch's width."""
    from trainer.dp import longest_first_batches

    lp_all = ent_all = None
    for idx in longest_first_batches(b.attn.sum(1), batch_size, max_tokens):
        lp, ent = forward(b.slice(idx).trimmed())
        if lp_all is None:
            lp_all = torch.zeros(len(b), b.width, dtype=lp.dtype)
            ent_all = None if ent is None else torch.zeros(len(b), b.width, dtype=ent.dtype)
        lp_all[idx] = _pad_cols(lp.cpu(), b.width)
        if ent is not None:
            ent_all[idx] = _pad_cols(ent.cpu(), b.width)
    return lp_all, ent_all
