"""RolloutWorker on a BF16 engine: output format, reproducibility, refit against the HF trainer, stats, bad input."""
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from configs.schema import standalone_engine_config
from fp8core.cpu import caps_from, cpu_caps
from rollout.emulation import round_kv_through_e4m3
from rollout.engine import RolloutWorker
from rollout.kv_cache import kv_bytes_per_token, resolve_kv_mode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _probes import engine_kv_scales, model_logprobs  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "runs" / "test-env" / "models" / "tiny"


@pytest.fixture(scope="module")
def model_dir():
    from embedded.tiny_model import build_tiny_model

    return build_tiny_model(MODEL_DIR)


@pytest.fixture(scope="module")
def worker(model_dir, tmp_path_factory):
    w = RolloutWorker(model_dir, standalone_engine_config(kv_cache_memory_bytes=32 << 20, max_model_len=256),
                      run_dir=tmp_path_factory.mktemp("rollout-run"))
    yield w
    w.shutdown()


@pytest.fixture(scope="module")
def prompts(worker):
    from embedded.tiny_model import chat_prompt

    return [chat_prompt(worker.tokenizer, q) for q in ("What is 3 plus 4?", "Ana has 5 pens. How many pens?")]


def _hf_model(model_dir, state_dict=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    if state_dict is not None:
        model.load_state_dict({k: v.to(torch.bfloat16) for k, v in state_dict.items()})
    return model


def _error(model, results, *, temperature: float = 1.0) -> float:
    """The engine's logprobs vs the plain HF reference ``model``'s, on the trainer's batches (trainer.batch)."""
    from fp8core.rl import mismatch_metrics

    lp, b = model_logprobs(model, results, pad_id=model.config.pad_token_id, temperature=temperature)
    return mismatch_metrics(lp, b.rollout_logp, b.mask)["mismatch/token_mult_prob_error"]


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="precision"):
        standalone_engine_config(precision="fp16")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        standalone_engine_config(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="num_first_layers_in_bf16"):
        standalone_engine_config(num_first_layers_in_bf16=-1)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        standalone_engine_config(kv_cache_memory_bytes=0)
    with pytest.raises(ValueError, match="kv_cache_impl"):
        standalone_engine_config(kv_cache_dtype="fp8", kv_cache_impl="fast")
    with pytest.raises(ValueError, match="kv_cache_impl: emulated only applies with .*kv_cache_dtype=fp8"):
        standalone_engine_config(kv_cache_impl="emulated")


_TINY = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
         "hidden_size": 256}
_CPUINFO = {"avx2": "model name\t: AVX2 box\nflags\t\t: avx avx2\n",
            "avx512": "model name\t: Skylake\nflags\t\t: avx avx2 avx512f\n",
            "avx512_bf16": "model name\t: Zen4\nflags\t\t: avx avx2 avx512f avx512_bf16\n",
            "amx": "model name\t: SPR\nflags\t\t: avx avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"}


@pytest.mark.parametrize("kind,native", [("avx2", False), ("avx512", True), ("avx512_bf16", True), ("amx", True)])
def test_kv_mode_per_cpu_kind(kind, native):
    caps = caps_from(_CPUINFO[kind], cap=None, torch_capability="AVX2")
    assert resolve_kv_mode(_TINY, "auto", caps=caps)[0] == "bf16"
    assert resolve_kv_mode(_TINY, "fp8", "emulated", caps=caps)[0] == "fp8-emulated"
    mode, why = resolve_kv_mode(_TINY, "fp8", "auto", caps=caps)
    assert mode == ("fp8-native" if native else "fp8-emulated"), why
    if native:
        assert resolve_kv_mode(_TINY, "fp8", "native", caps=caps)[0] == "fp8-native"
    else:
        with pytest.raises(ValueError, match=r"policy\.generation\.vllm_cfg\.kv_cache_impl=native.*AVX-512 "
                                             r"\(avx512f\) and AMX \(amx_tile\)"):
            resolve_kv_mode(_TINY, "fp8", "native", caps=caps)


def test_kv_mode_under_the_cap_and_head_size_and_gpu():
    capped = caps_from(_CPUINFO["amx"], cap="avx2", torch_capability="AVX2")
    assert resolve_kv_mode(_TINY, "fp8", caps=capped)[0] == "fp8-emulated"
    with pytest.raises(ValueError, match="capped by FP8GRPO_CPU_CAP=avx2"):
        resolve_kv_mode(_TINY, "fp8", "native", caps=capped)
    amx = caps_from(_CPUINFO["amx"], cap=None, torch_capability="AVX512")
    head80 = {**_TINY, "head_dim": 80}  # a vLLM CPU head size (80 % 16 == 0) that its FP8 cache refuses
    mode, why = resolve_kv_mode(head80, "fp8", caps=amx)
    assert mode == "fp8-emulated" and "head_size 80" in why
    with pytest.raises(ValueError, match="kv_cache_impl=native.*head_size 80 is not a multiple of 32"):
        resolve_kv_mode(head80, "fp8", "native", caps=amx)
    assert resolve_kv_mode(head80, "fp8", "native", caps=capped, on_gpu=True)[0] == "fp8-native"
    with pytest.raises(ValueError, match="only applies with kv_cache_dtype=fp8"):
        resolve_kv_mode(_TINY, "auto", "native", caps=amx)


def test_e4m3_rounding_is_round_to_nearest_even_with_saturation():
    scale = 0.5
    # E4M3 around 1.0 has spacing 0.125: 1.0625 is a tie -> even (1.0); 1.07 -> 1.125; beyond 448 saturates;
    # 2^-9 is the smallest subnormal, 2^-10 a tie between 0 and it -> 0 (even).
    x = torch.tensor([1.0625, 1.07, -1.07, 500.0, -1e4, 0.0, 2.0 ** -9, 2.0 ** -10], dtype=torch.float32) * scale
    y = round_kv_through_e4m3(x.to(torch.bfloat16), scale).float() / scale
    want = torch.tensor([1.0, 1.125, -1.125, 448.0, -448.0, 0.0, 2.0 ** -9, 0.0])
    assert torch.equal(y, want), y
    g = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    s = float(g.abs().max()) / 448
    rel = ((round_kv_through_e4m3(g, s) - g).norm() / g.norm()).item()
    assert 0.01 < rel < 0.04  # E4M3 RNE on Gaussian data: ~2-3% relative error


def test_kv_bytes_per_token_formula():
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
           "hidden_size": 256}
    assert kv_bytes_per_token(cfg, "auto") == 4 * 2 * 2 * 64 * 2  # layers * (K,V) * heads * dim * 2 bytes
    assert kv_bytes_per_token(cfg, "fp8") == 4 * 2 * 2 * 64


def test_bad_model_dirs_rejected_before_engine(tmp_path, model_dir):
    with pytest.raises(ValueError, match="does not exist"):
        RolloutWorker(tmp_path / "nope", standalone_engine_config(), run_dir=tmp_path / "run")
    with pytest.raises(ValueError, match="config.json"):
        RolloutWorker(tmp_path, standalone_engine_config(), run_dir=tmp_path / "run")
    bad = tmp_path / "bert"
    shutil.copytree(model_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["BertForMaskedLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="BertForMaskedLM.*not supported"):
        RolloutWorker(bad, standalone_engine_config(), run_dir=tmp_path / "run")


def test_native_fp8_kv_refused_before_engine_for_a_head_size_vllm_cpu_rejects(model_dir, tmp_path):
    odd = tmp_path / "head80"
    shutil.copytree(model_dir, odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["head_dim"] = 80
    (odd / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="kv_cache_impl=native.*head_size 80"):
        RolloutWorker(odd, standalone_engine_config(kv_cache_dtype="fp8", kv_cache_impl="native"), run_dir=tmp_path / "run")


def test_unknown_attention_backend_refused_before_engine(model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"attention_backend: 'FLASH' is not one of vLLM's attention backends \(.*"
                                         r"TRITON_ATTN"):
        RolloutWorker(model_dir, standalone_engine_config(attention_backend="FLASH"), run_dir=tmp_path / "run")


def test_kv_budget_too_small_for_one_sequence(model_dir, tmp_path):
    # 256 tokens * 2048 bytes/token (bf16) = 512 KiB needed
    with pytest.raises(ValueError, match="kv_cache_memory_bytes=100000 is too small.*max_model_len=256"):
        RolloutWorker(model_dir, standalone_engine_config(kv_cache_memory_bytes=100_000, max_model_len=256), run_dir=tmp_path)
    with pytest.raises(ValueError, match="num_hidden_layers=4"):
        RolloutWorker(model_dir, standalone_engine_config(precision="fp8", num_first_layers_in_bf16=3,
                                                               num_last_layers_in_bf16=2),
                      run_dir=tmp_path)


@pytest.mark.slow
def test_engine_renders_prompts_as_the_model_directory_s_tokenizer(worker, model_dir):
    """The driver has the first engine render its prompts (tasks.rl.prompts_for): the text must be what the model
    directory's own tokenizer renders, for the task's system prompt, a recipe's, none, and a user template."""
    from transformers import AutoTokenizer

    from data.prompt import PromptFormat

    tok = AutoTokenizer.from_pretrained(model_dir)
    items = [("What is 3 plus 4?", "arithmetic"), ("12 + 39 = ?", "addition")]
    for fmt in (PromptFormat(), PromptFormat(system_prompt="Be brief."), PromptFormat(system_prompt=""),
                PromptFormat(user_template="Q: {question}\nA:")):
        got = worker.render_prompts(fmt, items)
        assert got == [fmt.render(tok, q, task) for q, task in items]
        assert all(q.split("\n")[0] in g for g, (q, _) in zip(got, items, strict=True))
    assert worker.render_prompts(PromptFormat(system_prompt="Be brief."), items[:1])[0] != \
        worker.render_prompts(PromptFormat(), items[:1])[0]


@pytest.mark.slow
def test_generate_format_and_reproducibility(worker, prompts):
    out = worker.generate(prompts, n=3, max_tokens=12, temperature=1.0, seed=7)
    assert [r["prompt_index"] for r in out] == [0, 1]
    assert out[0]["prompt_token_ids"] == worker.tokenizer.encode(prompts[0])
    for r in out:
        assert len(r["samples"]) == 3
        for s in r["samples"]:
            assert len(s["token_ids"]) == len(s["logprobs"]) >= 1
            assert s["finish_reason"] in ("stop", "length")
            assert all(lp <= 0.0 for lp in s["logprobs"])
            assert isinstance(s["text"], str)
    # the three samples of a prompt are different random streams; the same seed reproduces them
    assert len({tuple(s["token_ids"]) for s in out[0]["samples"]}) > 1
    again = worker.generate(prompts, n=3, max_tokens=12, temperature=1.0, seed=7)
    assert [[s["token_ids"] for s in r["samples"]] for r in again] == [[s["token_ids"] for s in r["samples"]]
                                                                       for r in out]
    # token-id prompts give the same result as the text prompts they encode
    ids = worker.generate([r["prompt_token_ids"] for r in out], n=3, max_tokens=12, temperature=1.0, seed=7)
    assert [s["token_ids"] for s in ids[1]["samples"]] == [s["token_ids"] for s in out[1]["samples"]]
    st = worker.stats()
    assert st["last_generated_tokens"] == sum(len(s["token_ids"]) for r in ids for s in r["samples"])
    assert st["last_tokens_per_s"] > 0


@pytest.mark.slow
def test_logprobs_are_temperature_processed(worker, model_dir, prompts):
    """At temperature 0.7 the engine's logprobs are those of softmax(logits / 0.7), as the trainer computes them."""
    out = worker.generate(prompts, n=2, max_tokens=10, temperature=0.7, seed=1)
    model = _hf_model(model_dir)
    right, wrong = _error(model, out, temperature=0.7), _error(model, out, temperature=1.0)
    print(f"T=0.7 samples: token_mult_prob_error scored at T=0.7 {right:.4f}, at T=1.0 {wrong:.4f}")
    assert right <= 1.01 < wrong


@pytest.mark.slow
def test_sampled_token_ranks_are_counted_eagerly_on_cpu(worker):
    """A CPU engine's sampler ranks sampled tokens with the eager count (no inductor compile at the first sampled
    logprob): the same integers as ranking by sorting, ties included."""
    import vllm.v1.sample.sampler as sampler

    from rollout.emulation import _count_at_least

    assert sampler.batched_count_greater_than is _count_at_least
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-4, 4, (6, 50), generator=g).float()
    values = x[torch.arange(6), torch.randint(0, 50, (6,), generator=g)].unsqueeze(1)
    want = torch.tensor([sum(e >= v for e in row) for row, v in zip(x.tolist(), values.flatten().tolist(), strict=True)])
    assert torch.equal(_count_at_least(x, values), want)


@pytest.mark.slow
def test_kv_capacity_matches_budget(worker):
    st = worker.stats()
    # 32 MiB / (4 layers * 2 * 2 heads * 64 dims * 2 bytes) = 16384 tokens
    assert st["kv_capacity_tokens"] == (32 << 20) // st["kv_bytes_per_token"] == 16384
    assert st["kv_mode"] == "bf16" and not st["kv_fp8_capacity_realised"]
    assert st["cpu"]["kind"] == cpu_caps().kind and st["cpu"]["model"] == cpu_caps().model


@pytest.mark.slow
def test_refit_matches_new_weights_not_old(worker, model_dir, checkpoint, prompts):
    gen = torch.Generator().manual_seed(0)
    new = {k: v.float() + 0.3 * v.float().std() * torch.randn(v.shape, generator=gen) if v.dim() > 1 else v.float()
           for k, v in checkpoint.items()}
    old_model, new_model = _hf_model(model_dir), _hf_model(model_dir, new)
    before = worker.generate(prompts, n=4, max_tokens=16, seed=3)
    assert _error(old_model, before) <= 1.01
    try:
        seconds = worker.refit(new)
        assert 0 < seconds < 30
        after = worker.generate(prompts, n=4, max_tokens=16, seed=3)
        err_new, err_old = _error(new_model, after), _error(old_model, after)
        print(f"refit {seconds * 1e3:.1f} ms; token_mult_prob_error vs new weights {err_new:.4f}, "
              f"vs old weights {err_old:.4f}")
        assert err_new <= 1.01
        assert err_old > 1.05
    finally:
        worker.refit(checkpoint)
    assert _error(old_model, worker.generate(prompts, n=2, max_tokens=8, seed=4)) <= 1.01


@pytest.mark.slow
def test_bad_refit_and_scales_leave_engine_usable(worker, checkpoint, prompts):
    ref = worker.generate(prompts, n=1, max_tokens=8, seed=5)
    name = "model.layers.0.self_attn.q_proj.weight"
    partial = dict(checkpoint)
    partial.pop(name)
    with pytest.raises(ValueError, match="lacks 1 parameters.*q_proj"):
        worker.refit(partial)
    with pytest.raises(ValueError, match="names the model does not have.*bogus"):
        worker.refit({**checkpoint, "bogus.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=f"{name}.*shape"):
        worker.refit({**checkpoint, name: checkpoint[name][:, :8]})
    with pytest.raises(ValueError, match=f"{name}.*non-finite"):
        worker.refit({**checkpoint, name: torch.full_like(checkpoint[name], float("nan"))})
    with pytest.raises(ValueError, match="k_scale.*3 entries.*4 layers"):
        worker.set_kv_scales({"k_scale": [1.0] * 3, "v_scale": [1.0] * 4})
    with pytest.raises(ValueError, match=r"v_scale'\]\[2\]=inf"):
        worker.set_kv_scales({"k_scale": [1.0] * 4, "v_scale": [1.0, 1.0, float("inf"), 1.0]})
    with pytest.raises(ValueError, match="k_scale.*3 entries"):
        worker.refit(checkpoint, kv_scales={"k_scale": [1.0] * 3, "v_scale": [1.0] * 4})
    with pytest.raises(ValueError, match="max_model_len=256"):
        worker.generate([list(range(1, 300))], n=1, max_tokens=4)
    with pytest.raises(ValueError, match="token ids outside"):
        worker.generate([[5, 99999]], n=1, max_tokens=4)
    with pytest.raises(ValueError, match="n must be"):
        worker.generate(prompts, n=0, max_tokens=4)
    assert engine_kv_scales(worker)["k_scale"] == [1.0] * 4  # nothing reached the engine
    assert worker.generate(prompts, n=1, max_tokens=8, seed=5) == ref


def _without_logprobs(rollouts: list[dict]) -> list[dict]:
    return [{**r, "samples": [{k: v for k, v in x.items() if k != "logprobs"} for x in r["samples"]]}
            for r in rollouts]


@pytest.mark.slow
def test_rollout_refuses_an_engine_that_missed_the_refit(worker, checkpoint, prompts):
    """Fan-out: each rollout names the policy step it needs; an engine holding other weights refuses before
    generating, and the same split over engines gives the same samples as one call (per-prompt seeds): the same
    tokens, texts and finish reasons. Their logprobs agree to 2e-2 (absolute), not bit for bit: vLLM's CPU kernels
    are not batch-invariant on every CPU -- on an AVX2-only EPYC a batch of 2 prompts and two batches of 1 gave
    logprobs up to 4e-3 apart (BF16 activations: one BF16 ulp of a logit near 7 is 3e-2), on AVX-512 they were
    equal. A wrong seed offset for the second engine changes the sampled tokens, which this compares exactly."""
    worker.refit(checkpoint, weights_version=3)
    assert worker.stats()["weights_version"] == 3
    with pytest.raises(ValueError, match="holds the policy weights of step 3, the rollout needs step 4: it missed"):
        worker.generate(prompts, n=1, max_tokens=4, seed=1, weights_version=4)
    whole = worker.generate(prompts, n=2, max_tokens=8, seed=11, weights_version=3)
    # what two engines return for prompts [0:1] and [1:2] with the rollout task's seeds (seed + start * n)
    parts = [worker.generate(prompts[:1], n=2, max_tokens=8, seed=11), worker.generate(prompts[1:], n=2, max_tokens=8,
                                                                                       seed=11 + 1 * 2)]
    split = RolloutWorker.gather(*parts)
    assert _without_logprobs(split) == _without_logprobs(whole)
    for a, b in zip(split, whole, strict=True):
        for sa, sb in zip(a["samples"], b["samples"], strict=True):
            assert sa["logprobs"] == pytest.approx(sb["logprobs"], abs=2e-2)
    worker.refit(checkpoint)  # back to an unversioned load for the other tests
    assert worker.stats()["weights_version"] is None


@pytest.mark.slow
def test_kv_scales_are_set_and_survive_refit(worker, checkpoint):
    scales = {"k_scale": [0.5, 0.25, 0.125, 1.0], "v_scale": [2.0, 1.0, 0.5, 0.25]}
    try:
        worker.set_kv_scales(scales)
        assert {k: engine_kv_scales(worker)[k] for k in scales} == scales
        worker.refit(checkpoint)  # vLLM resets scales to 1.0 on reload; the worker puts them back
        assert {k: engine_kv_scales(worker)[k] for k in scales} == scales
    finally:
        worker.set_kv_scales({"k_scale": [1.0] * 4, "v_scale": [1.0] * 4})


@pytest.mark.slow
@pytest.mark.e2e
def test_worker_as_ray_actor(model_dir, checkpoint, prompts, tmp_path):
    """The pipeline wraps the class with ray.remote: construction, generate, refit and stats work across the actor
    boundary (own process, 2 threads), and a bad refit comes back as a ValueError with the engine still usable."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = ray.remote(RolloutWorker).options(num_cpus=1, runtime_env={"env_vars": {"OMP_NUM_THREADS": "2"}}) \
            .remote(str(model_dir), standalone_engine_config(kv_cache_memory_bytes=8 << 20, max_model_len=128),
                    run_dir=str(tmp_path))
        out = ray.get(actor.generate.remote(prompts, n=2, max_tokens=8, seed=1), timeout=300)
        assert len(out) == 2 and len(out[0]["samples"]) == 2
        seconds = ray.get(actor.refit.remote(ray.put(checkpoint)), timeout=120)
        print(f"refit in the Ray actor: {seconds * 1e3:.1f} ms")
        with pytest.raises(ValueError, match="lacks"):
            try:
                ray.get(actor.refit.remote({"lm_head.weight": checkpoint["lm_head.weight"]}), timeout=60)
            except ray.exceptions.RayTaskError as e:
                raise e.as_instanceof_cause() from None
        again = ray.get(actor.generate.remote(prompts, n=2, max_tokens=8, seed=1), timeout=120)
        assert again == out  # same weights, same seed -> same samples, after refit and a rejected refit
        assert ray.get(actor.stats.remote())["kv_capacity_tokens"] == 4096
        ray.get(actor.shutdown.remote(), timeout=60)
    finally:
        if started:
            ray.shutdown()


@pytest.mark.slow
def test_seeded_batch_larger_than_one_step(worker):
    """Regression: prompts beyond one step's token budget used to be chunk-prefilled, and vLLM 0.32 then rewinds the
    per-request generator with set_offset, which CPU generators reject (engine crash). Chunked prefill is off."""
    prompts = [[1 + (7 * i + j) % 200 for j in range(60)] for i in range(40)]  # 80 seqs x 60 prompt tokens > 4096
    out = worker.generate(prompts, n=2, max_tokens=4, seed=0)
    assert len(out) == 40 and all(len(s["token_ids"]) >= 1 for r in out for s in r["samples"])
    with pytest.raises(ValueError, match="max_num_batched_tokens=100 must be >= max_model_len=256"):
        standalone_engine_config(max_num_batched_tokens=100, max_model_len=256)


_CAPPED = r"""  # run with FP8GRPO_CPU_CAP set; argv: model_dir run_dir
import json, sys
from pathlib import Path

import torch

from fp8core.cpu import apply_cpu_cap, cpu_caps

apply_cpu_cap()  # what RolloutWorker.__init__ does too; here first, so the probes below see the cap
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from configs.schema import standalone_engine_config
from rollout.engine import RolloutWorker

sys.path.insert(0, "tests")  # cwd is the repository root
from _probes import engine_kv_scales

model_dir, run_dir = Path(sys.argv[1]), Path(sys.argv[2])
out = {"kind": cpu_caps().kind, "hw": cpu_caps().hardware_kind, "avx512": torch.cpu._is_avx512_supported(),
       "amx": torch.cpu._is_amx_tile_supported(), "torch": torch.backends.cpu.get_cpu_capability()}
try:
    _get_attn_isa(torch.bfloat16, 128, 64, "fp8_e4m3")
    out["vllm_fp8_kv"] = "accepted"
except NotImplementedError as e:
    out["vllm_fp8_kv"] = str(e)
base = dict(precision="fp8", kv_cache_dtype="fp8", kv_cache_memory_bytes=8 << 20, max_model_len=128)
out["native"] = None
if not cpu_caps().native_fp8_kv:  # must be refused before any engine starts
    try:
        RolloutWorker(model_dir, standalone_engine_config(**base, kv_cache_impl="native"), run_dir=run_dir)
        out["native"] = "started"
    except ValueError as e:
        out["native"] = str(e)
w = RolloutWorker(model_dir, standalone_engine_config(**base), run_dir=run_dir)
st = w.stats()
out.update(kv_mode=st["kv_mode"], capacity=st["kv_capacity_tokens"], realised=st["kv_fp8_capacity_realised"],
           cpu=st["cpu"])
out["kernel_libs"] = sorted({line.strip().rsplit("/", 1)[-1] for line in open("/proc/self/maps")
                             if "/vllm/_C" in line})
prompts = [[1 + (7 * i + j) % 200 for j in range(16)] for i in range(4)]


def lps():
    res = w.generate(prompts, n=2, max_tokens=12, seed=0)
    return [lp for r in res for s in r["samples"] for lp in s["logprobs"]]


unit = {"k_scale": [1.0] * 4, "v_scale": [1.0] * 4}
tiny = {"k_scale": [1e-3] * 4, "v_scale": [1e-3] * 4}
w.set_kv_scales(unit)
a = lps()
w.set_kv_scales(tiny)
b = lps()
from safetensors.torch import load_file
w.refit(load_file(str(model_dir / "model.safetensors")))  # vLLM resets scales; the worker re-applies 1e-3
c = lps()
w.set_kv_scales(unit)
d = lps()
out.update(tokens=len(a), dlogp_tiny=sum(abs(x - y) for x, y in zip(a, b)) / len(a), tiny_after_refit_same=(b == c),
           unit_again_same=(a == d), scales_after_refit=engine_kv_scales(w)["k_scale"])
w.shutdown()
print(json.dumps(out))
"""


def _run_capped(cap: str, model_dir, run_dir) -> dict:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    env["FP8GRPO_CPU_CAP"] = cap
    proc = subprocess.run([sys.executable, "-c", _CAPPED, str(model_dir), str(run_dir)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print({k: r[k] for k in ("hw", "kind", "torch", "kernel_libs", "kv_mode", "capacity", "dlogp_tiny")})
    return r


@pytest.mark.slow
def test_fp8_kv_recipe_under_the_avx2_cap(model_dir, tmp_path):
    """FP8GRPO_CPU_CAP=avx2 in a fresh process: vLLM loads its AVX2 kernels and refuses an FP8 KV cache inside
    (as on an AVX2-only CPU); the worker refuses kv_cache_impl=native before any engine starts, and the FP8 KV
    recipe (auto) runs emulated: BF16 capacity, K/V rounded with the per-layer scales (a 1e-3 scale changes the
    logprobs, the hook survives a refit, unit scales give the same samples back)."""
    if cpu_caps().hardware_kind == "other":
        pytest.skip("this CPU has no AVX2: the AVX2 cap does not apply")
    r = _run_capped("avx2", model_dir, tmp_path / "run")
    assert r["kind"] == "avx2" and r["cpu"]["kind"] == "avx2" and r["cpu"]["cap"] == "avx2"
    assert (r["avx512"], r["amx"], r["torch"]) == (False, False, "AVX2")
    assert r["vllm_fp8_kv"] == "FP8 KV cache on CPU requires x86 with AVX-512 or AMX."
    assert r["kernel_libs"] == ["_C_AVX2.abi3.so"]
    assert "kv_cache_impl=native" in r["native"] and "AVX-512" in r["native"]
    assert r["kv_mode"] == "fp8-emulated" and r["realised"] is False
    assert r["capacity"] == (8 << 20) // (4 * 2 * 2 * 64 * 2) == 4096  # the BF16 capacity
    assert r["dlogp_tiny"] > 0.02, r["dlogp_tiny"]  # measured ~0.16 (mean |dlogp| per token)
    assert r["tiny_after_refit_same"] and r["unit_again_same"]
    assert r["scales_after_refit"] == [1.0] * 4


@pytest.mark.slow
def test_fp8_kv_recipe_under_the_avx512_cap(model_dir, tmp_path):
    """FP8GRPO_CPU_CAP=avx512 (AVX-512 without BF16): vLLM loads its AVX-512 kernels, keeps a native FP8 KV cache
    (half the bytes per token) and applies the scales."""
    if cpu_caps().hardware_kind in ("other", "avx2"):
        pytest.skip(f"this CPU is {cpu_caps().kind}: the AVX-512 paths are tested where the hardware has AVX-512")
    r = _run_capped("avx512", model_dir, tmp_path / "run")
    assert r["kind"] == "avx512" and r["cpu"]["cap"] == "avx512" and "avx512_bf16" not in r["cpu"]["flags"]
    assert (r["avx512"], r["amx"], r["torch"]) == (True, False, "AVX512")
    assert r["vllm_fp8_kv"] == "accepted" and r["native"] is None
    assert r["kernel_libs"] == ["_C_AVX512.abi3.so"]
    assert r["kv_mode"] == "fp8-native" and r["realised"] is True
    assert r["capacity"] == (8 << 20) // (4 * 2 * 2 * 64) == 8192  # FP8: half the bytes per token
    assert r["dlogp_tiny"] > 0.02, r["dlogp_tiny"]
    assert r["tiny_after_refit_same"] and r["unit_again_same"]
