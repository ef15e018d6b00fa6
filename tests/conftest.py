"""Pytest configuration.

* Every test starts from the same global seed.
* Tests use tiny tensors, for which one intra-op thread is fastest and keeps
  the 2-core CI machine from oversubscribing; the processes tests start (the
  examples, benchmarks, ranks, doc blocks) inherit ``OMP_NUM_THREADS=1`` unless
  it is set.
* Bucket schedules. ``layeropt.attach`` defaults to ``bucket_cap_mb=0`` in
  tests: every layer is stepped the moment its gradient completes, the
  strictest schedule, which finds ordering bugs (with the library default of
  1 MiB the tiny test models would be stepped in one call at the end of
  backward). The core exactness and memory tests (:data:`BOTH_SCHEDULES`)
  run under both that and the library default, which is what users get;
  the documentation blocks run in fresh processes with the library defaults
  (``tests/test_docs.py``).
* ``-m core``: the modules in :data:`CORE` (exactness, accumulation,
  clipping and AMP, checkpointing, errors, memory, the training step,
  loops) carry the ``core`` marker, a quick first run:
  ``python -m pytest tests -m core``.
"""

import gc
import logging
import os
import sys

import pytest
import torch

import layeropt

torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

BOTH_SCHEDULES = {"test_exact", "test_rules", "test_memory_core", "test_accumulate",
                  "test_properties", "test_training_step", "test_checkpoint", "test_clip_amp", "test_loop",
                  "test_interop", "test_reliability", "test_errors"}

# ``python -m pytest tests -m core``: the quick subset for a first run (README).
CORE = {"test_exact", "test_accumulate", "test_clip_amp", "test_checkpoint", "test_errors",
        "test_memory_core", "test_training_step", "test_loop"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and module.__name__.rsplit(".", 1)[-1] in CORE:
            item.add_marker(pytest.mark.core)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.module.__name__.rsplit(".", 1)[-1] in BOTH_SCHEDULES:
        metafunc.parametrize("bucket_schedule", ["cap0", "default-cap"], indirect=True)


@pytest.fixture(autouse=True)
def bucket_schedule(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``"cap0"`` (strictest; the default here) or ``"default-cap"`` (the library's)."""
    schedule = getattr(request, "param", "cap0")
    if schedule == "cap0":
        defaults = dict(layeropt.attach.__kwdefaults__)
        defaults["bucket_cap_mb"] = 0.0
        monkeypatch.setattr(layeropt.attach, "__kwdefaults__", defaults)
    return schedule


def pytest_collection_finish(session: pytest.Session) -> None:
    """What importing the tests and their libraries made (torch's, transformers',
    Lightning's modules) is frozen out of garbage collection: the collections the tests
    make, and Python's own, then scan only what the tests made - a full collection in a
    worker that has imported every library took 0.3-0.5 s. The tests' objects are made
    later, so nothing a test checks for being collected is frozen."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="module")
def process_group():
    """One gloo process, for DDP and FSDP2 in this process (a module's tests share it)."""
    from harness import one_process_group

    yield from one_process_group("gloo")


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """accelerate's ``AcceleratorState`` and ``GradientState`` are process-wide, and so
    is what transformers' ``TrainingArguments`` puts in the environment for it
    (``ACCELERATE_MIXED_PRECISION=bf16`` with ``bf16=True``, transformers 4.x): a later
    test's ``Accelerator(cpu=True)`` in the same worker trained under bf16 autocast. Each
    test leaves both as it found them."""
    env = {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_")}
    yield
    for k in [k for k in os.environ if k.startswith("ACCELERATE_") and k not in env]:
        del os.environ[k]
    os.environ.update(env)
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()


@pytest.fixture(autouse=True)
def _logging_tensor_propagates():
    """torch's checkpoint ``debug=True`` logs through ``LoggingTensor``, a logger its
    ``capture_logs`` makes non-propagating for good, with a call whose arguments its own
    handler reads but a ``%`` format cannot take. pytest >= 9.2 attaches its capture
    handler to every non-propagating logger when a test starts, which then fails the
    test on formatting such a record: each test starts with that logger propagating."""
    yield
    logger = logging.Logger.manager.loggerDict.get("LoggingTensor")
    if isinstance(logger, logging.Logger):
        logger.propagate = True
