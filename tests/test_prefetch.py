"""Prefetch in landing order (``offload_state(prefetch=True)``): the order logic on CPU.

``offload_state`` accepts ``prefetch=True`` on CUDA only (its copies run on a
side stream); here the same handle is built directly on CPU, where the copies
ahead run in line, so the order logic - which bucket is fetched ahead, which
copy is used and which is dropped - runs with real numbers. The results must
equal torch and layeropt without offload bit for bit whatever the order does:
a bucket that lands out of the recorded order is fetched on demand.
``tests/test_cuda_offload.py`` runs the CUDA case.
"""

from __future__ import annotations

import copy

import pytest
import torch

import layeropt
from harness import assert_models_equal, assert_same
from layeropt.offload.prefetch import LandingOrder
from layeropt.errors import LayeroptError
from layeropt.offload.state import StateOffload, _install, offload_state


def test_order_predicts_the_recorded_one():
    order = LandingOrder()
    assert order.upcoming(2) == []  # nothing recorded: nothing predicted
    for key in "abcde":
        order.landed(key, serial=1)
    assert order.upcoming(2) == []  # (e landed last: nothing after it in this backward)
    order.landed("a", serial=2)
    assert order.upcoming(2) == ["b", "c"]
    order.landed("b", serial=2)
    assert order.upcoming(5) == ["c", "d", "e"]


def test_a_changed_order_predicts_from_where_it_is():
    order = LandingOrder()
    for key in "abcde":
        order.landed(key, serial=1)
    order.landed("c", serial=2)  # c first this time
    assert order.upcoming(2) == ["d", "e"]
    order.landed("a", serial=2)
    assert order.upcoming(2) == ["b", "d"]  # (c landed already)
    for key in "bde":
        order.landed(key, serial=2)
    order.landed("x", serial=3)  # the next backward: predicted from c, a, b, d, e
    assert order.previous == list("cabde")


def test_a_skipped_and_a_new_bucket():
    order = LandingOrder()
    for key in "abcd":
        order.landed(key, serial=1)
    order.landed("a", serial=2)
    order.landed("c", serial=2)  # b skipped (no gradient this time)
    assert order.upcoming(2) == ["d"]
    order.landed("new", serial=2)  # a layer unfrozen late: unknown, predicts nothing
    assert order.upcoming(2) == []
    order.landed("d", serial=2)
    order.landed("a", serial=3)
    assert order.upcoming(3) == ["c", "new", "d"]  # the new bucket is known from now on


# -- with real numbers, on CPU ----------------------------------------------------------
class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(5))

    def forward(self, x: torch.Tensor, order=(0, 1, 2, 3, 4)) -> torch.Tensor:
        for i in order:
            x = torch.tanh(self.layers[i](x))
        return x.square().mean()


def _runs(cap: float, model: torch.nn.Module):
    ref = copy.deepcopy(model)
    runs = [(ref, torch.optim.AdamW(ref.parameters(), lr=0.01))]
    for prefetch in (None, False, True):
        m = copy.deepcopy(model)
        o = layeropt.AdamW(m.parameters(), lr=0.01)
        layeropt.attach(m, o, bucket_cap_mb=cap)
        handle = None
        if prefetch is not None:
            handle = _install(o, StateOffload(o, max_buckets=2, overlap=False,
                                              prefetch=prefetch))
        runs.append((m, o, handle))
    return runs


def _same(runs):
    (m0, o0), *rest = runs
    for m, o, _ in rest:
        assert_models_equal(m0, m)
        assert_same(o0.state_dict(), o.state_dict())


ORDERS = {  # the layers' order in each training step's forward
    "same": [(0, 1, 2, 3, 4)] * 4,
    "changed": [(0, 1, 2, 3, 4), (0, 1, 2, 3, 4), (3, 1, 0, 4, 2), (0, 1, 2, 3, 4)],
    "skipped": [(0, 1, 2, 3, 4), (0, 1, 2, 3, 4), (0, 2, 4), (0, 1, 2, 3, 4)],
}


@pytest.mark.parametrize("accumulate", [1, 3])
@pytest.mark.parametrize("orders", list(ORDERS), ids=list(ORDERS))
def test_prefetch_is_exact_whatever_the_order(orders, accumulate):
    torch.manual_seed(0)
    runs = _runs(0.0, Net())
    gen = torch.Generator().manual_seed(0)
    for order in ORDERS[orders]:
        xs = [torch.randn(4, 8, generator=gen) for _ in range(accumulate)]
        (ref, ref_opt), *ours = runs
        for x in xs:
            (ref(x, order) / accumulate).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for m, o, _ in ours:
            for k, x in enumerate(xs):
                if k < accumulate - 1:
                    with o.no_step():
                        (m(x, order) / accumulate).backward()
                else:
                    (m(x, order) / accumulate).backward()
            o.step()
            o.zero_grad()
    _same(runs)
    handle = runs[3][2]
    state = sum(2 * p.numel() * p.element_size() for p in runs[0][0].parameters())
    assert handle.prefetched_bytes > 0
    assert handle.device_bytes == 0  # nothing fetched ahead left behind after step()
    if orders == "same":  # every bucket but the first of each backward came ahead
        assert handle.wasted_bytes == 0
        layer = 2 * sum(p.numel() * p.element_size() for p in runs[0][0].layers[0].parameters())
        assert handle.copied_bytes == runs[2][2].copied_bytes  # no copy more than without
        ahead = 3 * (state - layer)  # steps 2-4: every bucket's state but the first's
        if accumulate > 1:  # and the held gradients' sums (half a bucket's AdamW state)
            ahead += ahead // 2
        assert handle.prefetched_bytes == ahead
        assert handle.held.up_bytes == runs[2][2].held.up_bytes
    else:
        assert handle.wasted_bytes > 0  # fetched ahead, then out of order: dropped


def test_a_layer_unfrozen_late_is_fetched_on_demand():
    torch.manual_seed(0)
    model = Net()
    model.layers[2].requires_grad_(False)
    runs = _runs(0.0, model)
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        if step == 2:
            for m in [r[0] for r in runs]:
                m.layers[2].requires_grad_(True)
        x = torch.randn(4, 8, generator=gen)
        for i, r in enumerate(runs):
            m, o = r[0], r[1]
            m(x).backward()
            o.step()
            o.zero_grad()
    _same(runs)


def test_prefetch_needs_cuda():
    model = Net()
    opt = layeropt.AdamW(model.parameters())
    if not torch.cuda.is_available():
        with pytest.raises(LayeroptError, match="prefetch=False"):
            offload_state(opt, prefetch=True)
    assert offload_state(opt).order is None  # off by default
