"""The embedded default model: a tiny Qwen3-architecture causal LM with a byte-level BPE tokenizer trained locally.

Nothing is downloaded: the tokenizer is trained on the embedded tasks' text (arithmetic and addition), the model is initialised from a
config, and both are saved in Hugging Face format (config.json + model.safetensors + tokenizer files with a Qwen-style
chat template), so vLLM and transformers load it like any hub model. ``build_tiny_model`` is cached: a directory that
already holds a complete model (its ``.complete`` marker is written last) is returned as is.

Shapes are chosen for FP8: every linear's in/out features are multiples of 128, so the 128x128 weight blocks and
1x128 activation groups of the blockwise recipe tile exactly (~2.6M parameters with the defaults).

``num_experts > 0`` builds the Mixture-of-Experts twin (``Qwen3MoeForCausalLM``, :data:`TINY_MOE`): the same
tokenizer, attention and sizes, and every decoder layer's MLP replaced by ``num_experts`` experts of width
``moe_intermediate_size`` (top ``num_experts_per_tok`` routed per token, renormalised weights as Qwen3-MoE).
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from rewards.registry import DEFAULT_TASK, get_task

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    vocab_size: int = 1024
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 512
    seed: int = 0
    tokenizer_corpus_size: int = 20000
    num_experts: int = 0  # 0: dense Qwen3; > 0: Qwen3-MoE with this many experts per layer
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128

    def __post_init__(self):
        if self.num_experts:
            if not 2 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"tiny_model.num_experts_per_tok must be in [2, num_experts={self.num_experts}], "
                                 f"got {self.num_experts_per_tok}")
            if self.moe_intermediate_size % 128:
                raise ValueError(f"tiny_model.moe_intermediate_size must be a multiple of 128 for FP8 blocks, got "
                                 f"{self.moe_intermediate_size}")
        for key in ("hidden_size", "intermediate_size"):
            if getattr(self, key) % 128:
                raise ValueError(f"tiny_model.{key} must be a multiple of 128 for FP8 blocks, got {getattr(self, key)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("tiny_model.num_attention_heads must be a multiple of num_key_value_heads")


    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def key(self) -> dict:
        """What identifies a built model (its ``.complete`` marker): every field, the MoE ones only for MoE models
        (so dense models built before the MoE fields existed keep their marker)."""
        d = asdict(self)
        if not self.is_moe:
            for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
                d.pop(k)
        return d


TINY_MOE = TinyModelSpec(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)


def _corpus(n: int, seed: int) -> list[str]:
    """Chat-formatted text of both embedded tasks (one-fact arithmetic and scratchpad addition, alternating), so one
    tokenizer serves either task."""
    rng = random.Random(seed + 1)
    tasks = get_task("arithmetic"), get_task("addition")
    lines = []
    for i in range(n):
        task = tasks[i % 2]
        row = task.make_problem(rng)
        lines.append(f"<|im_start|>system\n{task.system_prompt}<|im_end|>\n<|im_start|>user\n{row['question']}"
                     f"<|im_end|>\n<|im_start|>assistant\n{row['solution']}<|im_end|>\n")
    return lines


def build_tokenizer(spec: TinyModelSpec):
    """Train a byte-level BPE tokenizer on the task's text; digits are split one per token (arithmetic-friendly)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(spec.tokenizer_corpus_size, spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>",
                                   bos_token=None, unk_token=None, additional_special_tokens=["<|im_start|>",
                                                                                              "<|endoftext|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def qwen3_config(spec: TinyModelSpec, tokenizer):
    from transformers import Qwen3Config, Qwen3MoeConfig

    if spec.is_moe:
        return Qwen3MoeConfig(
            vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
            moe_intermediate_size=spec.moe_intermediate_size, num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok, norm_topk_prob=True, decoder_sparse_step=1,
            mlp_only_layers=[], output_router_logits=False, router_aux_loss_coef=0.0,
            num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
            max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=False, rope_theta=10000.0,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
            torch_dtype="bfloat16",
        )
    return Qwen3Config(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=False, rope_theta=10000.0,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        torch_dtype="bfloat16",
    )


def asset_lock(path: str | Path):
    """An exclusive lock (``<path>.lock``) held while an asset under ``path`` is checked or built: runs (or test
    workers) sharing an assets directory wait for one builder instead of removing each other's temporary files."""
    from filelock import FileLock

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(path.with_name(path.name + ".lock")))


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None, *, overwrite: bool = False) -> Path:
    """Create (or reuse) a randomly initialised tiny Qwen3 + tokenizer in HF format at ``out_dir``."""
    with asset_lock(out_dir):
        return _build_tiny_model(Path(out_dir), spec or TinyModelSpec(), overwrite)


def _build_tiny_model(out: Path, spec: TinyModelSpec, overwrite: bool) -> Path:
    marker = out / ".complete"
    if marker.exists() and not overwrite:
        if json.loads(marker.read_text()) == spec.key():
            return out  # before the imports below: a run's driver that reuses the model skips ~4 s of transformers
        raise ValueError(f"{out} holds a tiny model built from another spec; pass overwrite=True or another directory")
    import torch
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    if out.exists():
        shutil.rmtree(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = build_tokenizer(spec)
    torch.manual_seed(spec.seed)
    cls = Qwen3MoeForCausalLM if spec.is_moe else Qwen3ForCausalLM
    model = cls(qwen3_config(spec, tokenizer)).to(torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / ".complete").write_text(json.dumps(spec.key()))
    tmp.rename(out)
    return out


def chat_prompt(tokenizer, question: str, task: str = DEFAULT_TASK) -> str:
    """The prompt text the policy sees for one question (system + user turn, generation prompt); the system turn is
    ``task``'s ``system_prompt`` (rewards/registry.py; the same text for every task today)."""
    from data.prompt import PromptFormat

    return PromptFormat().render(tokenizer, question, task)
