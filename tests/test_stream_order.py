"""Offload's copy pipeline, in order, on the CPU: every mode with simulated CUDA streams.

``tests/streamsim.py`` runs offload with every copy asynchronous, as on CUDA,
and reports each read or write of a tensor not ordered after what it depends
on (a race a GPU could show as a wrong number, or never). Each mode trains
the same model as torch.optim, through accumulation windows and clipping,
and must end with no race and the same parameters and optimizer state bit
for bit. The first tests show the checker fails: each removes one wait the
pipeline needs and expects the race it leaves.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import layeropt
from harness import SOAK, assert_models_equal, assert_same
from layeropt.models import make_model
from layeropt.offload.state import StateOffload
from streamsim import MODES, Sim, SimEvent, SimStream, offload_in_mode, simulate


def _train(monkeypatch: Any, kw: dict[str, Any], cap: float, micro: int, clip: float | None,
           query: Any = lambda: False, steps: int = 3):
    """torch.optim AdamW(fused) and layeropt offloaded in the mode ``kw``, simulated;
    returns (reference model, its optimizer, model, optimizer, the Sim)."""
    model, batch_fn, loss_fn = make_model("gpt")
    ref, ours = copy.deepcopy(model), copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, fused=True)
    opt = layeropt.AdamW(ours.parameters(), lr=0.01, fused=True)
    layeropt.attach(ours, opt, bucket_cap_mb=cap)
    gen = torch.Generator().manual_seed(0)
    with simulate(monkeypatch, query) as sim:
        handle = offload_in_mode(opt, kw)
        for _ in range(steps):
            batches = [batch_fn(gen) for _ in range(micro)]
            for data in batches:
                (loss_fn(ref, data) / micro).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            ref_opt.step()
            ref_opt.zero_grad()
            for k, data in enumerate(batches):
                loss = loss_fn(ours, data) / micro
                if k < micro - 1:
                    with opt.no_step():
                        loss.backward()
                elif clip is not None:
                    layeropt.backward(loss, max_norm=clip)
                else:
                    loss.backward()
            opt.step()
            opt.zero_grad()
        state = opt.state_dict()  # (waits for the copies back itself)
    return ref, ref_opt, ours, state, sim, handle


# -- the checker fails where a wait is missing ------------------------------------------
def test_copy_back_without_waiting_for_the_step_races(monkeypatch):
    """The side stream's copy back must wait for the step that wrote the working state."""
    monkeypatch.setattr(SimStream, "wait_stream", lambda self, other: None)
    *_, sim, _ = _train(monkeypatch, MODES["overlap, held on device"], 0.0, 1, None, steps=2)
    assert any("copy_" in r and "reads default" in r for r in sim.races), sim.races[:3]


def test_a_step_waits_for_the_copies_back_in_flight(monkeypatch):
    """One copy stream: a step waits for every copy back in flight (its events)."""
    monkeypatch.setattr(SimStream, "wait_event", lambda self, event: None)
    *_, sim, _ = _train(monkeypatch, MODES["overlap, held on device"], 1.0, 1, None, steps=2)
    assert any("reads side" in r or "read by side" in r for r in sim.races), sim.races[:3]


def test_a_step_not_waiting_for_the_copy_back_races(monkeypatch):
    """The next bring-in of a host tensor must wait for the copy back into it (its
    event: ``StateOffload._after_writes``)."""
    monkeypatch.setattr(StateOffload, "_after_writes", lambda self, *args: None)
    # (the default cap: few buckets, so a bucket's copy back is still in flight when it
    # steps again; with many, retiring older copies has made the host wait already.
    # Two copy streams: one stream's step does not wait for every copy back)
    *_, sim, _ = _train(monkeypatch, dict(overlap=True, held_grads=False, copy_streams=2),
                        1.0, 1, None, steps=2)
    assert any("reads side" in r or "read by side" in r for r in sim.races), sim.races[:3]


def test_copies_in_not_waiting_for_the_compute_stream_race(monkeypatch):
    """Two copy streams, sums added on the device: a copy in reads host tensors the
    compute stream's copies wrote (a held sum sent back down) or waited for (earlier
    copies back), so it waits for the work queued there."""
    mode = MODES["overlap + prefetch, 2 copy streams, sums added on the device"]
    *_, sim, _ = _train(monkeypatch, mode, 0.0, 3, None, steps=2)
    assert not sim.races and sim.ops.get("side2", 0) > 0
    wait = SimStream.wait_stream
    monkeypatch.setattr(SimStream, "wait_stream",
                        lambda self, other: None if self.name == "side2" else wait(self, other))
    *_, sim, _ = _train(monkeypatch, mode, 0.0, 3, None, steps=2)
    assert any("on side2 reads" in r for r in sim.races), sim.races[:3]


def test_host_sum_before_the_copy_down_lands_races(monkeypatch):
    """Held gradients: the host adds a micro-batch's copy only after it has landed."""
    *_, sim, _ = _train(monkeypatch, MODES["sync"], 0.0, 3, None, steps=1)
    assert not sim.races
    monkeypatch.setattr(Sim, "host_waits", lambda self, device: None)
    *_, sim, _ = _train(monkeypatch, MODES["sync"], 0.0, 3, None, steps=1)
    assert any("on host reads default" in r for r in sim.races), sim.races[:3]


def test_reading_host_state_without_synchronize_races(monkeypatch):
    """Overlapped copies back land later: the host reads them after synchronize()."""
    _, _, _, _, sim, handle = _train(monkeypatch, MODES["overlap, held on device"], 0.0, 1,
                                     None, steps=1)
    assert not sim.races
    with simulate(monkeypatch) as sim:
        model, batch_fn, loss_fn = make_model("gpt")
        opt = layeropt.AdamW(model.parameters(), lr=0.01, fused=True)
        layeropt.attach(model, opt, bucket_cap_mb=0.0)
        offload_in_mode(opt, MODES["overlap, held on device"])
        loss_fn(model, batch_fn(torch.Generator().manual_seed(0))).backward()
        for s in opt.state.values():  # read directly, no synchronize(): a race
            s["exp_avg"].sum()
    assert any("on host reads side" in r for r in sim.races), sim.races[:3]


# -- every mode: ordered, and torch's numbers ----------------------------------------------
# each mode under every pair of (schedule, micro-batches, clipping) values: the four rows
# of a pairwise covering array (the eight combinations, less the ones no pair needs;
# test_generated_modes_are_ordered_and_exact draws any combination)
PAIRWISE = [(0.0, 1, None), (0.0, 3, 0.05), (1.0, 1, 0.05), (1.0, 3, None)]


@pytest.mark.parametrize("cap,micro,clip", PAIRWISE, ids=[
    f"{'cap0' if cap == 0 else 'default-cap'}-{micro}-{'clip' if clip else 'no-clip'}"
    for cap, micro, clip in PAIRWISE])
@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_is_ordered_and_exact(monkeypatch, mode, cap, micro, clip):
    ref, ref_opt, ours, state, sim, handle = _train(monkeypatch, MODES[mode], cap, micro, clip)
    assert sim.races == []
    if handle.overlap or (handle.order is not None and cap == 0.0):  # (the default cap:
        assert sim.ops.get("side1", 0) > 0  # one step call, nothing to fetch ahead)
    assert_models_equal(ref, ours)
    assert_same(ref_opt.state_dict(), state)


@pytest.mark.parametrize("mode", ["overlap + prefetch", "overlap alone, held in host memory (refused)"])
def test_events_done_at_any_time(monkeypatch, mode):
    """Whether an event has finished when queried changes which copies are retired when;
    the order holds either way."""
    rng = random.Random(0)
    for query in (lambda: True, lambda: rng.random() < 0.5):
        ref, ref_opt, ours, state, sim, _ = _train(monkeypatch, MODES[mode], 0.0, 2, 0.05,
                                                   query=query)
        assert sim.races == []
        assert_models_equal(ref, ours)
        assert_same(ref_opt.state_dict(), state)


def test_simulated_events_order_only_what_they_record(monkeypatch):
    """The checker itself: an event orders a stream after what was queued before its
    record, not after what came later."""
    with simulate(monkeypatch) as sim:
        side = sim.new_stream(torch.device("cpu"))
        a = torch.zeros(4)  # (on the default stream)
        side.wait_stream(sim.default)
        with sim.on(side):
            a.add_(1)
            done = SimEvent(sim)
            done.record(side)
            a.add_(1)  # after the event
        sim.default.wait_event(done)
        a.sum()  # default stream reads the second add: unordered
    assert len(sim.races) == 1 and "reads side" in sim.races[0]


class _Skipping(torch.nn.Module):
    """Three layers; a step with ``short=True`` uses only the last, so the state fetched
    ahead for the other two after it steps is never used in that backward."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor, short: bool) -> torch.Tensor:
        if not short:
            x = self.layers[1](self.layers[0](x))
        return self.layers[2](x).square().mean()


@pytest.mark.parametrize("mode", ["prefetch", "overlap + prefetch",
                                  "overlap + prefetch, 2 copy streams"])
def test_copies_fetched_ahead_and_dropped_are_waited_for(monkeypatch, mode):
    """State fetched ahead and never used (buckets that did not land) is still being
    read when a load_state_dict writes the same host tensors: synchronize() waits for
    those copies too, so the load is ordered after them."""
    torch.manual_seed(0)
    model = _Skipping()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    opt = layeropt.AdamW(model.parameters(), lr=0.01)
    layeropt.attach(model, opt, bucket_cap_mb=0.0)
    xs = torch.randn(5, 4, 8)
    with simulate(monkeypatch) as sim:
        handle = offload_in_mode(opt, MODES[mode])
        for i, short in enumerate([False, True, False, True, False]):
            for m, o in ((ref, ref_opt), (model, opt)):
                m(xs[i], short).backward()
                o.step()
                o.zero_grad()
            if i == 1:  # the two skipped buckets' state was fetched ahead, unused
                assert handle._ahead
                opt.load_state_dict(copy.deepcopy(opt.state_dict()))
                ref_opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
        state = opt.state_dict()
    assert sim.races == []
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), state)


# -- generated: modes, models that skip layers, optimizers -------------------------------------
@settings(max_examples=25 * SOAK, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(overlap=st.booleans(), prefetch=st.booleans(), copy_streams=st.sampled_from([1, 2]),
       max_buckets=st.integers(1, 4), held=st.sampled_from(["host", "device", "half", "add"]),
       micro=st.integers(1, 3), clip=st.sampled_from([None, 0.05]),
       cap=st.sampled_from([0.0, 1.0]), shorts=st.lists(st.booleans(), min_size=2, max_size=4),
       opt=st.sampled_from([("AdamW", dict(lr=0.01, fused=True)),
                            ("Adam", dict(lr=0.01, amsgrad=True, foreach=True)),
                            ("SGD", dict(lr=0.1, momentum=0.9))]))
def test_generated_modes_are_ordered_and_exact(overlap, prefetch, copy_streams, max_buckets,
                                               held, micro, clip, cap, shorts, opt):
    """Any mode (the refused and unoffered ones too), steps that skip layers (state fetched
    ahead and dropped), accumulation and clipping: no race, torch's numbers."""
    name, kw = opt
    torch.manual_seed(0)
    model = _Skipping()
    ref = copy.deepcopy(model)
    ref_opt = getattr(torch.optim, name)(ref.parameters(), **kw)
    ours = getattr(layeropt, name)(model.parameters(), **kw)
    layeropt.attach(model, ours, bucket_cap_mb=cap)
    mode = dict(overlap=overlap, prefetch=prefetch, copy_streams=copy_streams,
                max_buckets=max_buckets, held_grads=held != "device",
                add_on_device=held == "add", **({"held_device_bytes": -2} if held == "half" else {}))
    xs = torch.randn(len(shorts), micro, 4, 8)
    with pytest.MonkeyPatch.context() as monkeypatch, simulate(monkeypatch) as sim:
        offload_in_mode(ours, mode)
        for step, short in enumerate(shorts):
            for m, o in ((ref, ref_opt), (model, ours)):
                for k in range(micro):
                    loss = m(xs[step, k], short) / micro
                    if m is model and k < micro - 1:
                        with o.no_step():
                            loss.backward()
                    elif m is model and clip is not None:
                        layeropt.backward(loss, max_norm=clip)
                    else:
                        loss.backward()
                if m is ref and clip is not None:
                    torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
                o.step()
                o.zero_grad()
        state = ours.state_dict()
    assert sim.races == []
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), state)


def test_deleting_the_optimizer_waits_for_copies_into_its_pool(monkeypatch):
    """Copies back into the pool's tensors may still be in flight when the optimizer is
    deleted: the pool's release makes the host wait for them before the block can be
    freed (torch's caching host allocator would not hold memory it did not hand out)."""
    with simulate(monkeypatch) as sim:
        model, batch_fn, loss_fn = make_model("gpt")
        opt = layeropt.AdamW(model.parameters(), lr=0.01, fused=True)
        handle = layeropt.attach(model, opt, bucket_cap_mb=0.0)
        offload_in_mode(opt, MODES["overlap, held on device"])
        loss_fn(model, batch_fn(torch.Generator().manual_seed(0))).backward()
        assert sim.clocks["host"].get("side1", 0) < sim.clocks["side1"]["side1"]  # in flight
        handle.remove()
        del opt, handle
        assert sim.clocks["host"]["side1"] == sim.clocks["side1"]["side1"]  # waited for
