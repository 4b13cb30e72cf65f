"""Shared test fixtures: where the real audio and NeMo fixtures live, GPU skipping."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("FLASHASR_SHARED", REPO.parent / "shared"))
AUDIO = SHARED / "audio"
PARAKEET_FIXTURES = SHARED / "fixtures" / "parakeet"


def sigint_default() -> None:
    """``preexec_fn`` for a child a test sends SIGINT (Ctrl-C): its SIGINT at the default action. A
    shell without job control starts background commands (``pytest ... &`` in a CI script) with SIGINT
    ignored, the child inherits that and Python keeps it, so the Ctrl-C never arrives and the job runs
    to its end (seen: every output written, exit 0, "nothing to resume")."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)

@pytest.fixture()
def sigint_raises():
    """SIGINT raises KeyboardInterrupt during the test (Python's own handler), whatever the test
    process inherited. Started in the background by a shell without job control (``pytest ... &``),
    pytest ignores SIGINT, and a test that sends itself Ctrl-C waited for a stop that never came
    (a run started so gave what a new user saw: a job waiting for ever on a stopped model process,
    and ``interrupted`` False)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


# Keep the 2-core CI machine responsive: tests that use torch run single-threaded
# unless told otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "2")


def write_nemo_without_model(path) -> Path:
    """A tar archive named like a model with no model in it: it passes the check before a server
    listens (the first tar header reads) and fails only when loaded."""
    import io
    import tarfile

    data = b"not a model"
    info = tarfile.TarInfo("README.txt")
    info.size = len(data)
    with tarfile.open(path, "w") as tar:
        tar.addfile(info, io.BytesIO(data))
    return Path(path)


def manifest() -> list[dict]:
    """All clips of ../shared/audio/manifest.jsonl (paths relative to AUDIO)."""
    lines = (AUDIO / "manifest.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(l) for l in lines if l.strip()]


@pytest.fixture(scope="session")
def audio_dir() -> Path:
    assert AUDIO.is_dir(), f"real audio expected at {AUDIO} (set FLASHASR_SHARED)"
    return AUDIO


@pytest.fixture(scope="session")
def clips() -> list[dict]:
    return manifest()


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op torch thread for a test module, restored afterwards.

    Tests of tiny models run many small ops, where OpenMP barriers dominate: on the shared
    2-core CI machine one thread is both faster and far steadier. Use it in a module with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``.
    """
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
