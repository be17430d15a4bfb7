"""Rollout fan-out and placement: how a step's prompt groups are split over the engines,
the placement-group bundles, and the cluster.* keys that configure them."""
from pathlib import Path

import pytest

from cluster.runtime import placement_bundles, split_groups
from configs.schema import ConfigError, load_config
from rollout.engine import gather_rollouts

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "tiny_fp8_e2e.yaml"


@pytest.mark.parametrize("prompts, engines, expected", [
    (16, 1, [(0, 16)]),
    (16, 2, [(0, 8), (8, 16)]),
    (7, 3, [(0, 3), (3, 5), (5, 7)]),  # sizes differ by at most one, the larger first
    (2, 4, [(0, 1), (1, 2)]),  # engines beyond the prompt count get nothing
    (0, 2, [(0, 0)]),
])
def test_split_groups_covers_the_prompts_in_order(prompts, engines, expected):
    ranges = split_groups(prompts, engines)
    assert ranges == expected
    assert [i for a, b in ranges for i in range(a, b)] == list(range(prompts))


def test_split_groups_rejects_nonsense():
    with pytest.raises(ValueError, match="num_engines >= 1"):
        split_groups(4, 0)


def test_gather_keeps_prompt_order_and_renumbers():
    part0 = [{"prompt_index": 0, "samples": ["a"]}, {"prompt_index": 1, "samples": ["b"]}]
    part1 = [{"prompt_index": 0, "samples": ["c"]}]
    out = gather_rollouts(part0, part1)
    assert [(r["prompt_index"], r["samples"]) for r in out] == [(0, ["a"]), (1, ["b"]), (2, ["c"])]
    assert part1[0]["prompt_index"] == 0  # inputs untouched


def test_placement_bundles_policy_first_then_one_per_engine():
    cfg = load_config(RECIPE, ["cluster.rollout_workers=3", "ray.rollout_worker.num_cpus=2",
                               "ray.policy_worker.num_cpus=1"])
    assert placement_bundles(cfg) == [{"CPU": 1.0}, {"CPU": 2.0}, {"CPU": 2.0}, {"CPU": 2.0}]
    gpu = load_config(RECIPE, ["cluster.rollout_workers=2", "ray.rollout_worker.num_gpus=1",
                               "ray.policy_worker.num_gpus=2", "cluster.gpus_per_node=4"])
    assert placement_bundles(gpu)[0] == {"CPU": 1.0, "GPU": 2.0} and placement_bundles(gpu)[2] == {"CPU": 1.0,
                                                                                                    "GPU": 1.0}


@pytest.mark.parametrize("overrides, key, needle", [
    (["cluster.policy_workers=0"], "cluster.policy_workers", "data-parallel trainers"),
    (["cluster.collective_timeout_s=0"], "cluster.collective_timeout_s", "must be in"),
    (["cluster.rollout_workers=0"], "cluster.rollout_workers", "must be >= 1"),
    (["cluster.placement_strategy=RANDOM"], "cluster.placement_strategy", "RANDOM"),
    (["ray.rollout_worker.num_cpus=0"], "ray.rollout_worker.num_cpus", "cannot be empty"),
    (["cluster.rollout_workers=3", "ray.rollout_worker.num_gpus=1", "cluster.gpus_per_node=2"],
     "cluster.gpus_per_node", "= 3.0 exceed"),
    (["cluster.policy_workers=2", "ray.policy_worker.num_gpus=1", "cluster.gpus_per_node=2",
      "cluster.collective_timeout_s=60"], "cluster.collective_timeout_s", ">= 600 or null"),
])
def test_cluster_keys_rejected_with_their_path(overrides, key, needle):
    with pytest.raises(ConfigError) as e:
        load_config(RECIPE, overrides)
    assert str(e.value).startswith(key + ":") and needle in str(e.value), str(e.value)


def test_the_collective_timeout_defaults_to_the_trainers_device():
    """Null: 60 s for CPU trainers (a dead rank fails fast), 600 s for GPU trainers (NCCL waits while rank 0 does CPU
    work); a value set is kept, and with GPU trainers it may be 600 s or more."""
    from configs.base import collective_timeout_s

    cpu = load_config(RECIPE, ["cluster.policy_workers=2"])
    gpu = load_config(RECIPE, ["cluster.policy_workers=2", "ray.policy_worker.num_gpus=1", "cluster.gpus_per_node=2"])
    assert cpu.cluster.collective_timeout_s is None and gpu.cluster.collective_timeout_s is None
    assert collective_timeout_s(None, cpu.ray.policy_worker.num_gpus) == 60.0
    assert collective_timeout_s(None, gpu.ray.policy_worker.num_gpus) == 600.0
    kept = load_config(RECIPE, ["cluster.policy_workers=2", "ray.policy_worker.num_gpus=1", "cluster.gpus_per_node=2",
                                "cluster.collective_timeout_s=900"])
    assert collective_timeout_s(kept.cluster.collective_timeout_s, 1) == 900.0
    assert collective_timeout_s(load_config(RECIPE, ["cluster.collective_timeout_s=5"]).cluster.collective_timeout_s,
                                0) == 5.0
