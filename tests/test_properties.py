"""Property tests: random DAG models with skips, sharing, freezing; random options."""

from __future__ import annotations

import copy

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import layeropt
from harness import assert_models_equal, assert_same


class RandomDAG(nn.Module):
    """Nodes are Linear layers (possibly shared or frozen) fed by sums of earlier outputs."""

    def __init__(self, spec: list[tuple[int, list[int]]], frozen: set[int], n_layers: int, d: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n_layers + 1))  # +1: unused
        for i in frozen:
            self.layers[i].requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(d))  # used at both ends of the network
        self.spec = spec

    def forward(self, x):
        outs = [x * self.scale]
        for layer_idx, inputs in self.spec:
            h = sum(outs[j] for j in inputs)
            outs.append(torch.tanh(self.layers[layer_idx](h)))
        return (outs[-1] + outs[len(outs) // 2]) * self.scale


@st.composite
def dag_models(draw):
    n_layers = draw(st.integers(1, 4))
    n_nodes = draw(st.integers(1, 5))
    spec = []
    for node in range(n_nodes):
        layer = draw(st.integers(0, n_layers - 1))  # repeated index = shared weights
        inputs = draw(st.lists(st.integers(0, node), min_size=1, max_size=3, unique=True))
        spec.append((layer, inputs))
    frozen = set(draw(st.lists(st.integers(0, n_layers - 1), max_size=2)))
    return spec, frozen, n_layers


@st.composite
def optimizers(draw):
    name = draw(st.sampled_from(["SGD", "Adam", "AdamW", "Adagrad", "RMSprop"]))
    lr = draw(st.floats(1e-3, 0.3))
    kw: dict = dict(lr=lr, weight_decay=draw(st.sampled_from([0.0, 0.01, 0.1])))
    kw["maximize"] = draw(st.booleans())
    impl = draw(st.sampled_from(["loop", "foreach", "fused"]))
    if name == "SGD":
        kw["momentum"] = draw(st.sampled_from([0.0, 0.9]))
        kw["nesterov"] = kw["momentum"] > 0 and draw(st.booleans())
        if not kw["nesterov"]:
            kw["dampening"] = draw(st.sampled_from([0.0, 0.3]))
    if name in ("Adam", "AdamW"):
        kw["amsgrad"] = draw(st.booleans())
        kw["betas"] = (draw(st.floats(0.5, 0.95)), draw(st.floats(0.9, 0.999)))
    if name == "RMSprop":
        kw["centered"] = draw(st.booleans())
        kw["momentum"] = draw(st.sampled_from([0.0, 0.5]))
        impl = "loop" if impl == "fused" else impl
    if impl != "loop":
        kw[impl] = True
    return name, kw


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_spec=dag_models(), opt=optimizers(), split=st.booleans(), seed=st.integers(0, 2**16))
def test_random_models_match_torch_bitwise(model_spec, opt, split, seed):
    spec, frozen, n_layers = model_spec
    name, kw = opt
    torch.manual_seed(seed)
    model = RandomDAG(spec, frozen, n_layers, d=4)
    ref = copy.deepcopy(model)

    def groups(m):
        ps = list(m.parameters())
        return [{"params": ps[::2]}, {"params": ps[1::2], "lr": kw["lr"] / 2}] if split else ps

    ref_opt = getattr(torch.optim, name)(groups(ref), **kw)
    lo_opt = getattr(layeropt, name)(groups(model), **kw)
    layeropt.attach(model, lo_opt)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(2):
        x = torch.randn(3, 4, generator=gen)
        ref(x).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        model(x).pow(2).mean().backward()
        assert all(p.grad is None for p in model.parameters())
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), lo_opt.state_dict())
