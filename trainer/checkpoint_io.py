"""The trainer's state on storage: the model's full state dict (gathered from data-parallel ranks), a complete
checkpoint written (weights, optimizer, scheduler, RNG, the trainer's state) and read back, in the single-worker
layout so any number of ranks resumes it (storage/checkpoint.py).

Functions of the PolicyWorker's state: ``worker`` is the PolicyWorker (trainer/policy.py) they read and update.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def full_state(worker) -> dict[str, torch.Tensor]:
    """The model's full state dict. Data-parallel: gathered to rank 0 (a collective: every rank calls it; the
    others get ``{}``)."""
    if not worker.dp.active:
        return worker.model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(worker.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def write_checkpoint(worker, uri: str, step: int, *, extra: Mapping | None = None, keep_last_k: int | None = None,
                     endpoint_url: str | None = None) -> str | None:
    """Write a complete checkpoint of RL step ``step`` (storage/checkpoint.py) and prune old ones.
    Data-parallel: full weights and optimizer state gathered to rank 0 and written there in the single-worker
    layout (optimizer state indexed by parameter order), so any number of workers resumes it; a collective:
    every rank calls it, ranks > 0 return None."""
    from storage.checkpoint import CheckpointStore, model_files, rng_state

    if worker.dp.active:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        weights = full_state(worker)
        osd = get_optimizer_state_dict(worker.model, worker.optimizer,
                                       options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if worker.dp.rank != 0:
            return None
        optimizer = optimizer_state_by_index(osd, param_names(worker))
    else:
        weights, optimizer = worker.model.state_dict(), worker.optimizer.state_dict()
    store = CheckpointStore(uri, endpoint_url=endpoint_url)
    state = {"clip_bounds": list(worker.bounds()), "kv_scales": worker.kv_scales,
             "calibrated_clipping": worker.cc.state_dict() if worker.cc is not None else None,
             "skipped_updates": worker.skipped_updates, "fp8_layers": worker.fp8_layers,
             "dp_world": worker.dp.world, **(extra or {})}
    out = store.save(step, weights={k: v.detach().cpu() for k, v in weights.items()},
                     model_files=model_files(worker.model_dir),
                     optimizer={"optimizer": optimizer, "scheduler": worker.scheduler.state_dict()},
                     rng=rng_state(), state=state)
    store.prune(keep_last_k)
    return out


def param_names(worker) -> list[str]:
    """Parameter names in the optimizer's order (``model.parameters()``, the order of a checkpoint's optimizer
    state indices)."""
    return [n for n, _ in worker.model.named_parameters()]


def state_keys(worker) -> set[str]:
    return set(worker.model.state_dict().keys())


@torch.no_grad()
def load_full_state_dp(worker, weights: Mapping[str, torch.Tensor], optimizer: Mapping) -> None:
    """Data-parallel load of a full (single-worker layout) checkpoint: every rank slices its own shard of each
    parameter and of its AdamW moments from the full tensors (``distribute_tensor`` with no source rank: no
    communication), and takes the optimizer's hyper-parameters. (Data-parallel FP8 linears keep no weight cache
    that could go stale: trainer.dp.shard_model.)"""
    from torch.distributed.tensor import DTensor, distribute_tensor

    def local(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if isinstance(like, DTensor):
            return distribute_tensor(full.to(like.dtype), like.device_mesh, like.placements, src_data_rank=None)
        return full.to(like.dtype).clone()

    params = dict(worker.model.named_parameters())
    for name, p in params.items():
        p.copy_(local(weights[name], p))
    for name, buf in worker.model.named_buffers():
        if name in weights:
            buf.copy_(weights[name])
    names = param_names(worker)
    saved_groups = optimizer["param_groups"]
    if len(saved_groups) != len(worker.optimizer.param_groups):
        raise ValueError(f"checkpoint optimizer has {len(saved_groups)} parameter groups, the trainer "
                         f"{len(worker.optimizer.param_groups)}")
    for group, saved in zip(worker.optimizer.param_groups, saved_groups, strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
    worker.optimizer.state.clear()
    for i, st in optimizer["state"].items():
        p = params[names[int(i)]]
        worker.optimizer.state[p] = {k: (v.clone() if k == "step" else local(v, p)) for k, v in st.items()}


def read_checkpoint(worker, uri: str, step: int | None = None, *, endpoint_url: str | None = None) -> dict:
    """Restore weights, optimizer, scheduler, RNG, clip bounds and KV scales; returns the trainer state."""
    from storage.checkpoint import CheckpointStore, set_rng_state

    ck = CheckpointStore(uri, endpoint_url=endpoint_url).load(step)
    if worker.dp.active:  # every rank reads the full checkpoint and keeps its shard (any M can resume any M')
        keys = state_keys(worker)
        missing, unexpected = sorted(keys - set(ck.weights)), sorted(set(ck.weights) - keys)
        if missing or unexpected:
            raise ValueError(f"{ck.uri}: checkpoint does not match the model (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]})")
        load_full_state_dp(worker, ck.weights, ck.optimizer["optimizer"])
    else:
        missing, unexpected = worker.model.load_state_dict(ck.weights, strict=False)
        if missing or unexpected:
            raise ValueError(f"{ck.uri}: checkpoint does not match the model (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]})")
        worker.optimizer.load_state_dict(ck.optimizer["optimizer"])
    worker.scheduler.load_state_dict(ck.optimizer["scheduler"])
    if ck.rng is not None:
        set_rng_state(ck.rng)
    st = ck.state
    if worker.cc is not None and st.get("calibrated_clipping"):
        worker.cc.load_state_dict(st["calibrated_clipping"])
    worker.kv_scales = st.get("kv_scales")
    worker.skipped_updates = int(st.get("skipped_updates", 0))
    worker.step = ck.step
    return {**st, "step": ck.step, "uri": ck.uri}


def optimizer_state_by_index(osd: Mapping, names: Sequence[str]) -> dict:
    """torch.distributed.checkpoint's full optimizer state (keyed by parameter name) -> ``optimizer.state_dict()``'s
    layout (keyed by the parameter's position in ``names``), what a single worker saves and loads."""
    index = {n: i for i, n in enumerate(names)}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[n] for n in g["params"]]}
              for g in osd["param_groups"]]
    return {"state": {index[n]: v for n, v in osd["state"].items()}, "param_groups": groups}
