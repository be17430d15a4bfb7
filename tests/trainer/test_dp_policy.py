"""Data-parallel trainers: ``cluster.policy_workers=2`` FSDP2-sharded PolicyWorkers -- Ray actors
in one gloo process group, started as the pipeline starts them (cluster.runtime.start_policy_workers) -- against one
worker on the same batch.

Tolerances. The batch (8 rows: 2 prompts x 4 samples) is split into 2 optimizer updates of 4 rows and micro-batches of
2 rows; with 2 ranks each takes 2 rows of an update, i.e. exactly one micro-batch of the single-worker run. The
forwards therefore see the same rows in the same micro-batches, so FP8 rounding -- whose 1x128 activation and
gradient groups run along tokens and would change with a different row split -- is identical, and only the order of
the gradient sum (reduce-scatter vs local accumulation) differs: gradients agree to a relative L2 error of 1e-5
(FP32 summation-order noise is ~1e-7; a wrong loss normalizer, e.g. the local instead of the global token count,
is a factor 2). Weights after Adam's first, sign-like step are not compared elementwise; the gathered weights,
refit payload and KV scales before training must be bit-identical. Checkpoints: 2 ranks -> 2 ranks resumes bit for
bit (gradients and metrics); 2 -> 1 and 1 -> 2 restore the exact masters, and the next update's gradients agree to
1e-5.

The second update of a step is compared too (1e-5). It depends on two more things being world-size invariant:
the clip coefficient (trainer.dp.clip_grad_norm sums the norm in float64 over shards and ranks; torch's FP32 norm
differed by 5e-6 relative between 1 and 2 ranks) and the old logprobs of its rows, computed before the first update
in no-grad batches (trainer.dp.share_batches gives each rank whole batches of the single worker's grouping; a share
of rows regrouped them, and with emulated BF16 on an AVX2 CPU the second update's gradients differed by 2.4e-3).
With both, this CPU (AVX2 EPYC) gives 0.0 for both updates in BF16 and FP8. Any ulp left in the masters could still
flip E4M3 codes (one code step is 6-12% of a value) on another CPU, which is why later steps after a resume with
another M are compared only on their first update."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.runtime import RAY_CALL
from configs.schema import config_from_dict
from trainer.policy import PolicyWorker

ROOT = Path(__file__).resolve().parents[2]
REWARDS = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def model_dir():
    from embedded.tiny_model import TinyModelSpec, build_tiny_model

    return build_tiny_model(ROOT / "runs" / "test-env" / "policy-tiny",
                            TinyModelSpec(num_hidden_layers=2, tokenizer_corpus_size=2000))


@pytest.fixture(scope="module")
def ray_local(tmp_path_factory):
    import ray

    from cluster.runtime import init_ray
    from configs.schema import Config

    started = init_ray(Config(), tmp_path_factory.mktemp("ray-run"))
    yield
    if started:
        ray.shutdown()


def _cfg(world: int, **over):
    base = {"policy": {"train_global_batch_size": 4, "train_micro_batch_size": 2, "logprob_batch_size": 2,
                       "threads": 1, "optimizer": {"lr": 1e-3}},
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4, "max_num_steps": 10},
            "cluster": {"policy_workers": world}, "ray": {"policy_worker": {"num_cpus": 0.25}}}
    return config_from_dict(base, [f"{k}={v}" for k, v in over.items()])


def _rollouts(model_dir):
    """2 prompts x 4 responses of different lengths; rollout logprobs -0.5 per token (an engine close to the policy
    is not needed for gradient equivalence)."""
    from transformers import AutoTokenizer

    from embedded.tiny_model import chat_prompt

    tok = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for i, q in enumerate(["What is 1 plus 2?", "What is 3 plus 4?"]):
        p = tok(chat_prompt(tok, q), add_special_tokens=False).input_ids
        samples = []
        for j, guess in enumerate([("3", "7")[i], "5", "31", "2"]):
            ids = tok(f"x = {guess}. The answer is \\boxed{{{guess}}}." + tok.eos_token,
                      add_special_tokens=False).input_ids[: 8 + 3 * j]
            samples.append({"token_ids": ids, "logprobs": [-0.5] * len(ids), "text": tok.decode(ids)})
        out.append({"prompt_token_ids": p, "samples": samples})
    return out


def _start(cfg, model_dir, tmp_path, tag):
    import ray

    from cluster.runtime import start_policy_workers

    names, handles = start_policy_workers(cfg, model_dir, tmp_path, tag, env={"OMP_NUM_THREADS": "1"})
    info = ray.get([h.info.remote() for h in handles])
    assert [(i["dp_rank"], i["dp_world"]) for i in info] == [(r, len(names)) for r in range(len(names))]
    return names, handles


def _kill(handles):
    import ray

    for h in handles:
        try:
            ray.kill(h, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _grads_and_metrics(names, rollouts, step=1):
    from cluster.runtime import policy_call
    from process.faults import TestHooks

    policy_call(names, RAY_CALL, lambda self: setattr(self, "hooks", TestHooks(record_gradients=True)))
    m = policy_call(names, PolicyWorker.train_step, rollouts, REWARDS, step=step)
    grads = policy_call(names, RAY_CALL, lambda self: self.hooks.recorded_gradients)
    return grads, m


def _updates(names):
    """The full gradients of every optimizer update of the last train_step (before clipping)."""
    from cluster.runtime import policy_call

    return policy_call(names, RAY_CALL, lambda self: self.hooks.recorded_updates)


def _norm(grads: dict) -> float:
    return float(torch.stack([g.double().norm() for g in grads.values()]).norm())


@pytest.mark.parametrize("precision", ["fp8_blockwise", "bfloat16"])
def test_two_ranks_match_one_worker(model_dir, ray_local, tmp_path, precision):
    from cluster.runtime import policy_call

    over = ({"policy.megatron_cfg.fp8_cfg.enabled": "true", "policy.precision": "bfloat16"}
            if precision == "fp8_blockwise" else {"policy.precision": "bfloat16"})
    ro = _rollouts(model_dir)
    one, one_h = _start(_cfg(1, **over), model_dir, tmp_path, f"one-{precision}")
    two, two_h = _start(_cfg(2, **over), model_dir, tmp_path, f"two-{precision}")
    try:
        # before training: the gathered masters (and the refit payload) are the single worker's, bit for bit
        w1, w2 = policy_call(one, PolicyWorker.weights), policy_call(two, PolicyWorker.weights)
        assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
        r1, r2 = policy_call(one, PolicyWorker.refit_weights), policy_call(two, PolicyWorker.refit_weights)
        assert r1.keys() == r2.keys() and all(torch.equal(r1[k], r2[k]) for k in r1)
        # KV-cache scales: each rank's share of the micro-batches, the 99.9th percentile over all of them
        k1 = policy_call(one, PolicyWorker.calibrate_kv_scales, ro, max_samples=8)
        k2 = policy_call(two, PolicyWorker.calibrate_kv_scales, ro, max_samples=8)
        assert k1 == k2

        g1, m1 = _grads_and_metrics(one, ro)
        g2, m2 = _grads_and_metrics(two, ro)
        assert g1.keys() == g2.keys() and len(g1) == len(w1)
        worst = max((_rel(g2[k], g1[k]), k) for k in g1)
        print(f"\n[{precision}: worst gradient relative L2 error 2 ranks vs 1: {worst[0]:.2e} ({worst[1]})]")
        assert worst[0] < 1e-5, worst
        # the second update: from masters the first moved (clipped by the same float64 norm), with old logprobs of
        # its rows from the same batches as one worker's (trainer.dp.share_batches)
        u1, u2 = _updates(one), _updates(two)
        assert len(u1) == len(u2) == m1["train/optimizer_updates"] == 2
        second = max((_rel(u2[1][k], u1[1][k]), k) for k in u1[1])
        print(f"[{precision}: second update's worst gradient relative L2 error 2 ranks vs 1: {second[0]:.2e} "
              f"({second[1]})]")
        assert second[0] < 1e-5, second
        # train/grad_norm: the mean over the updates of each one's norm before clipping, summed in float64
        for m, u in ((m1, u1), (m2, u2)):
            assert m["train/grad_norm"] == pytest.approx(sum(_norm(g) for g in u) / len(u), rel=1e-9)
        for key in ("loss/total", "train/grad_norm", "mismatch/token_mult_prob_error", "policy/entropy",
                    "clip/lower_neg_adv_frac", "train/optimizer_updates", "train/tokens"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-9), key
        # after the step: the same parameters, moved by Adam's first (sign-like) step of lr 1e-3 from the same start
        a1, a2 = policy_call(one, PolicyWorker.weights), policy_call(two, PolicyWorker.weights)
        for k in a1:
            assert (a1[k] - a2[k]).abs().max() <= 2.01e-3, k
        assert sum(int(((a1[k] - a2[k]).abs() > 1e-6).sum()) for k in a1) < 1e-3 * sum(v.numel() for v in a1.values())
    finally:
        _kill(one_h + two_h)


def test_checkpoint_round_trip(model_dir, ray_local, tmp_path):
    import ray

    from cluster.runtime import policy_call, policy_refs

    over = {"policy.megatron_cfg.fp8_cfg.enabled": "true", "policy.precision": "bfloat16"}
    ro = _rollouts(model_dir)
    uri = f"file://{tmp_path}/ck"
    started = []
    try:
        two, h = _start(_cfg(2, **over), model_dir, tmp_path, "ck-two")
        started += h
        policy_call(two, PolicyWorker.train_step, ro, REWARDS, step=1)
        refs = policy_refs(two, PolicyWorker.refit_weights)
        assert ray.get(refs[1]) == {} and len(ray.get(refs[0])) > 0  # only rank 0 ships
        saved = ray.get(policy_refs(two, PolicyWorker.save_checkpoint, uri, 1, extra={"mlflow_run_id": "r"}))
        assert saved[0].endswith("step_000001") and saved[1] is None  # rank 0 writes
        w_two = policy_call(two, PolicyWorker.weights)

        # 2 -> 2: a resumed group continues exactly as the one that wrote the checkpoint
        again, h = _start(_cfg(2, **over), model_dir, tmp_path, "ck-again")
        started += h
        st = policy_call(again, PolicyWorker.load_checkpoint, uri, 1)
        assert st["step"] == 1 and st["dp_world"] == 2 and st["mlflow_run_id"] == "r"
        g_two, m_two = _grads_and_metrics(two, ro, step=2)
        g_again, m_again = _grads_and_metrics(again, ro, step=2)
        assert all(torch.equal(g_two[k], g_again[k]) for k in g_two)
        assert {k: m_again[k] for k in m_two if not k.startswith("time/") and "per_s" not in k} == {
            k: m_two[k] for k in m_two if not k.startswith("time/") and "per_s" not in k}
        _kill(started[:2])  # the writing group; the resumed one takes the 1 -> 2 checkpoint below
        started = started[2:]

        # 2 -> 1: the same masters and optimizer state on one worker; its first update's gradients are the group's
        # (the second update's are not compared: FP8 codes of masters that differ by an ulp from the summation
        # order of the first update's gradients may round differently)
        one, h = _start(_cfg(1, **over), model_dir, tmp_path, "ck-one")
        started += h
        policy_call(one, PolicyWorker.load_checkpoint, uri, 1)
        w_one = policy_call(one, PolicyWorker.weights)
        assert w_one.keys() == w_two.keys() and all(torch.equal(w_one[k], w_two[k]) for k in w_two)
        g_one, _ = _grads_and_metrics(one, ro, step=2)
        assert max(_rel(g_one[k], g_two[k]) for k in g_two) < 1e-5

        # 1 -> 2: the single worker's checkpoint resumes on 2 ranks with its exact masters (loaded into the group
        # resumed above, which has trained a step of its own since: everything it holds must be replaced)
        policy_call(one, PolicyWorker.save_checkpoint, uri, 2)
        back = again
        assert policy_call(back, PolicyWorker.load_checkpoint, uri, 2)["step"] == 2
        w_back, w_one = policy_call(back, PolicyWorker.weights), policy_call(one, PolicyWorker.weights)
        assert all(torch.equal(w_back[k], w_one[k]) for k in w_one)
        g_back, _ = _grads_and_metrics(back, ro, step=3)
        g_one, _ = _grads_and_metrics(one, ro, step=3)
        assert max(_rel(g_back[k], g_one[k]) for k in g_one) < 1e-5
    finally:
        _kill(started)


def _install_gather_probe(self):
    """(On each rank.) Record, at every linear's forward and backward, how many FSDP units hold full weights."""
    import torch as t

    from trainer.dp import gathered_units

    self.gather_probe = {"forward": [], "backward": []}

    def fwd(mod, args, out):
        self.gather_probe["forward"].append(gathered_units(self.model))

    def bwd(mod, grad_in, grad_out):
        self.gather_probe["backward"].append(gathered_units(self.model))

    for m in self.model.modules():
        if isinstance(m, t.nn.Linear):
            m.register_forward_hook(fwd)
            m.register_full_backward_hook(bwd)


def test_ranks_gather_one_layer_at_a_time(tmp_path, ray_local):
    """Per-layer sharding on a 4-layer model (5 FSDP units: 4 decoder layers + the root): while any linear computes,
    forward or backward, a rank holds at most the root + one decoder layer + FSDP's backward prefetch of the next
    one, and nothing stays gathered after a step or a no-grad pass. Rows per update (3) and no-grad batches (3)
    that 2 ranks cannot split evenly make rank 1 pad (a zero-weighted micro-batch, a discarded forward); the
    gradients still match one worker's."""
    from cluster.runtime import policy_call
    from embedded.tiny_model import TinyModelSpec, build_tiny_model
    from trainer.dp import gathered_units

    model = build_tiny_model(ROOT / "runs" / "test-env" / "policy-tiny-4l",
                             TinyModelSpec(num_hidden_layers=4, tokenizer_corpus_size=2000))
    ro = [{**r, "samples": r["samples"][:3]} for r in _rollouts(model)]
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    over = {"policy.megatron_cfg.fp8_cfg.enabled": "true", "policy.precision": "bfloat16",
            "grpo.num_generations_per_prompt": "3", "policy.train_global_batch_size": "3",
            "policy.train_micro_batch_size": "1", "policy.logprob_batch_size": "2"}
    one, one_h = _start(_cfg(1, **over), model, tmp_path, "probe-one")
    two, two_h = _start(_cfg(2, **over), model, tmp_path, "probe-two")
    # the same ranks with activation checkpointing: each layer's recompute runs inside its backward's gathering
    ac, ac_h = _start(_cfg(2, **over, **{"policy.megatron_cfg.activation_checkpointing": "true"}), model, tmp_path,
                      "probe-two-ac")
    try:
        import ray

        from cluster.runtime import policy_refs
        from process.faults import TestHooks

        for names in (two, ac):
            policy_call(names, RAY_CALL, _install_gather_probe)
        for names in (one, two, ac):
            policy_call(names, RAY_CALL, lambda self: setattr(self, "hooks", TestHooks(record_gradients=True)))
        m1 = policy_call(one, PolicyWorker.train_step, ro, rewards, step=1)
        m2 = policy_call(two, PolicyWorker.train_step, ro, rewards, step=1)
        policy_call(ac, PolicyWorker.train_step, ro, rewards, step=1)
        # recomputing gives the same gradients bit for bit, both updates (same ranks, same summation order)
        u_ac, u_two = _updates(ac), _updates(two)
        assert len(u_ac) == len(u_two) == 2
        assert all(torch.equal(u_ac[i][k], u_two[i][k]) for i in range(2) for k in u_two[i])
        assert m1["train/optimizer_updates"] == m2["train/optimizer_updates"] == 2
        # the first update: rank 0 sums micro-batches 0 and 1 of the single worker's, rank 1 micro-batch 2 and a
        # zero-weighted one; reduce-scattered per micro-batch, the sum runs (g0 + g2) + g1 instead of (g0 + g1) + g2:
        # FP32 summation-order noise only (measured 5e-8)
        u1, u2 = _updates(one), _updates(two)
        worst = max(_rel(u2[0][k], u1[0][k]) for k in u1[0])
        print(f"\n[uneven shares, 2 ranks vs 1: first update's worst gradient relative L2 error {worst:.2e}]")
        assert worst < 1e-5
        # the second update is not compared: Adam's first step is sign-like, so an element whose gradient sum lies
        # within that noise of zero moves by +lr or -lr depending on the order, and FP8 codes of the blocks it moves
        # flip (measured: the second update's gradients then differ by 3e-2). The masters stay within the two
        # updates' steps of lr 1e-3 each.
        a1, a2 = policy_call(one, PolicyWorker.weights), policy_call(two, PolicyWorker.weights)
        assert max(float((a1[k] - a2[k]).abs().max()) for k in a1) <= 4.01e-3
        score = policy_call(two, PolicyWorker.score, ro)  # a no-grad pass: 6 rows in 3 batches of 2, shared 2 + 1
        assert score["logp"].shape[0] == 6
        probes = ray.get(policy_refs(two, RAY_CALL, lambda self: (
            self.gather_probe, gathered_units(self.model))))
        for rank, (probe, after) in enumerate(probes):
            assert after == 0, (rank, after)  # nothing left gathered
            assert probe["forward"] and probe["backward"], rank
            print(f"[rank {rank}: units gathered while a linear computes: forward max {max(probe['forward'])}, "
                  f"backward max {max(probe['backward'])} of 5]")
            assert max(probe["forward"]) <= 2, (rank, max(probe["forward"]))  # the root + this layer
            assert max(probe["backward"]) <= 3, (rank, max(probe["backward"]))  # + the prefetched next layer
        for rank, (probe, after) in enumerate(ray.get(policy_refs(ac, RAY_CALL, lambda self: (
                self.gather_probe, gathered_units(self.model))))):
            # a recompute is a forward inside the backward: the root + this layer + the prefetched next one
            print(f"[activation checkpointing, rank {rank}: forward max {max(probe['forward'])}, backward max "
                  f"{max(probe['backward'])} of 5]")
            assert after == 0 and max(probe["forward"]) <= 3 and max(probe["backward"]) <= 3, (rank, after)
    finally:
        _kill(one_h + two_h + ac_h)


def test_rendezvous_rank0_binds_a_port_the_os_gives_and_the_others_learn_it(ray_local):
    """Rank 0's store is bound before its address exists anywhere else (no port chosen first and bound later by
    another process, which a CI run lost to EADDRINUSE); a rank whose rank 0 never posts fails within the group's
    timeout, naming itself and the key."""
    import ray

    from trainer.dp import DPGroup, Rendezvous, _store

    rv = ray.remote(Rendezvous).options(num_cpus=0).remote()
    assert ray.get(rv.address_of_rank0.remote()) is None
    rank0 = _store(DPGroup(0, 2, rv, 10.0))
    assert ray.get(rv.address_of_rank0.remote()).endswith(f":{rank0.port}")
    rank1 = _store(DPGroup(1, 2, rv, 10.0))
    rank1.set("from-rank-1", "seen")
    assert rank0.get("from-rank-1") == b"seen"

    lonely = ray.remote(Rendezvous).options(num_cpus=0).remote()
    with pytest.raises(TimeoutError, match=r"rank 1 of 2: rank 0 did not open .* within 0.3 s "
                                           r"\(cluster.collective_timeout_s\)"):
        _store(DPGroup(1, 2, lonely, 0.3))
