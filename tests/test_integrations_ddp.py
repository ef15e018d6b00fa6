"""accelerate, the HF Trainer and Lightning under DDP: layeropt equals torch.optim bit for bit.

Each tool runs under ``torch.distributed.run`` with two CPU (gloo) processes,
as users launch it (``tests/ddp_tools_worker.py``); every case trains once
with the tool and ``torch.optim.AdamW`` and once with the tool and
``layeropt.AdamW``, on different data per rank. Compared here: parameters and
optimizer state against the torch.optim run on each rank, the replicas
against each other, the clipping norms the tool returns or logs, and that
the tool really trained a DistributedDataParallel model.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ddp_tools_worker import ACCELERATE, HF, LIGHTNING
from harness import assert_same

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)
WORLD = 2
TIMEOUT_S = 240
WORKER = Path(__file__).with_name("ddp_tools_worker.py")


def _launch(tool: str, out: Path) -> list[dict[str, Any]]:
    """``python -m torch.distributed.run --nproc_per_node=2 ddp_tools_worker.py TOOL OUT``."""
    pytest.importorskip({"hf": "transformers"}.get(tool, tool))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(WORKER.parent), *filter(None, [os.environ.get("PYTHONPATH")])]))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}",
           "--standalone", str(WORKER), tool, str(out)]  # (it binds a free port itself)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [torch.load(out / f"{tool}-rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict[str, Any]]]:
    cache: dict[str, list[dict[str, Any]]] = {}

    def get(tool: str) -> list[dict[str, Any]]:
        if tool not in cache:
            cache[tool] = _launch(tool, tmp_path_factory.mktemp(tool))
        return cache[tool]

    return get  # type: ignore[return-value]


def _pair(ranks: list[dict[str, Any]], case: str) -> list[tuple[dict, dict]]:
    out = []
    for r in ranks:
        for kind in ("torch", "layeropt"):
            assert "error" not in r[f"{case}/{kind}"], r[f"{case}/{kind}"]["trace"]
        out.append((r[f"{case}/torch"], r[f"{case}/layeropt"]))
    return out


def _same(ranks: list[dict[str, Any]], case: str) -> list[tuple[dict, dict]]:
    pairs = _pair(ranks, case)
    for rank, (ref, got) in enumerate(pairs):
        assert_same(got["params"], ref["params"], f"rank {rank}: params vs torch.optim")
        assert_same(got["state"], ref["state"], f"rank {rank}: optimizer state vs torch.optim")
        assert got["wrapper"] == ref["wrapper"] == "DistributedDataParallel"
    assert_same(pairs[1][1]["params"], pairs[0][1]["params"], "layeropt replicas")
    assert_same(pairs[1][0]["params"], pairs[0][0]["params"], "torch.optim replicas")
    for ref, got in pairs:
        if "grads_alive" in got:  # what backward left for optimizer.step()
            assert got["grads_alive"] == [0] * 3, "layeropt: stepped and freed in backward"
            assert len(ref["grads_alive"]) == 3 and all(n > 0 for n in ref["grads_alive"])
    return pairs


@pytest.mark.xdist_group("ddp-tools-accelerate")  # (one launch per tool: one worker)
@pytest.mark.parametrize("case", list(ACCELERATE))
def test_accelerate_under_ddp_equals_torch_optim(runs, case):
    for ref, got in _same(runs("accelerate"), case):
        assert len(got["norms"]) == len(ref["norms"])
        for a, b in zip(got["norms"], ref["norms"]):  # the norm clip_grad_norm_ returns
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert got["grads_left"] == 0 < ref["grads_left"]  # freed in backward vs held
    if ACCELERATE[case].get("comm"):  # the hook reduced in fp16: not the plain average
        plain = _pair(runs("accelerate"), case.replace("fp16-comm-hook-", ""))
        for (ref, _), (ref_plain, _) in zip(_pair(runs("accelerate"), case), plain):
            assert not all(map(torch.equal, ref["params"], ref_plain["params"]))


@pytest.mark.xdist_group("ddp-tools-hf")  # (one launch per tool: one worker)
@pytest.mark.parametrize("case", [c for c in HF if not HF[c].get("callback")
                                  and not HF[c].get("refused")])
def test_hf_trainer_under_ddp_equals_torch_optim(runs, case):
    for ref, got in _same(runs("hf"), case):
        assert got["world"] == WORLD
        assert got["checkpointing"] == ref["checkpointing"] == ("ckpt" in HF[case])
        assert got["norms"] == ref["norms"]  # logged grad_norm (clipping cases)
        if HF[case].get("max_grad_norm"):
            assert len(got["norms"]) == 3


@pytest.mark.xdist_group("ddp-tools-hf")  # (one launch per tool: one worker)
def test_hf_callback_under_ddp_is_refused(runs):
    for r in runs("hf"):
        outcome = r["callback-refused/layeropt"]
        assert outcome.get("error", "").startswith("TrainerSetupError: LayeroptCallback cannot"), \
            outcome
        assert "Use LayeroptTrainer" in outcome["error"]


@pytest.mark.xdist_group("ddp-tools-hf")  # (one launch per tool: one worker)
def test_hf_trainer_with_fsdp_is_refused(runs):
    """LayeroptTrainer under FSDP (``fsdp=True``, two processes): refused, naming the way
    out, before anything is stepped (README, docs/integrations.md)."""
    for r in runs("hf"):
        outcome = r["fsdp-refused/layeropt"]
        if "no available devices found" in outcome.get("error", ""):  # (before layeropt's)
            pytest.skip(f"FSDP under this accelerate and torch {torch.__version__} needs a "
                        f"GPU: {outcome['error'][:120]}")
        assert outcome.get("error", "").startswith("TrainerSetupError:"), outcome
        assert "not FSDP or DeepSpeed" in outcome["error"], outcome


@pytest.mark.xdist_group("ddp-tools-lightning")  # (one launch per tool: one worker)
@pytest.mark.parametrize("case", list(LIGHTNING))
def test_lightning_under_ddp_equals_torch_optim(runs, case):
    _same(runs("lightning"), case)


def test_lightning_forking_its_own_processes_equals_torch_optim():
    """``strategy="ddp_notebook"``: Lightning forks the ranks; rank 0's weights come back.
    Run in a fresh process, as a notebook's: Lightning forks from it and sets its
    ``MASTER_PORT`` (a test runner's worker has a second thread, and its later tests
    would inherit the port), and a rank left waiting fails the test at the timeout."""
    pytest.importorskip("lightning")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(WORKER.parent), *filter(None, [os.environ.get("PYTHONPATH")])]))
    code = "import test_integrations_ddp as t; t.lightning_forking_its_own_processes()"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert done.stdout.splitlines()[-1] == "equal to torch.optim", done.stdout[-3000:]


def lightning_forking_its_own_processes() -> None:
    """The test above, in its own process."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    import layeropt
    from layeropt.integrations.lightning import LayeroptCallback

    class Net(L.LightningModule):
        def __init__(self, opt_cls: Any) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(),
                                           torch.nn.Linear(32, 4))
            self.opt_cls = opt_cls

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return self.opt_cls(self.parameters(), lr=1e-2)

    def fit(opt_cls: Any, callbacks: list) -> Net:
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g))
        module = Net(opt_cls)
        trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=WORLD,
                            strategy="ddp_notebook", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            gradient_clip_val=0.05, accumulate_grad_batches=2,
                            callbacks=callbacks)
        trainer.fit(module, DataLoader(data, batch_size=4))
        return module

    ref = fit(torch.optim.AdamW, [])
    got = fit(layeropt.AdamW, [LayeroptCallback()])
    start = Net(torch.optim.AdamW)
    assert not all(torch.equal(p, q) for p, q in zip(ref.parameters(), start.parameters()))
    assert_same(list(got.parameters()), list(ref.parameters()), "params vs torch.optim")
    print("equal to torch.optim")
