"""Skip GPU tests cleanly where no CUDA device is visible (CI's CPU machines)."""

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
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU(s), {gpus} visible"))
