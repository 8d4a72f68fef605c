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


@pytest.fixture(autouse=True, scope="session")
def _trackers_stay_local(tmp_path_factory):
    """Experiment trackers never leave the machine or touch the user's stores in tests: W&B
    offline, Trackio's store in a temporary directory (Trackio reads TRACKIO_DIR once, when it is
    first imported, so this is set before any test runs), MLflow in output_dir."""
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    mp.setenv("TRACKIO_DIR", str(tmp_path_factory.mktemp("trackio")))
    for name in (
        "MLFLOW_TRACKING_URI",
        "MLFLOW_EXPERIMENT_NAME",
        "WANDB_PROJECT",
        "TRACKIO_SPACE_ID",
        "TRACKIO_SERVER_URL",
    ):
        mp.delenv(name, raising=False)
    yield
    mp.undo()


@pytest.fixture(autouse=True, scope="session")
def _kernels_built_once(tmp_path_factory):
    """The host kernels' C is built once a session, in a temporary directory (engine/cbuild.py's
    cache, not the user's): the suite's processes and subprocesses load that build."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MEGATRAIN_KERNEL_CACHE", str(tmp_path_factory.mktemp("kernels")))
    yield
    mp.undo()
