import os
import sys

from megatrain import OMP_WAIT_POLICY  # the package's __init__: no torch yet

# One OpenMP thread per test process, waiting passively, both set before torch loads OpenMP: the
# suite's tiny models gain nothing from a second thread, and a thread that spins while another
# process holds its core stalls every op (see OMP_WAIT_POLICY). Subprocesses inherit both.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["OMP_WAIT_POLICY"] = OMP_WAIT_POLICY

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
