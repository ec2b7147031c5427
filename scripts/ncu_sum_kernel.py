"""One launch each (after one warm-up) of the TMA sum kernel and of the copy kernel moving the same
bytes, 16 CTAs, for Nsight Compute:

    ncu --clock-control none --set full --kernel-name-base demangled -k "regex:sum_tma|copy_kernel" \
        --launch-skip 2 --launch-count 2 python3 scripts/ncu_sum_kernel.py

(a 16 MiB bf16 chunk with one staged source: 32 MiB read, 32 MiB written by either kernel).
"""

import torch

from tide_core.runtime import native

lib = native.lib()
n = (16 << 20) // 2
own = torch.randn(n, device="cuda").to(torch.bfloat16)
quarter = n // 4
segments = [(k * quarter, quarter, quarter, own.data_ptr() + k * quarter * 2) for k in range(4)]
staged = [torch.randn(n, device="cuda").to(torch.bfloat16)]
out = torch.empty(n, device="cuda")
src = torch.randn(n, device="cuda")
stream = torch.cuda.current_stream().cuda_stream
for _ in range(2):
    lib.launch_sum(
        out.data_ptr(),
        [s.data_ptr() for s in staged],
        segments,
        0,
        n,
        0.5,
        False,
        0,
        16,
        stream,
        lib.SUM_KERNELS["tma"],
    )
    lib.copy_kernel([out.data_ptr()], [src.data_ptr()], [4 * n], 16, stream)
torch.cuda.synchronize()
