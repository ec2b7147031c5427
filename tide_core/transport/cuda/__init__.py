"""CUDA transport: copy-engine TIDE-AG and TIDE-RS on the GPUs of one node, and across nodes over a
rail (Sections 3, 4).

    transport.py  CudaTransport: checks, recorded programs, watchdog (the facade)
    options.py    CudaOptions: the transport's own options and their allowed values
    memory.py     SymmetricMap: flags, staging ring, Level-2 blocks, all-gather stage, rail words
    streams.py    the internal streams and how copy batches are issued on them
    allgather.py  AllGatherRecorder: node pushes, Bruck rounds over the rail, stage scatters
    level1.py     Level1Recorder: reduce-scatter chunks pushed into staging and summed
    level2.py     Level2Recorder: node partials over the rail and the Latin-square landings

Memory: a symmetric arena (every rank's segments mapped on every local GPU). Each collective's
recorder issues a call's device work once against a ``ProgramRecorder``; the facade replays the
recording per call (``tide_core.runtime.program``).
"""

from tide_core.transport.cuda.options import CudaOptions
from tide_core.transport.cuda.streams import FIRST_BATCH_COPIES
from tide_core.transport.cuda.transport import CudaTransport, CudaWork

__all__ = ["CudaOptions", "CudaTransport", "CudaWork", "FIRST_BATCH_COPIES"]
