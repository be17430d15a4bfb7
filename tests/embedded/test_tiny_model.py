"""Tiny model + tokenizer built locally: HF-loadable, FP8-friendly shapes, chat template, caching, and the SFT warm start."""
import json

import pytest
import torch

from embedded.tiny_model import TinyModelSpec, build_tiny_model, chat_prompt

SMALL = TinyModelSpec(vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=64, tokenizer_corpus_size=2000)


def test_spec_rejects_non_fp8_shapes():
    with pytest.raises(ValueError, match="hidden_size"):
        TinyModelSpec(hidden_size=200)


def test_build_load_and_cache(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = build_tiny_model(tmp_path / "m", SMALL)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "qwen3" and model.config.vocab_size == SMALL.vocab_size
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and "lm_head" not in name:
            assert mod.in_features % 128 == 0 and mod.out_features % 64 == 0, name
    prompt = chat_prompt(tok, "What is 2 plus 3?")
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tok(prompt, add_special_tokens=False).input_ids
    assert tok.decode(ids) == prompt  # byte-level BPE round trip, special tokens kept
    assert [tok.decode([i]) for i in tok("123", add_special_tokens=False).input_ids] == ["1", "2", "3"]
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(tmp_path / "m", SMALL) == out  # cached
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
    with pytest.raises(ValueError, match="another spec"):
        build_tiny_model(tmp_path / "m", TinyModelSpec())


def _build_in_child(out: str, ready, go) -> None:
    ready.set()
    go.wait(60)
    build_tiny_model(out, SMALL)


@pytest.mark.slow
def test_concurrent_builders_of_one_directory_both_get_the_same_complete_model(tmp_path):
    """Two processes (two runs, or two test workers, on one assets directory) build the same model at once: one
    builds under the directory's lock, the other waits and reuses it -- neither removes the other's temporary
    directory, both return the complete model."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    go, readies = ctx.Event(), [ctx.Event(), ctx.Event()]
    procs = [ctx.Process(target=_build_in_child, args=(str(tmp_path / "m"), r, go)) for r in readies]
    for p in procs:
        p.start()
    for r in readies:
        assert r.wait(120)
    go.set()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0, 0]
    out = tmp_path / "m"
    assert json.loads((out / ".complete").read_text()) == SMALL.key()
    assert (out / "model.safetensors").exists() and not (tmp_path / "m.tmp").exists()


@pytest.mark.slow
def test_sft_bootstrap_learns_the_format(tmp_path):
    from embedded.bootstrap import SFTConfig, ensure_default_assets

    assets = ensure_default_assets(tmp_path, task="arithmetic", spec=SMALL, sft=SFTConfig(steps=60, batch_size=16),
                                   n_train=400, n_validation=16, log=lambda *_: None)
    rows = [json.loads(line) for line in assets["validation"].read_text().splitlines()]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(assets["model_dir"]).eval()
    enc = tok(chat_prompt(tok, rows[0]["question"]), return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
    text = tok.decode(out[0, enc.input_ids.shape[1]:])
    assert "\\boxed{" in text and "<|im_end|>" in text  # the answer format is learned in 60 steps
    assert 0.0 <= greedy_accuracy(assets["model_dir"], rows, task="arithmetic") <= 1.0
    marker = json.loads((assets["model_dir"] / ".complete").read_text())
    assert marker["steps"] == 60  # recipe recorded: a different recipe retrains instead of reusing


@pytest.mark.slow
def test_addition_assets_one_warm_start_per_seed(tmp_path):
    from embedded.bootstrap import SFTConfig, default_sft, ensure_default_assets

    kw = dict(task="addition", spec=SMALL, n_train=100, n_validation=16, n_sft=200, log=lambda *_: None)
    a0 = ensure_default_assets(tmp_path, sft=SFTConfig(steps=5, batch_size=8, seed=0), **kw)
    a1 = ensure_default_assets(tmp_path, sft=SFTConfig(steps=5, batch_size=8, seed=1), **kw)
    assert a0["model_dir"] == tmp_path / "addition" / "tiny-qwen3-h128-l2-a2-kv1-i256-sft-seed0"  # SMALL's own dirs
    assert a1["model_dir"] == tmp_path / "addition" / "tiny-qwen3-h128-l2-a2-kv1-i256-sft-seed1"
    assert json.loads((a0["model_dir"] / ".complete").read_text())["seed"] == 0  # seed 1 did not overwrite seed 0
    assert a0["validation"] == a1["validation"] and a0["base_model_dir"] == a1["base_model_dir"]
    rows = [json.loads(line) for line in a0["sft"].read_text().splitlines()]
    assert len(rows) == 200 and "+" in rows[0]["solution"] and "\\boxed{" in rows[0]["solution"]
    assert len(a0["train"].read_text().splitlines()) == 100
    assert default_sft("addition", seed=2, steps=7) == SFTConfig(steps=7, lr=default_sft("addition").lr, seed=2)
    with pytest.raises(ValueError, match="data.task"):
        ensure_default_assets(tmp_path, task="nope")


@pytest.mark.slow
def test_addition_assets_cache_is_keyed_by_the_data_spec(tmp_path, monkeypatch):
    """A change of the teacher's spec (here its carry-drop rate) regenerates the data and retrains the warm start;
    the same spec reuses both (the data marker and the SFT marker record everything that shapes them)."""
    from embedded import bootstrap
    from embedded.bootstrap import SFTConfig, ensure_default_assets
    from rewards import addition_task

    kw = dict(task="addition", spec=SMALL, n_train=50, n_validation=8, n_sft=60, log=lambda *_: None,
              sft=SFTConfig(steps=2, batch_size=4))
    a = ensure_default_assets(tmp_path, **kw)
    marker = a["model_dir"] / ".complete"
    first = json.loads(marker.read_text())
    assert first["data"]["sft_spec"]["carry_drop"] == bootstrap.ADDITION_SFT_SPEC.carry_drop
    assert first["steps"] == 2 and first["base"]["seed"] == SMALL.seed
    stamp = (marker.stat().st_mtime_ns, a["sft"].stat().st_mtime_ns)
    ensure_default_assets(tmp_path, **kw)  # same recipe: nothing rebuilt
    assert (marker.stat().st_mtime_ns, a["sft"].stat().st_mtime_ns) == stamp
    monkeypatch.setattr(bootstrap, "ADDITION_SFT_SPEC", addition_task.AdditionSpec(2, 4, carry_drop=0.0))
    b = ensure_default_assets(tmp_path, **kw)
    assert json.loads((b["model_dir"] / ".complete").read_text())["data"]["sft_spec"]["carry_drop"] == 0.0
    rows = [json.loads(line) for line in b["sft"].read_text().splitlines()]
    assert all(addition_task.verify(r["solution"], r["answer"])[1] for r in rows)  # a clean teacher now


def test_moe_spec_builds_a_qwen3_moe_beside_the_dense_assets(tmp_path):
    """bootstrap.model=moe: the tiny Qwen3-MoE on the same data and tokenizer as the dense model, own dirs, per-expert
    checkpoint names; a dense marker written before the MoE fields existed still matches the dense spec."""
    from dataclasses import replace

    from transformers import AutoModelForCausalLM

    from embedded.bootstrap import SFTConfig, ensure_default_assets
    from embedded.tiny_model import TINY_MOE

    assert TINY_MOE.num_experts == 8 and TINY_MOE.num_experts_per_tok == 2
    assert "num_experts" not in SMALL.key()  # dense markers unchanged
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        TinyModelSpec(num_experts=4, num_experts_per_tok=5)
    moe = replace(SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)
    kw = dict(task="addition", n_train=50, n_validation=8, n_sft=64, log=lambda *_: None)
    a = ensure_default_assets(tmp_path, sft=SFTConfig(steps=2, batch_size=4), spec=moe, model="moe", **kw)
    d = ensure_default_assets(tmp_path, sft=SFTConfig(steps=2, batch_size=4), spec=SMALL, **kw)
    assert a["model_dir"] == tmp_path / "addition" / "tiny-qwen3-moe-h128-l2-a2-kv1-i256-e4-k2-m128-sft-seed0"
    assert a["validation"] == d["validation"] and a["base_model_dir"] != d["base_model_dir"]
    assert (a["model_dir"] / "tokenizer.json").read_text() == (d["model_dir"] / "tokenizer.json").read_text()
    model = AutoModelForCausalLM.from_pretrained(a["model_dir"])
    assert model.config.model_type == "qwen3_moe" and model.config.num_experts == 4
    from safetensors import safe_open

    with safe_open(str(a["model_dir"] / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    with pytest.raises(ValueError, match="bootstrap.model"):
        ensure_default_assets(tmp_path, model="huge", **kw)


def greedy_accuracy(model_dir, rows: list[dict], *, max_new_tokens: int = 24, batch_size: int = 64,
                    task: str) -> float:
    """Greedy-decoding accuracy of an HF model on rows with question/answer (a quick check; RL validation uses vLLM)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rewards.registry import get_task

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    correct = 0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i: i + batch_size]
        enc = tokenizer([chat_prompt(tokenizer, r["question"], task) for r in chunk], return_tensors="pt",
                        padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        texts = tokenizer.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
        correct += sum(get_task(task).verify(t, r["answer"])[1] for t, r in zip(texts, chunk, strict=True))
    return correct / max(1, len(rows))
