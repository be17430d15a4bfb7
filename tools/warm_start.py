"""How much room a warm start leaves RL on the addition task (``data.task: addition``), without running RL.

    python -m tools.warm_start MODEL_DIR VALIDATION_JSONL [--prompts 500] [--sampled 64] [--threads 2]

Prints, on the validation rows (clean scratchpads, rewards/addition_task.py):

- the teacher-forced probability the model gives the carry token ``1`` where a carry is due (after a column whose sum
  was >= 10), its mean and the share of those positions above 0.5 (where greedy decoding already carries), and the
  same for the carry token ``0`` where none is due and for each column's sum;
- greedy accuracy (HF ``generate``) split into problems without and with a carry;
- with ``--sampled N``: mean@8, pass@8 and the share of identical-outcome groups at T=1 on the first N prompts.

A warm start from which RL gains most drops carries in greedy decoding (carry probability below 0.5 nearly
everywhere) while samples still carry often enough to be rewarded (pass@8 well above greedy accuracy).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

import process.quiet  # noqa: F401  third-party start-up noise off before torch / transformers / torchao load


def _token_index(offsets, char: int) -> int | None:
    for j, (a, b) in enumerate(offsets):
        if a <= char < b:
            return j
    return None


def carry_probabilities(model, tok, rows) -> dict[str, list[float]]:
    """Teacher-forced probabilities of the carry and sum tokens of each row's clean scratchpad."""
    import torch

    from embedded.tiny_model import chat_prompt

    out = {"carry_1": [], "carry_0": [], "sum": []}
    for r in rows:
        prompt = chat_prompt(tok, r["question"])
        enc = tok(prompt + r["solution"], add_special_tokens=False, return_offsets_mapping=True)
        ids = enc.input_ids
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
        p = lp.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).exp()  # p[j-1] = P(token j | prefix)
        for m in re.finditer(r"(\d)\+(\d)\+(\d)=(\d+)", r["solution"]):
            for key, group in ((f"carry_{m.group(3)}", 3), ("sum", 4)):
                j = _token_index(enc.offset_mapping, len(prompt) + m.start(group))
                if j:
                    out[key].append(float(p[j - 1]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.warm_start", description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("validation", help="jsonl with question / answer / solution (the addition task's validation)")
    ap.add_argument("--prompts", type=int, default=500)
    ap.add_argument("--sampled", type=int, default=0, help="prompts for mean@8 / pass@8 at T=1 (0 = skip)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from embedded.tiny_model import chat_prompt
    from rewards import addition_task as at

    torch.set_num_threads(a.threads)
    rows = [json.loads(line) for line in open(a.validation) if line.strip()][: a.prompts]
    if not rows or "solution" not in rows[0]:
        print(f"{a.validation}: needs rows with question / answer / solution", file=sys.stderr)
        return 2
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    pr = carry_probabilities(model, tok, rows)

    def stat(xs):
        return f"mean {sum(xs) / len(xs):.3f}, above 0.5 at {sum(x > 0.5 for x in xs) / len(xs):.1%} of {len(xs)}" \
            if xs else "none"

    print(f"P(carry token 1 | carry due): {stat(pr['carry_1'])}")
    print(f"P(carry token 0 | none due):  {stat(pr['carry_0'])}")
    print(f"P(column sum token):          {stat(pr['sum'])}")
    tok.padding_side = "left"
    kw = dict(max_new_tokens=64, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    right, free = [], []
    for i in range(0, len(rows), 100):
        chunk = rows[i: i + 100]
        g = tok([chat_prompt(tok, r["question"]) for r in chunk], return_tensors="pt", padding=True,
                add_special_tokens=False)
        with torch.no_grad():
            ids = model.generate(**g, do_sample=False, **kw)
        texts = tok.batch_decode(ids[:, g.input_ids.shape[1]:], skip_special_tokens=True)
        right += [at.verify(t, r["answer"])[1] for t, r in zip(texts, chunk, strict=True)]
        free += ["+1=" not in r["solution"] for r in chunk]
    nf = sum(free)
    print(f"greedy accuracy {sum(right) / len(rows):.3f}: without a carry {sum(c for c, f in zip(right, free, strict=True) if f)}"
          f"/{nf}, with a carry {sum(c for c, f in zip(right, free, strict=True) if not f)}/{len(rows) - nf}")
    if a.sampled:
        sv = rows[: a.sampled]
        g = tok([chat_prompt(tok, r["question"]) for r in sv], return_tensors="pt", padding=True,
                add_special_tokens=False)
        torch.manual_seed(1)
        with torch.no_grad():
            ids = model.generate(**g, do_sample=True, temperature=1.0, top_k=0, num_return_sequences=8, **kw)
        texts = tok.batch_decode(ids[:, g.input_ids.shape[1]:], skip_special_tokens=True)
        ok = [at.verify(t, sv[i // 8]["answer"])[1] for i, t in enumerate(texts)]
        per = [sum(ok[i * 8:(i + 1) * 8]) for i in range(len(sv))]
        print(f"T=1, 8 samples on {len(sv)} prompts: mean@8 {sum(ok) / len(ok):.3f}, pass@8 "
              f"{sum(p > 0 for p in per) / len(sv):.3f}, identical-outcome groups {sum(p in (0, 8) for p in per) / len(sv):.3f}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
