"""``python -m fp8core``: this CPU, the cap and the FP8 GEMM path built for it (the line every run logs first).

Exit status 1, with the build's error on stderr, where fp8core/csrc should build for this machine
(``kernels.no_kernel_reason()`` is None) and did not: the install and CI stop there instead of running on the
slower torch path."""
import sys

from fp8core import kernels
from fp8core.gemm import describe

print(describe())
if kernels.no_kernel_reason() is None and kernels.load() is None:
    print(f"fp8core: the C++ kernels (fp8core/csrc) should build on this machine and did not: {kernels.describe()}",
          file=sys.stderr)
    sys.exit(1)
