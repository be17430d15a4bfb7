"""bench.gemm: every kernel runs on a small shape and computes the product it is named for; bad shapes fail first."""
import pytest
import torch

from bench.gemm import kernels, main


def test_kernels_compute_the_same_product_within_their_precision():
    found = kernels(32, 256, 24)
    ref = found["fp32 gemm"](None)
    assert torch.equal(found["fp8 emulated linear"](None).float(), ref.to(torch.bfloat16).float())
    assert torch.allclose(found["bf16 linear"](None).float(), ref, rtol=0.05, atol=0.05)
    assert torch.allclose(found["bf16 per-block"](None), ref, rtol=0.02, atol=0.02)
    # the CPU op: the same products summed in another order, then rounded to BF16 (x is BF16)
    assert torch.allclose(found["fp8 cpu op linear"](None).float(), ref, rtol=1e-2, atol=1e-2)


def test_main_prints_one_row_per_kernel(capsys):
    assert main(["--shapes", "16x128x16", "--repeats", "1", "--fwd-bwd-shapes", "16x256x32", "--fwd-bwd-repeats", "1",
                 "--no-results-doc"]) == 0
    out = capsys.readouterr().out
    for name in ("fp8 cpu op linear", "fp8 emulated linear", "fp32 gemm", "bf16 linear", "bf16 per-block"):
        assert f"| 16x128x16 | {name} |" in out
    for name in ("fp8 cpu fwd+bwd", "fp8 emulated fwd+bwd", "bf16 linear fwd+bwd"):
        assert f"| 16x256x32 | {name} |" in out


@pytest.mark.parametrize("shapes", ["16x100x16", "16x128", "axbxc"])
def test_bad_shapes_fail_before_any_work(shapes, capsys):
    with pytest.raises(SystemExit):
        main(["--shapes", shapes, "--no-results-doc"])
    assert "--shapes" in capsys.readouterr().err
