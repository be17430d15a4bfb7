"""The FP8 contract through the pipeline's own refit path: rollout -> reward -> PolicyWorker.train_step (a real AdamW
update, so the FP32 masters leave the BF16 grid) -> ``PolicyWorker.weights()`` -> ``RolloutWorker.refit`` (what
tasks/rl.py ``refit`` sends actor to actor) leaves the engine's FP8 weights bit-identical to the trainer's own
``FP8Linear.quantized_weight()``. The engine is built from the recipe (``RolloutWorker(model_dir, cfg)``), as
``start_workers`` does, so the rollout and trainer settings come from the same recipe the pipeline runs.

Before the fix, refit shipped BF16 copies: the engine held ``quantize(bf16(w))`` while the trainer used
``quantize(w)``. The test also checks that such a BF16 refit *would* be caught (it differs after a real update).
"""
from pathlib import Path

import pytest
import torch

from configs.schema import load_config
from fp8core.quant import quantize

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "runs" / "test-env" / "models"

pytestmark = pytest.mark.slow  # vLLM engine + a real train step


@pytest.fixture(scope="module")
def model_dir():
    from diagnostics.mismatch import quick_sft_model

    return quick_sft_model(MODELS)


def _cfg(tmp, recipe="blockwise", pow2=True, first=1, last=0):
    # recipe options the engine must mirror: the rollout keys are left unset, so they follow the trainer's
    f8 = "policy.megatron_cfg.fp8_cfg"
    over = ["policy.precision=float32", "policy.optimizer.lr=1e-3", "policy.train_global_batch_size=8",
            "policy.train_micro_batch_size=4", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4",
            f"{f8}.fp8_recipe={recipe}", f"{f8}.num_first_layers_in_bf16={first}",
            f"{f8}.num_last_layers_in_bf16={last}", f"{f8}.pow2_weight_scaling_factors={str(pow2).lower()}",
            f"{f8}.pow2_activation_scaling_factors={str(pow2).lower()}",
            "policy.generation.vllm_cfg.kv_cache_memory_bytes=16777216", f"run_dir={tmp}",
            f"{f8}.backend=cpu"]  # the CPU FP8 GEMM on every CPU kind (auto keeps the emulation without BF16 units)
    return load_config(ROOT / "configs" / "tiny_fp8_e2e.yaml", over)


_FUSED = {"qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")), "o_proj": ("self_attn", ("o_proj",)),
          "gate_up_proj": ("mlp", ("gate_proj", "up_proj")), "down_proj": ("mlp", ("down_proj",))}


def _trained_policy_and_engine(model_dir, cfg):
    """A PolicyWorker after one real GRPO update on rollouts from an engine built as start_workers builds it."""
    import random

    from embedded.tiny_model import chat_prompt
    from rewards.math_task import make_problem, reward
    from rollout.engine import RolloutWorker
    from trainer.policy import PolicyWorker

    policy = PolicyWorker(model_dir, cfg, run_dir=cfg.run_dir)
    engine = RolloutWorker(model_dir, cfg, run_dir=Path(cfg.run_dir) / "rollout")
    rng = random.Random(0)
    rows = [make_problem(rng) for _ in range(cfg.grpo.num_prompts_per_step)]
    outs = engine.generate([chat_prompt(engine.tokenizer, r["question"]) for r in rows],
                           n=cfg.grpo.num_generations_per_prompt, max_tokens=16, seed=0)
    rewards = [reward(s["text"], r["answer"]) for o, r in zip(outs, rows, strict=True) for s in o["samples"]]
    rewards[0] = 1.0 - rewards[0]  # at least one group with mixed rewards: a non-zero update
    m = policy.train_step(outs, rewards, step=1)
    assert m["train/optimizer_updates"] >= 1
    return policy, engine


def _assert_engine_holds_trainer_fp8(policy, engine, first: int, last: int) -> int:
    trainer = {name: mod.quantized_weight() for name, mod in policy.model.named_modules()
               if hasattr(mod, "quantized_weight")}
    fp8_layers = set(range(first, 4 - last))
    assert trainer and {int(n.split(".")[2]) for n in trainer} == fp8_layers
    def held_by_engine(model):  # {fused linear: [(FP8 data, scale) per partition] or None when not FP8}
        return {name: [(q.data.clone(), q.scale.clone()) for q in m.quant_method.partitions(m)]
                if hasattr(m.quant_method, "partitions") else None
                for name, m in model.named_modules() if name.endswith(tuple(_FUSED))}

    checked = 0
    for name, held in engine.llm.apply_model(held_by_engine)[0].items():
        layer = int(name.split(".")[2])
        if layer not in fp8_layers:
            assert held is None, name
            continue
        sub, parts = _FUSED[name.rsplit(".", 1)[1]]
        assert len(held) == len(parts)
        for (d, sc), part in zip(held, parts, strict=True):
            q = trainer[f"model.layers.{layer}.{sub}.{part}"]
            assert torch.equal(d.view(torch.uint8), q.data.view(torch.uint8)), (name, part)
            assert torch.equal(sc, q.scale), (name, part)
            checked += 1
    assert checked == len(trainer)
    return checked


def _engine_vs_trainer_outputs(policy, engine, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One FP8 linear (down_proj of ``layer``) on the same BF16 input tensor in the engine and in the trainer."""
    x = (torch.randn(7, policy.model.config.intermediate_size, generator=torch.Generator().manual_seed(4)) * 2
         ).to(torch.bfloat16)
    name = f"model.layers.{layer}.mlp.down_proj"
    y_engine = engine.llm.apply_model(lambda model: (lambda m: m.quant_method.apply(m, x))(model.get_submodule(name)))[0]
    with torch.no_grad():
        y_trainer = policy.model.get_submodule(name)(x)
    return y_engine, y_trainer


def _decode_rows_vs_trainer(policy, engine, layer: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Every input row an engine FP8 linear (down_proj of ``layer``) saw during a real generate -- the prefill and
    decode batches vLLM formed, of changing sizes -- with the engine's outputs; and the trainer's FP8Linear on all
    of those rows stacked into one batch. Returns (engine outputs, trainer outputs, the engine's batch sizes)."""
    name = f"model.layers.{layer}.mlp.down_proj"

    def install(model):
        m, rec = model.get_submodule(name), []

        def keep(mod, args, out):
            y = out[0] if isinstance(out, tuple) else out
            x = args[0].detach()
            rec.append((x.reshape(-1, x.shape[-1]).clone(), y.detach().reshape(-1, y.shape[-1]).clone()))

        m._fp8grpo_record = (m.register_forward_hook(keep), rec)

    def collect(model):
        m = model.get_submodule(name)
        handle, rec = m._fp8grpo_record
        handle.remove()
        del m._fp8grpo_record
        return rec

    engine.llm.apply_model(install)
    try:
        engine.generate(["1 + 1 =", "What is 12 + 30?", "7"], n=3, max_tokens=12, temperature=1.0, seed=3)
    finally:
        rec = engine.llm.apply_model(collect)[0]
    xs = torch.cat([x for x, _ in rec])
    with torch.no_grad():
        y_trainer = policy.model.get_submodule(name)(xs)
    return torch.cat([y for _, y in rec]), y_trainer, [len(x) for x, _ in rec]


def test_pipeline_refit_after_a_real_update_is_bit_identical_to_trainer(model_dir, tmp_path):
    """FP32-master refit (what an FP8-generation-only engine gets): the engine quantizes exactly as the trainer."""
    cfg = _cfg(tmp_path)
    policy, engine = _trained_policy_and_engine(model_dir, cfg)
    try:
        engine.refit(policy.weights(), weights_version=1)
        _assert_engine_holds_trainer_fp8(policy, engine, first=1, last=0)
        # the old BF16 refit is not a no-op on trained weights: this test would have caught it
        masters = policy.model.state_dict()
        differ = sum(not torch.equal(quantize(masters[f"{n}.weight"].to(torch.bfloat16), "block128", pow2=True)
                                     .data.view(torch.uint8), m.quantized_weight().data.view(torch.uint8))
                     for n, m in policy.model.named_modules() if hasattr(m, "quantized_weight"))
        assert differ > 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("recipe,pow2,first,last", [("blockwise", True, 1, 0), ("rowwise", False, 0, 1),
                                                     ("tensorwise", True, 1, 1), ("mxfp8", True, 1, 0)])
def test_fp8_refit_per_recipe_bit_identical_weights_and_outputs(model_dir, tmp_path, recipe, pow2, first, last):
    """End-to-end FP8 through the pipeline's refit (PolicyWorker.refit_weights: FP8 codes + scales over the wire):
    per recipe the engine holds the trainer's quantization and its linears return the trainer's outputs."""
    cfg = _cfg(tmp_path, recipe, pow2, first, last)
    policy, engine = _trained_policy_and_engine(model_dir, cfg)
    try:
        payload = policy.refit_weights()
        fp8_names = [n for n in payload if n.endswith("_scale_inv")]
        assert fp8_names and all(payload[n[:-len("_scale_inv")]].dtype == torch.uint8 for n in fp8_names)  # bytes
        # scales: FP32, or MX's E8M0 exponents as one byte each (a quarter of the scale bytes)
        assert all(payload[n].element_size() == (1 if recipe == "mxfp8" else 4) for n in fp8_names)
        import pickle

        payload = pickle.loads(pickle.dumps(payload))  # crosses Ray's object store pickled
        engine.refit(payload, weights_version=1)
        _assert_engine_holds_trainer_fp8(policy, engine, first, last)
        y_engine, y_trainer = _engine_vs_trainer_outputs(policy, engine, first)
        assert torch.equal(y_engine, y_trainer)
        if recipe != "tensorwise":  # token-local activation scales: a row's output does not depend on its batch
            y_engine, y_trainer, sizes = _decode_rows_vs_trainer(policy, engine, first)
            assert len(set(sizes)) >= 2 and max(sizes) > 1, sizes  # prefill and decode batches of several sizes
            assert torch.equal(y_engine, y_trainer), f"engine batches {sizes} vs one trainer batch of {sum(sizes)}"
        bytes_fp8 = sum(t.numel() * t.element_size() for t in payload.values())
        bytes_fp32 = sum(t.numel() * t.element_size() for t in policy.weights().values())
        assert bytes_fp8 < 0.45 * bytes_fp32
    finally:
        engine.shutdown()


def test_refit_refuses_bad_fp8_payloads_and_stale_kv_scales(model_dir, tmp_path):
    cfg = _cfg(tmp_path)
    from rollout.engine import RolloutWorker
    from trainer.policy import PolicyWorker

    policy = PolicyWorker(model_dir, cfg, run_dir=cfg.run_dir)
    engine = RolloutWorker(model_dir, cfg, run_dir=tmp_path / "rollout")
    try:
        payload = policy.refit_weights()
        name = "model.layers.2.mlp.up_proj.weight"
        for bad, match in [({name + "_scale_inv": payload[name + "_scale_inv"][:1]}, "weight_scale_inv"),
                           ({name + "_scale_inv": payload[name + "_scale_inv"].bfloat16()}, "serves its scales as"),
                           ({name: payload[name].to(torch.bfloat16)}, "float8_e4m3fn"),
                           ({name: payload[name].view(torch.float8_e4m3fn)[:1]}, "shape"),
                           ({"model.layers.0.mlp.up_proj.weight_scale_inv": torch.ones(1)}, "does not have")]:
            with pytest.raises(ValueError, match=match):
                engine.refit({**payload, **bad})
        fresh = {"k_scale": [0.01] * 4, "v_scale": [0.01] * 4, "version": 3}
        engine.refit(payload, fresh, weights_version=3)  # lag 0: accepted
        with pytest.raises(ValueError, match="stale KV scales: computed from the policy of step 3.*step 4"):
            engine.refit(payload, weights_version=4)  # the kept scales are now one step old (period 1: lag 0)
        with pytest.raises(ValueError, match="stale KV scales"):
            engine.refit(payload, {**fresh, "version": 1}, weights_version=3)
    finally:
        engine.shutdown()


def test_one_recipe_builds_one_spec_on_both_sides(model_dir, tmp_path):
    """The trainer's FP8 layers and the engine's quantization method get their numerics from one FP8Spec, the
    recipe's: every FP8Linear of the trainer and every fp8core linear of the vLLM model carry that spec (a
    non-default one: rowwise, pow2 scales, first layer in BF16), on the same decoder layers."""
    from fp8core.linear import FP8Linear
    from rollout.engine import RolloutWorker
    from trainer.policy import PolicyWorker

    cfg = _cfg(tmp_path, recipe="rowwise", pow2=True, first=1)
    spec = cfg.trainer_fp8_spec()
    policy = PolicyWorker(model_dir, cfg, run_dir=cfg.run_dir)
    assert policy.fp8_spec == spec
    trainer_cfgs = {m.config for m in policy.model.modules() if isinstance(m, FP8Linear)}
    assert trainer_cfgs == {spec.linear_config()}
    trainer_layers = {int(n.split(".")[2]) for n in policy.fp8_layers}

    def engine_specs(model):  # {(decoder layer, spec)} of every linear the fp8core method quantizes
        return {(int(name.split(".")[2]), m.quant_method.config.spec) for name, m in model.named_modules()
                if hasattr(getattr(m, "quant_method", None), "partitions")}

    engine = RolloutWorker(model_dir, cfg, run_dir=tmp_path / "rollout")
    try:
        found = engine.llm.apply_model(engine_specs)[0]
    finally:
        engine.shutdown()
    assert {s for _, s in found} == {engine.fp8} and engine.fp8.forward_key() == spec.forward_key()
    assert {layer for layer, _ in found} == trainer_layers == set(spec.layer_indices(4))


def _over_the_wire(policy, engine, kv_scales=None, weights_version=1) -> dict:
    """The pipeline's refit over the refit group (tasks.rl's collective transport), with the trainer and the engine
    in this process: each side's own methods, run at once in two threads (a group needs both members)."""
    from concurrent.futures import ThreadPoolExecutor

    address = policy.refit_open_store(2, 30)
    kw = dict(world=2, senders=1, generation=1, timeout_s=30)
    with ThreadPoolExecutor(2) as pool:
        joins = [pool.submit(policy.refit_join, address, rank=0, **kw),
                 pool.submit(engine.refit_join, address, rank=1, **kw)]
        assert [j.result() for j in joins] == [1, 1]
        sent = pool.submit(policy.refit_to_wire)
        got = pool.submit(engine.refit_from_wire, kv_scales, weights_version=weights_version)
        out = {}
        for side, fut in (("trainer", sent), ("engine", got)):
            try:
                out[side] = fut.result()
            except Exception as e:  # noqa: BLE001 - each side's outcome is asserted
                out[side] = e
    return out


@pytest.mark.parametrize("recipe,pow2,first,last", [("blockwise", True, 1, 0), ("tensorwise", True, 1, 1),
                                                     ("mxfp8", True, 0, 1)])
def test_fp8_refit_over_the_wire_bit_identical_weights_and_outputs(model_dir, tmp_path, recipe, pow2, first, last):
    """The collective transport (trainer.refit.ServedShard -> process.refit_wire -> RolloutWorker.refit_from_wire,
    one decoder layer per bucket): after a real update the engine holds the trainer's quantization bit for bit
    and its linears return the trainer's outputs, as over the object store."""
    cfg = _cfg(tmp_path, recipe, pow2, first, last)
    policy, engine = _trained_policy_and_engine(model_dir, cfg)
    try:
        out = _over_the_wire(policy, engine, weights_version=1)
        assert out["engine"]["buckets"] == 7 and out["engine"]["bytes"] == out["trainer"]["bytes"], out  # 4 layers, embeddings, norm, head
        payload = sum(t.numel() * t.element_size() for t in policy.refit_weights().values())
        assert payload <= out["trainer"]["bytes"] < 1.01 * payload  # the served state, plus alignment and checksums
        _assert_engine_holds_trainer_fp8(policy, engine, first, last)
        y_engine, y_trainer = _engine_vs_trainer_outputs(policy, engine, first)
        assert torch.equal(y_engine, y_trainer)
        assert engine.stats()["weights_version"] == 1
    finally:
        engine.shutdown()


def test_a_refit_over_the_wire_refused_by_the_engine_loads_nothing(model_dir, tmp_path):
    """Stale KV scales: the engine refuses in the verdict round, before any payload; the trainer learns which
    member refused, and the engine keeps the weights and version it had."""
    from rollout.engine import RolloutWorker
    from trainer.policy import PolicyWorker

    cfg = _cfg(tmp_path)
    policy = PolicyWorker(model_dir, cfg, run_dir=cfg.run_dir)
    engine = RolloutWorker(model_dir, cfg, run_dir=tmp_path / "rollout")
    try:
        first = _over_the_wire(policy, engine, weights_version=1)
        assert "buckets" in first["engine"], first
        before = _engine_vs_trainer_outputs(policy, engine, 1)[0]
        with torch.no_grad():
            policy.model.model.layers[1].mlp.down_proj.weight.mul_(2)  # what a loaded refit would change
        out = _over_the_wire(policy, engine, {"k_scale": [0.01] * 4, "v_scale": [0.01] * 4, "version": 1},
                             weights_version=3)
        assert isinstance(out["engine"], ValueError) and "stale KV scales" in str(out["engine"]), out
        assert isinstance(out["trainer"], RuntimeError) and "manifest refused by engine 0" in str(out["trainer"])
        assert engine.stats()["weights_version"] == 1
        assert torch.equal(_engine_vs_trainer_outputs(policy, engine, 1)[0], before)
        assert "buckets" in _over_the_wire(policy, engine, weights_version=3)["engine"]  # a good refit loads it
        y_engine, y_trainer = _engine_vs_trainer_outputs(policy, engine, 1)
        assert torch.equal(y_engine, y_trainer) and not torch.equal(y_engine, before)
    finally:
        engine.shutdown()


def _engine_state(engine) -> tuple[dict, dict]:
    """Every engine parameter (FP8 as bytes) and every FP8 linear's output on one fixed BF16 input (what the GEMM
    reads from its packed or dequantized form, not only the codes)."""
    def read(model):
        params = {n: (p.detach().view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p.detach()).clone()
                  for n, p in model.named_parameters()}
        outs = {}
        for n, m in model.named_modules():
            if hasattr(getattr(m, "quant_method", None), "partitions"):
                x = torch.randn(5, m.input_size_per_partition, generator=torch.Generator().manual_seed(1))
                outs[n] = m.quant_method.apply(m, x.to(torch.bfloat16))
        return params, outs

    return engine.llm.apply_model(read)[0]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("recipe,pow2,first,last", [("blockwise", True, 1, 1), ("rowwise", False, 0, 1),
                                                     ("mxfp8", True, 1, 0)])  # E8M0 scales through both loaders
def test_in_place_refit_equals_vllms_reload(model_dir, tmp_path, recipe, pow2, first, last):
    """A served refit copied in place (rollout/inplace_refit.py, the default) leaves every engine parameter and
    every FP8 linear's output what vLLM's layerwise reload leaves, from a different engine state each time; a refit
    of FP32 masters keeps vLLM's reload."""
    cfg = _cfg(tmp_path, recipe, pow2, first, last)
    policy, engine = _trained_policy_and_engine(model_dir, cfg)
    try:
        payload = policy.refit_weights()
        other = {n: (torch.zeros_like(t) if t.dtype == torch.uint8 else  # codes 0, scales 1, the rest halved
                     torch.ones_like(t) if n.endswith("_scale_inv") else t / 2) for n, t in payload.items()}
        before = _engine_state(engine)
        engine.refit(payload, weights_version=1)
        assert engine.stats()["refit_loader"] == "in_place"
        in_place = _engine_state(engine)
        assert not _same(in_place[0], before[0]) and not _same(in_place[1], before[1])
        _assert_engine_holds_trainer_fp8(policy, engine, first, last)
        engine.refit(other, weights_version=1)
        moved = _engine_state(engine)
        assert not _same(moved[0], in_place[0]) and not _same(moved[1], in_place[1])
        engine._inplace_refit = False
        engine.refit(payload, weights_version=1)
        assert engine.stats()["refit_loader"] == "vllm_reload"
        reloaded = _engine_state(engine)
        assert _same(reloaded[0], in_place[0]) and _same(reloaded[1], in_place[1])
        engine._inplace_refit = True
        engine.refit(policy.weights(), weights_version=1)  # FP32 masters: the engine quantizes them (vLLM's reload)
        assert engine.stats()["refit_loader"] == "vllm_reload"
        assert _same(_engine_state(engine)[1], in_place[1])
    finally:
        engine.shutdown()
