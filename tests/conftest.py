"""Skip GPU tests cleanly where no CUDA device is visible (CI's CPU machines). Multi-rank GPU tests
need one GPU (their ranks share it where there are fewer GPUs than ranks); ``cuda(gpus=N, why=...)``
marks the few that need N distinct GPUs, and why."""

import pytest


def pytest_collection_modifyitems(config, items):
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("cuda")
        if marker is None:
            continue
        need = marker.kwargs.get("gpus", 1)
        if gpus < need:
            # ``why``: what needs distinct GPUs (multi-rank tests otherwise share the visible ones)
            why = f": {marker.kwargs['why']}" if "why" in marker.kwargs else ""
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU(s), {gpus} visible{why}"))
