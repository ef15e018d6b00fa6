"""Every script in examples/ runs its ``--tiny`` smoke run and prints what it shows.

Each script runs in a subprocess (from a temporary directory, so nothing is
written into the repository); the test asserts exit code 0 and, for the
scripts listed in ``EXPECT``, the output lines that carry their claim - most
of them that layeropt matched torch.optim bit for bit.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))

# script -> (arguments, regular expressions its output must contain)
EXPECT: dict[str, tuple[list[str], list[str]]] = {
    "custom_loss_amp.py": (["--tiny"], [
        r"3\. layeropt\.Adam attached \+ the same +[\d.]+ \w+ \(",
        r"runs 2 and 3 after \d+ steps: max \|difference\| = 0\.0e\+00 \(bit for bit\)",
    ]),
    "ddp_train.py": (["--tiny"], [
        r"replicas agree bit for bit",
        r"layeropt is bit-identical to DDP \+ torch\.optim",
    ]),
    "finetune_lm.py": (["--tiny", "--no-progress", "--check-resume"], [
        r"TinyGPT: [\d,]+ parameters in 3 layer-wise LR groups",
        r"resume check: 2 steps \+ save \+ resume to 4 vs one run: .*\(bit for bit\)",
    ]),
    "looped_forward.py": (["--tiny"], [
        r"LoopAccumulator",
        r"loop_recurrent",
    ]),
    "unet_layerwise.py": (["--tiny"], [
        r"1\. head\n",
        r"stem  <- its output is reused by up1: waited for both paths",
        r"max \|layeropt - torch\.optim\| = 0\.0e\+00 \(bit for bit\)",
        r"layeropt\.Adam +[\d.]+ \w+ \(",
    ]),
}


def _run(script: pathlib.Path, args: list[str], cwd: pathlib.Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{script.name} failed:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_expectations_name_existing_scripts():
    assert set(EXPECT) <= {p.name for p in EXAMPLES}


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_smoke_run(script, tmp_path):
    args, patterns = EXPECT.get(script.name, (["--tiny"], []))
    out = _run(script, args, tmp_path)
    for pattern in patterns:
        assert re.search(pattern, out), f"{script.name}: no match for {pattern!r} in:\n{out}"
    assert not any(tmp_path.iterdir()), f"{script.name} wrote files unasked: {list(tmp_path.iterdir())}"


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 8),
                    reason="FSDP2 runs on CPU from torch 2.8")
def test_ddp_train_with_fsdp2(tmp_path):
    """docs/distributed.md: ``examples/ddp_train.py --fsdp`` (FSDP2's fully_shard, two
    processes) prints that the replicas agree and layeropt is bit-identical to FSDP2 +
    torch.optim (the script exits 1 otherwise)."""
    out = _run(ROOT / "examples" / "ddp_train.py", ["--tiny", "--fsdp"], tmp_path)
    for pattern in (r"FSDP2, 2 processes", r"replicas agree bit for bit",
                    r"layeropt is bit-identical to FSDP2 \+ torch\.optim: max diff 0\b"):
        assert re.search(pattern, out), f"no match for {pattern!r} in:\n{out}"


def test_finetune_lm_gradual_unfreezing(tmp_path):
    """``--unfreeze 1``: one more block each step, picked up by the attached optimizer;
    save + resume mid-way (a different set of trainable blocks) is still exact."""
    out = _run(ROOT / "examples" / "finetune_lm.py",
               ["--tiny", "--no-progress", "--check-resume", "--unfreeze", "1"], tmp_path)
    for pattern in (r"step 0: 1 of 2 blocks trainable", r"step 1: 2 of 2 blocks trainable",
                    r"resume check: 2 steps \+ save \+ resume to 4 vs one run: .*\(bit for bit\)"):
        assert re.search(pattern, out), f"no match for {pattern!r} in:\n{out}"


def test_finetune_lm_with_local_hf_model(tmp_path):
    """``--model PATH``: a Hugging Face checkpoint saved with ``save_pretrained``."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "tiny-llama")
    out = _run(ROOT / "examples" / "finetune_lm.py",
               ["--tiny", "--no-progress", "--check-resume",
                "--model", str(tmp_path / "tiny-llama")],
               tmp_path)
    assert re.search(r"LlamaForCausalLM: [\d,]+ parameters in 3 layer-wise LR groups", out), out
    assert "(bit for bit)" in out, out


def test_finetune_lm_offload_state_is_exact(tmp_path, monkeypatch, capsys):
    """``--offload-state``: the saved model and optimizer state equal the same run without
    it, bit for bit; resuming loads the state into host memory and stays exact. (In this
    process, through the script's main(): two interpreters would cost more than the runs.)"""
    import importlib.util

    import torch
    from harness import assert_same

    script = ROOT / "examples" / "finetune_lm.py"
    spec = importlib.util.spec_from_file_location("finetune_lm", script)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()  # (main() sets its --threads)
    try:
        base = ["--tiny", "--no-progress"]
        example.main([*base, "--save", "plain.pt"])
        capsys.readouterr()
        example.main([*base, "--offload-state", "--check-resume", "--save", "host.pt"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    for pattern in (r"optimizer state in host memory: [\d.]+ KiB, at most [\d.]+ KiB",
                    r"resume check: 2 steps \+ save \+ resume to 4 vs one run: .*\(bit for bit\)"):
        assert re.search(pattern, out), f"no match for {pattern!r} in:\n{out}"
    plain, host = (torch.load(tmp_path / f, weights_only=True) for f in ("plain.pt", "host.pt"))
    assert plain["optimizer"]["state"]  # AdamW's moments were saved
    assert_same(host["model"], plain["model"], "model")
    assert_same(host["optimizer"], plain["optimizer"], "optimizer")
