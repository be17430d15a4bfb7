"""The run context that flows hand to tasks: frozen, typed, small (names and numbers only -- weights, rollouts and
KV scales travel through Ray). Built once per run from the recipe by :meth:`RunContext.from_config`."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from configs.base import collective_timeout_s
from configs.schema import GenerationCfg
from data.prompt import PromptFormat
from process.faults import TestHooks


@dataclass(frozen=True)
class EvalParams:
    """Validation beyond greedy accuracy (``evaluation.*``): ``n`` samples per prompt at the rollout temperature for
    pass@k / avg@k (0 = off) on the first ``max_prompts`` prompts of each set."""

    n: int
    ks: tuple[int, ...]
    max_prompts: int
    n_boot: int
    sets: tuple[str, ...] = ("main",)  # the sets that get sampled evaluation


@dataclass(frozen=True)
class CheckpointTarget:
    uri: str | None  # None: checkpointing off
    keep_last_k: int | None
    endpoint_url: str | None


def _as_scored(records: list[dict], seed: int) -> list[dict]:
    return records


@dataclass(frozen=True)
class RunContext:
    policy: str  # Ray actor names (tasks look actors up by name; handles never cross Prefect)
    rollouts: tuple[str, ...]  # the vLLM engines (cluster.rollout_workers): each step's prompt groups are split over them
    run_id: str | None  # MLflow
    tracking_uri: str | None
    model_dir: str
    seed: int
    recipe: str
    gen: GenerationCfg  # policy.generation, as the schema has it (the engine reads its vllm_cfg itself)
    group_size: int  # grpo.num_generations_per_prompt: samples per prompt
    prompt: PromptFormat  # how a row's question becomes the prompt (data.system_prompt*, data.prompt_file)
    kv_fp8: bool  # FP8 KV cache: calibrate scales every kv_period steps, hand them to the next refit
    kv_period: int
    kv_samples: int
    val_batch_size: int
    checkpoint: CheckpointTarget
    rollout_fp8_spec: dict | None  # fp8core.spec.FP8Spec fields of the engine (saved with checkpoints for export)
    eval: EvalParams = EvalParams(n=0, ks=(), max_prompts=0, n_boot=2000)
    policy_ranks: tuple[str, ...] = ()  # every data-parallel trainer, rank 0 (``policy``) first; () = just ``policy``
    rollout_max_restarts: int = 0  # cluster.rollout_max_restarts: steps broken by a dead engine are redone this often
    refit_transport: str = "collective"  # cluster.refit_transport: collective (the refit group) | object_store
    collective_timeout_s: float = 60.0  # the trainers' collective timeout; also the refit group's
    hooks: TestHooks | None = None  # TEST-ONLY faults (process/faults.py): None unless testing.* keys are set
    # What the validation records go through before they are scored: as they are in a real run; TEST-ONLY
    # (testing.fault_val_accuracy_drop) the hooks' degradation, installed here so the validation task has no branch
    validation_records: Callable[[list[dict], int], list[dict]] = _as_scored

    @property
    def trainers(self) -> tuple[str, ...]:
        """The trainer actors every policy call goes to (collectives: all ranks take part)."""
        return self.policy_ranks or (self.policy,)

    @classmethod
    def from_config(cls, cfg, *, policy: str, rollouts: tuple[str, ...], run_id: str | None, tracking_uri: str | None,
                    model_dir: str, checkpoint_uri: str | None, policy_ranks: tuple[str, ...] = (),
                    hooks: TestHooks | None = None) -> RunContext:
        """The run's context from its recipe and the started workers; ``hooks``: the run's TEST-ONLY hooks, built
        once by the flow (``TestHooks.from_config``; None in a real run)."""
        gen, cal, ck, ev = cfg.policy.generation, cfg.calibration, cfg.checkpointing, cfg.evaluation
        spec = cfg.rollout_fp8_spec()
        return cls(policy=policy, policy_ranks=tuple(policy_ranks), rollouts=tuple(rollouts), run_id=run_id, tracking_uri=tracking_uri, model_dir=str(model_dir),
                   seed=cfg.grpo.seed, recipe=cfg.recipe,
                   gen=gen, group_size=cfg.grpo.num_generations_per_prompt,
                   prompt=PromptFormat.from_config(cfg.data),
                   kv_fp8=gen.vllm_cfg.kv_fp8, kv_period=max(1, cal.kv_scales_period),
                   kv_samples=cal.kv_calibration_samples, val_batch_size=cfg.grpo.val_batch_size,
                   checkpoint=CheckpointTarget(uri=checkpoint_uri, keep_last_k=ck.keep_last_k,
                                               endpoint_url=ck.s3_endpoint_url),
                   rollout_fp8_spec=None if spec is None else asdict(spec),
                   eval=EvalParams(n=ev.num_samples, ks=tuple(ev.pass_k), max_prompts=ev.sampled_max_prompts,
                                   n_boot=ev.bootstrap_samples, sets=tuple(ev.sampled_sets)),
                   rollout_max_restarts=cfg.cluster.rollout_max_restarts,
                   refit_transport=cfg.cluster.refit_transport,
                   collective_timeout_s=collective_timeout_s(cfg.cluster.collective_timeout_s,
                                                             cfg.ray.policy_worker.num_gpus),
                   hooks=hooks, **({"validation_records": hooks.degrade} if hooks and hooks.val_accuracy_drop else {}))
