"""Host time of each driver call TIDE's stream programs issue (median us of 200 calls).

    python scripts/host_costs.py        # one process, GPUs 0 and 1 (the P2P copies go to GPU 1)

A call's host enqueue time is the sum of these (docs/design.md, "What bounds performance"); from idle it sits
on the critical path, which is why a call's first copy batch is kept short (FIRST_BATCH_COPIES).
"""

import statistics
import time

import torch

from tide_core.runtime import native

lib = native.lib()
torch.cuda.set_device(0)
s = torch.cuda.Stream(priority=-1)
h = s.cuda_stream
flag = torch.zeros(64, dtype=torch.int32, device="cuda")
src = torch.randn(1 << 24, device="cuda").to(torch.bfloat16)
dst_local = torch.empty_like(src)
dst_peer = torch.empty(1 << 24, dtype=torch.bfloat16, device="cuda:1")
dst_peer.copy_(src)  # enables peer access
torch.cuda.synchronize()
ev = torch.cuda.Event()
ev.record(s)
out = torch.empty(1 << 24, device="cuda")
segments = [(0, 1 << 20, 1 << 20, src.data_ptr())]


def cost(name, fn, n=200):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
        if len(times) % 50 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    print(f"{name:48s} {statistics.median(times):7.1f} us  (p10 {sorted(times)[n // 10]:.1f})", flush=True)


def peer(k, size=1 << 16):
    return (
        [dst_peer.data_ptr() + i * size for i in range(k)],
        [src.data_ptr() + i * size for i in range(k)],
        [size] * k,
    )


cost("cudaEventRecord", lambda: ev.record(s))
cost("cudaStreamWaitEvent", lambda: s.wait_event(ev))
cost("cuStreamBatchMemOp write 1", lambda: lib.stream_write_u32(h, [flag.data_ptr()], 0))
cost("cuStreamBatchMemOp write 3", lambda: lib.stream_write_u32(h, [flag.data_ptr() + 64 * i for i in range(3)], 0))
cost("cuStreamBatchMemOp wait 1 (satisfied)", lambda: lib.stream_wait_u32(h, [flag.data_ptr()], 0))
cost(
    "copy kernel launch (1 segment)",
    lambda: lib.copy_kernel([dst_local.data_ptr()], [src.data_ptr()], [1 << 16], 16, h),
)
cost(
    "sum launch regs",
    lambda: lib.launch_sum(out.data_ptr(), [src.data_ptr()], segments, 0, 1 << 20, 1.0, False, 0, 16, h, 1),
)
cost(
    "sum launch tma (plan included)",
    lambda: lib.launch_sum(out.data_ptr(), [src.data_ptr()], segments, 0, 1 << 20, 1.0, False, 0, 16, h, 2),
)
for k in (1, 8, 15, 30):
    cost(f"cudaMemcpyBatchAsync {k:2d} P2P descriptors", lambda k=k: lib.memcpy_batch(*peer(k), h, True))
cost("cudaMemcpyBatchAsync 15 P2P, no overlap flag", lambda: lib.memcpy_batch(*peer(15), h, False))
cost("cudaMemcpyAsync x15 P2P", lambda: [lib.memcpy_2d(d, sz, s_, sz, sz, 1, h) for d, s_, sz in zip(*peer(15))])
# a recorded program: one stream, 30 P2P copies in one batch between two flag ops, as an all-gather lane
prog = lib.StreamProgram(2)
prog.record(lib.CALLER_STREAM, 0)
prog.wait_event(h, 0)
prog.wait_flags(h, [flag.data_ptr()], 0)
prog.copy_batch(h, *peer(30))
prog.write_flags(h, [flag.data_ptr() + 64], 0)
prog.record(h, 1)
prog.set_outputs([1], 4)
cost("program replay: lane (wait, 30 P2P, write)", lambda: prog.replay(torch.cuda.current_stream().cuda_stream, 0))
