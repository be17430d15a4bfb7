"""The benchmark workload both sides run: the project's embedded SFT model, its training prompts (chat template),
its verifier reward, and the GRPO batch of the tiny recipes (16 prompts x 8 generations x 32 new tokens, two
optimizer updates of 64). Shared by bench/step.py (the project) and bench/trl_step.py (TRL), so neither side can
drift to an easier job."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Workload:
    model_dir: str
    train_path: str
    num_prompts: int = 16
    num_generations: int = 8
    max_new_tokens: int = 32
    global_batch: int = 64  # two optimizer updates per step
    micro_batch: int = 32
    lr: float = 5e-5
    temperature: float = 1.0
    seed: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Workload:
        return cls(**json.loads(text))


def default_workload(assets_dir: str | Path = ROOT / "runs" / "assets", *, quick: bool = False) -> Workload:
    """The embedded SFT warm start the runs use (runs/assets, built by the bootstrap: data, tiny Qwen3, 300-step
    SFT; built here when missing), or with ``quick`` the tests' 12-step SFT model (same architecture and shapes,
    built in seconds; timing-equivalent, less peaked)."""
    if quick:
        from diagnostics.mismatch import quick_sft_model

        root = ROOT / "runs" / "test-env" / "models"
        model = quick_sft_model(root)
        return Workload(model_dir=str(model), train_path=str(root / "sft-data" / "train.jsonl"))
    from embedded.bootstrap import ensure_default_assets

    a = ensure_default_assets(assets_dir, task="arithmetic")
    return Workload(model_dir=str(a["model_dir"]), train_path=str(a["train"]))


def step_rows(w: Workload, step: int) -> list[dict]:
    """The prompts (question, answer) of RL step ``step``: the same selection rule as the flow (data.loading)."""
    from data.loading import load_split, rows, step_indices

    ds = load_split(w.train_path)
    idx = step_indices(len(ds), step=step, num_prompts=w.num_prompts, seed=w.seed)
    return rows(ds, question_key="question", answer_key="answer", indices=idx)


def reward(text: str, answer: str) -> float:
    from rewards.math_task import reward as math_reward

    return float(math_reward(text, answer))
