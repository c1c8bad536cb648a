"""Shared test setup: import the top-level modules and keep CPU tests small and deterministic."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture
def one_thread():
    """Tiny matmuls are as fast on one thread, and much faster when other jobs share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
