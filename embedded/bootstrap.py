"""Embedded-default assets: synthetic data splits + tiny Qwen3 + a short supervised (SFT) warm start, cached on disk.

Two embedded tasks (``data.task``, rewards/registry.py): ``addition`` (the default, rewards/addition_task.py: a
column-by-column scratchpad whose skill transfers across prompts) and ``arithmetic`` (rewards/math_task.py: one fact
per prompt).

RL needs signal: a randomly initialised model never writes a correct answer, so every GRPO group would have equal
rewards and zero advantages. ``sft_bootstrap`` teaches the answer format and some arithmetic on the train split
(loss on the assistant tokens only), deliberately short so validation accuracy stays well below 100% and RL has room
to improve it.

``ensure_default_assets(root, task=...)`` is idempotent: each artifact is written to a temporary name and renamed when
complete, and a finished SFT model is reused when its recipe (steps, seed, lr, batch size) matches. Layout under
``root``: ``arithmetic`` keeps the original one (``data/``, ``tiny-qwen3-base/``, ``tiny-qwen3-sft/``, retrained
when the seed changes); ``addition`` lives under ``root/addition/`` with one SFT model per seed
(``tiny-qwen3-sft-seed<k>/``), so runs with different seeds share the data and base model and never overwrite
each other's warm start. A model of another size (the ``bootstrap`` size keys, ``model_spec``) has its own base and
SFT directories, named by its size (``model_stem``), beside the built-in one's.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from embedded.tiny_model import TINY_MOE, TinyModelSpec, asset_lock, build_tiny_model, chat_prompt
from rewards import addition_task, math_task
from rewards.registry import DEFAULT_TASK

ADDITION_SFT_STEPS = 325
ADDITION_SFT_LR = 3e-3
# The addition task's SFT data: 2-4 digit operands from a teacher that forgets each carry with probability 0.7, so
# the warm start mostly drops carries (greedy answers are right mainly on carry-free problems) yet samples the right
# procedure sometimes: RL has a shared, transferable correction to find (rewards/addition_task.py). RL prompts and
# validation: 2-3 digit operands (after this short SFT the 4-digit lookups are still too unreliable for RL signal).
# Why 0.7, not 0.6 (measured on the 500 validation prompts, teacher-forced probability of the carry token where a
# carry is due): with 0.6 the 325-step SFT put it at 0.43 on average but above 0.5 at 21% of those positions, so
# greedy answers were already right on part of the carry problems (0.284 at step 0) and 15 RL steps gained only
# +0.13; a warm start whose carry probability sat at 0.32 with none above 0.5 gained +0.24..+0.37. 0.7 aims the
# converged SFT at ~0.3.
ADDITION_SFT_SPEC = addition_task.AdditionSpec(min_digits=2, max_digits=4, carry_drop=0.7)
ADDITION_SPEC = addition_task.AdditionSpec(min_digits=2, max_digits=3, carry_drop=0.7)
ADDITION_DATA_SEED = 1


@dataclass(frozen=True)
class SFTConfig:
    steps: int = 300
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if self.steps < 0 or self.batch_size < 1 or not self.lr > 0:
            raise ValueError(f"bootstrap.sft: steps >= 0, batch_size >= 1 and lr > 0 required, got {self}")


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _encode(tokenizer, row: dict, task: str) -> tuple[list[int], int]:
    prompt_ids = tokenizer(chat_prompt(tokenizer, row["question"], task), add_special_tokens=False).input_ids
    target_ids = tokenizer(row["solution"] + tokenizer.eos_token, add_special_tokens=False).input_ids
    return prompt_ids + target_ids, len(prompt_ids)


def sft_bootstrap(model_dir: str | Path, train_path: str | Path, out_dir: str | Path, cfg: SFTConfig | None = None,
                  *, log=print, marker: dict | None = None, task: str = DEFAULT_TASK) -> Path:
    """Supervised warm start of the model at ``model_dir`` on ``train_path``'s solutions (prompted as ``task``'s);
    saves HF format to ``out_dir``, whose ``.complete`` marker (written last) holds ``marker`` (default: the SFT
    recipe)."""
    cfg = cfg or SFTConfig()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    rows = _read_jsonl(Path(train_path))
    if not rows or "solution" not in rows[0]:
        raise ValueError(f"{train_path}: SFT bootstrap needs rows with question/solution columns")
    encoded = [_encode(tokenizer, r, task) for r in rows]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup_steps)) * max(0.05, 1 - s / max(1, cfg.steps)))
    pad = tokenizer.pad_token_id
    t0 = time.perf_counter()
    from process.progress import progress

    bar = progress(range(cfg.steps), desc="SFT warm start", unit="step")  # a terminal gets a bar, a log the lines
    for step in bar:
        batch = rng.sample(encoded, min(cfg.batch_size, len(encoded)))
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (ids, n_prompt) in enumerate(batch):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, n_prompt: len(ids)] = torch.tensor(ids[n_prompt:])
            attn[i, : len(ids)] = 1
        loss = model(input_ids=input_ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if not bar.disable and step % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}")
        if (bar.disable and step % 50 == 0) or step == cfg.steps - 1:
            log(f"sft step {step:4d}/{cfg.steps} loss {loss.item():.4f} ({time.perf_counter() - t0:.1f}s)")
    bar.close()
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / ".complete").write_text(json.dumps(marker if marker is not None else asdict(cfg)))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


# Per-task SFT recipe (steps / lr / batch) when the config does not override it. ``addition``: deliberately short,
# so the scratchpad procedure is only partly learned (greedy validation accuracy well below pass@8) and RL has a
# transferable skill to sharpen.
SFT_DEFAULTS = {"arithmetic": SFTConfig(), "addition": SFTConfig(steps=ADDITION_SFT_STEPS, lr=ADDITION_SFT_LR)}
SPLIT_SIZES = {"arithmetic": (4000, 200), "addition": (6000, 500)}  # (train, validation) rows
ADDITION_SFT_ROWS = 12000


def default_sft(task: str, *, seed: int = 0, steps: int | None = None) -> SFTConfig:
    """The SFT recipe of ``task`` with the run's seed (and ``bootstrap.sft_steps`` when set)."""
    base = SFT_DEFAULTS[task]
    return replace(base, seed=seed) if steps is None else replace(base, seed=seed, steps=steps)


MODELS = ("dense", "moe")  # bootstrap.model: the tiny dense Qwen3 or its Mixture-of-Experts twin (TINY_MOE)
# The size fields a model's cache directories are named by (the ``bootstrap`` size keys), with their short tags.
SIZE_TAGS = {"hidden_size": "h", "num_hidden_layers": "l", "num_attention_heads": "a", "num_key_value_heads": "kv",
             "intermediate_size": "i"}
MOE_SIZE_TAGS = {"num_experts": "e", "num_experts_per_tok": "k", "moe_intermediate_size": "m"}


def model_spec(model: str = "dense", size: Mapping[str, int] | None = None) -> TinyModelSpec:
    """The embedded model of ``bootstrap.model`` at the ``bootstrap`` size keys that are set (``size``, by
    TinyModelSpec field name; ``Config.bootstrap.model_size()``); unset fields keep TinyModelSpec's (TINY_MOE's)
    values. The head size follows as hidden_size / num_attention_heads, 64 at the built-in size."""
    if model not in MODELS:
        raise ValueError(f"bootstrap.model: {model!r} is not one of {MODELS}")
    spec = replace(TINY_MOE if model == "moe" else TinyModelSpec(), **(size or {}))
    if spec.hidden_size % spec.num_attention_heads:
        raise ValueError(f"bootstrap.num_attention_heads: {spec.num_attention_heads} does not divide "
                         f"bootstrap.hidden_size {spec.hidden_size}")
    return replace(spec, head_dim=spec.hidden_size // spec.num_attention_heads)


def model_stem(spec: TinyModelSpec) -> str:
    """The name the base and SFT directories of ``spec`` start with: ``tiny-qwen3`` (``tiny-qwen3-moe``) at the
    built-in size, else with every size field appended (``tiny-qwen3-h512-l8-a8-kv4-i1024``), so models of
    different sizes sharing ``bootstrap.assets_dir`` never meet in one directory."""
    stem = "tiny-qwen3-moe" if spec.is_moe else "tiny-qwen3"
    tags = {**SIZE_TAGS, **(MOE_SIZE_TAGS if spec.is_moe else {})}
    builtin = TINY_MOE if spec.is_moe else TinyModelSpec()
    if all(getattr(spec, f) == getattr(builtin, f) for f in tags):
        return stem
    return "-".join([stem, *(f"{tag}{getattr(spec, f)}" for f, tag in tags.items())])


def ensure_default_assets(root: str | Path, *, task: str = DEFAULT_TASK, sft: SFTConfig | None = None,
                          spec: TinyModelSpec | None = None, n_train: int | None = None,
                          n_validation: int | None = None, n_sft: int | None = None, log=print,
                          model: str = "dense") -> dict[str, Path]:
    """Data splits + base tiny model + SFT warm start of ``task`` under ``root`` (reused when already complete).
    ``model="moe"``: the tiny Qwen3-MoE (embedded.tiny_model.TINY_MOE) on the same data, tokenizer and SFT recipe,
    in ``tiny-qwen3-moe-base`` / ``tiny-qwen3-moe-sft-seed<k>`` beside the dense ones. ``spec`` (default: ``model``'s
    built-in size, see ``model_spec``) names the directories (``model_stem``)."""
    if task not in SFT_DEFAULTS:
        raise ValueError(f"data.task: unknown embedded task {task!r} (one of {', '.join(SFT_DEFAULTS)})")
    root = Path(root)
    sft = sft or SFT_DEFAULTS[task]
    spec = spec or model_spec(model)
    stem = model_stem(spec)
    n_train = SPLIT_SIZES[task][0] if n_train is None else n_train
    n_validation = SPLIT_SIZES[task][1] if n_validation is None else n_validation
    task_root = root if task == "arithmetic" else root / task
    data_dir = task_root / "data"
    names = ("train", "validation") if task == "arithmetic" else ("train", "validation", "sft")
    splits = {name: data_dir / f"{name}.jsonl" for name in names}
    # The cache is keyed by everything that shapes the files: a change of spec, sizes or seed regenerates them
    # (and so retrains every SFT model built on them, whose marker records this key).
    data_key = {"task": task, "n_train": n_train, "n_validation": n_validation, "seed": spec.seed}
    if task == "addition":
        data_key.update(spec=asdict(ADDITION_SPEC), sft_spec=asdict(ADDITION_SFT_SPEC),
                        n_sft=n_sft or ADDITION_SFT_ROWS, data_seed=ADDITION_DATA_SEED)
    with asset_lock(task_root):  # one builder at a time per assets directory (concurrent runs wait, then reuse)
        data_marker = data_dir / ".complete"
        fresh = data_marker.exists() and json.loads(data_marker.read_text()) == data_key
        if not (fresh and all(p.exists() for p in splits.values())):
            data_marker.unlink(missing_ok=True)
            if task == "arithmetic":
                splits = math_task.generate_splits(data_dir, n_train=n_train, n_validation=n_validation, seed=spec.seed)
            else:
                splits = addition_task.generate_splits(
                    data_dir, n_train=n_train, n_validation=n_validation, seed=ADDITION_DATA_SEED + spec.seed,
                    spec=ADDITION_SPEC, n_sft=n_sft or ADDITION_SFT_ROWS, sft_spec=ADDITION_SFT_SPEC)
            data_marker.write_text(json.dumps(data_key))
        base = build_tiny_model(task_root / f"{stem}-base", spec)
        sft_dir = task_root / (f"{stem}-sft" if task == "arithmetic" else f"{stem}-sft-seed{sft.seed}")
        marker = sft_dir / ".complete"
        key = {**asdict(sft), "data": data_key, "base": spec.key()}  # the SFT recipe, its data and its base model
        if not (marker.exists() and json.loads(marker.read_text()) == key):
            log(f"bootstrap: SFT warm start of {base} on {task} ({sft.steps} steps) -> {sft_dir}")
            sft_bootstrap(base, splits.get("sft", splits["train"]), sft_dir, sft, log=log, marker=key, task=task)
        return {"model_dir": sft_dir, "base_model_dir": base, **splits}
