import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need a real GPU: skip them, with the reason, where there is none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_dispatch_mode_left_on():
    """Every test must leave PyTorch's dispatch-mode stack as it found it: empty."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    yield
    assert _get_current_dispatch_mode_stack() == [], "a dispatch mode was left on"
