"""Memory-lean losses equal the plain ones, and use fewer bytes (CPU, exact counts).

References are independent plain torch: the loss called directly,
``torch.sum(x * y)``, and ``F.cross_entropy(hidden @ weight.T + bias, targets)``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import layeropt
from harness import REPRESENTATIVE, assert_same, config_id
from layeropt import losses
from layeropt.losses import (
    ChunkedLMHead,
    Recompute,
    linear_cross_entropy,
    recompute,
    sum_product,
)
from layeropt.memory import PeakMemory
from layeropt.models import TinyGPT

NATIVE = losses.has_native_linear_cross_entropy()
IMPLS = ["chunked"] + (["torch", "auto"] if NATIVE else ["auto"])
F32 = 4  # bytes per float32
RNG_STATE = 5056  # bytes of the CPU generator state non-reentrant checkpoint keeps
CKPT_SLACK = 8192  # per checkpoint call: RNG state + small bookkeeping tensors


def rel(a: Tensor, b: Tensor) -> float:
    """Relative error ||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def peak(fn, backward: bool = True) -> int:
    """Peak bytes above the start while calling ``fn`` (and its backward)."""
    with PeakMemory() as mem:
        out = fn()
        if backward:
            out.backward()
    return mem.peak


# ---------------------------------------------------------------- recompute


def _pairwise_logsumexp(u: Tensor, t: Tensor) -> Tensor:
    return torch.logsumexp(u @ t.T, dim=1).sum()


def _dropout_loss(x: Tensor, y: Tensor) -> Tensor:
    return torch.sum(F.dropout(torch.tanh(x), p=0.5) * y)


def _kwarg_loss(x: Tensor, y: Tensor, *, scale: float = 1.0, target: Tensor | None = None):
    return scale * F.mse_loss(x * y, target)


# (name, loss, makes (args, kwargs) from x, y)
RECOMPUTE_CASES = [
    ("sum(x*y)", lambda x, y: torch.sum(x * y), lambda x, y: ((x, y), {})),
    ("pairwise logsumexp", _pairwise_logsumexp, lambda x, y: ((x, y), {})),
    ("dropout inside", _dropout_loss, lambda x, y: ((x, y), {})),
    ("keyword args", _kwarg_loss, lambda x, y: ((x, y), dict(scale=0.5, target=y.detach()))),
    ("nn.SmoothL1Loss", nn.SmoothL1Loss(), lambda x, y: ((torch.sin(x), y), {})),
]


@pytest.mark.parametrize("name,fn,make", RECOMPUTE_CASES, ids=[c[0] for c in RECOMPUTE_CASES])
def test_recompute_same_loss_and_grads_bitwise(name, fn, make):
    x, y = torch.randn(64, 8, requires_grad=True), torch.randn(64, 8, requires_grad=True)
    results = []
    for f in (fn, recompute(fn)):
        torch.manual_seed(3)  # same dropout mask in both runs
        args, kwargs = make(x, y)
        loss = f(*args, **kwargs)
        torch.manual_seed(99)  # RNG moves before backward: recompute must replay
        results.append((loss.detach(), torch.autograd.grad(loss, (x, y))))
    assert_same(results[0], results[1])


def test_recompute_module_keeps_parameters_and_grads():
    class Temp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.t = nn.Parameter(torch.tensor(0.7))

        def forward(self, a: Tensor, b: Tensor) -> Tensor:
            return _pairwise_logsumexp(a / self.t, b)

    plain = Temp()
    lean = Recompute(copy.deepcopy(plain))
    assert [n for n, _ in lean.named_parameters()] == ["loss.t"]
    a, b = torch.randn(16, 4, requires_grad=True), torch.randn(32, 4)
    grads = [torch.autograd.grad(m(a, b), (a, *m.parameters())) for m in (plain, lean)]
    assert_same(grads[0], grads[1])


def test_recompute_with_attached_optimizer_matches_torch_optim_bitwise():
    """A loss with its own parameter, recomputed in backward, stepped by layeropt in backward."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(8, 8)
            self.temp = nn.Parameter(torch.tensor(0.7))

    def train(model: Scaled, opt, attached: bool) -> None:
        handle = layeropt.attach(model, opt) if attached else None
        # a parameter in the closure
        crit = recompute(lambda a, b: _pairwise_logsumexp(a / model.temp, b))
        gen = torch.Generator().manual_seed(5)
        for _ in range(3):
            x, q = torch.randn(16, 8, generator=gen), torch.randn(32, 8, generator=gen)
            crit(torch.tanh(model.body(x)), q).backward()
            opt.step()
            opt.zero_grad()
        if handle is not None:
            handle.remove()

    model = Scaled()
    ref = copy.deepcopy(model)
    train(ref, torch.optim.Adam(ref.parameters(), lr=0.1), attached=False)
    train(model, layeropt.Adam(model.parameters(), lr=0.1), attached=True)
    assert_same(ref.state_dict(), model.state_dict())
    assert not torch.equal(ref.temp, torch.tensor(0.7))


def test_recompute_under_no_grad_calls_loss_directly():
    calls = []

    def fn(x: Tensor) -> Tensor:
        calls.append(torch.is_grad_enabled())
        return x.sum()

    with torch.no_grad():
        out = recompute(fn)(torch.ones(3, requires_grad=True))
    assert calls == [False] and out.grad_fn is None and out.item() == 3.0
    assert recompute(fn).__name__ == "fn"


def test_recompute_rejects_non_callable():
    with pytest.raises(TypeError, match="callable"):
        recompute(3)  # type: ignore[arg-type]


ROWS, COLS, DIM = 256, 512, 16
INTERMEDIATE = ROWS * COLS * F32  # (rows, cols) similarity matrix logsumexp saves
INPUT = ROWS * DIM * F32  # what the recomputed call keeps for its replay


def test_recompute_holds_no_intermediate_between_forward_and_backward():
    p = torch.randn(ROWS, DIM, requires_grad=True)
    q = torch.randn(COLS, DIM)
    held = []
    for fn in (_pairwise_logsumexp, recompute(_pairwise_logsumexp)):
        with PeakMemory() as mem:
            loss = fn(p * 2, q)
        held.append(mem.end)
        loss.backward()
    assert held[0] >= INTERMEDIATE
    assert held[1] <= INPUT + CKPT_SLACK
    assert held[0] - held[1] >= INTERMEDIATE - INPUT - CKPT_SLACK


@pytest.mark.parametrize("terms", [3, 6])
def test_recompute_peak_drops_with_several_loss_terms(terms):
    """Plain keeps every term's (rows, cols) matrix until backward; recompute one at a time."""
    p = torch.randn(ROWS, DIM, requires_grad=True)
    q = torch.randn(COLS, DIM)
    lean_logsumexp = recompute(_pairwise_logsumexp)
    plain = peak(lambda: sum(_pairwise_logsumexp(p * (i + 1), q) for i in range(terms)))
    p.grad = None
    lean = peak(lambda: sum(lean_logsumexp(p * (i + 1), q) for i in range(terms)))
    assert plain >= terms * INTERMEDIATE
    # Recompute rebuilds one term at a time, so it saves every other term's
    # matrix, less the inputs + RNG state each term keeps for its replay.
    assert plain - lean >= (terms - 1) * INTERMEDIATE - terms * (INPUT + CKPT_SLACK)
    assert plain - lean >= INTERMEDIATE  # at least one avoided intermediate


# -------------------------------------------------------------- sum_product

SHAPES = [
    ((1000,), (1000,)),
    ((7, 33), (7, 33)),
    ((40, 1, 16), (1, 50, 16)),
    ((40, 1, 16), (50, 16)),
    ((5, 6, 7), ()),
    ((1, 1), (9, 11)),
]


@pytest.mark.parametrize("xs,ys", SHAPES, ids=[f"{a}x{b}" for a, b in SHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sum_product_matches_sum_of_product(xs, ys, dtype):
    x = torch.randn(xs, dtype=dtype, requires_grad=True)
    y = torch.randn(ys, dtype=dtype, requires_grad=True)
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    ref, out = torch.sum(x * y), sum_product(x, y)
    assert out.shape == () and out.dtype == dtype
    assert abs((out - ref).item()) <= tol * (x.abs() * y.abs()).sum().item()
    for a, b in zip(torch.autograd.grad(out, (x, y)), torch.autograd.grad(ref, (x, y))):
        assert a.shape == b.shape and rel(a, b) <= tol


def test_sum_product_on_non_contiguous_and_mixed_dtype():
    x = torch.randn(20, 30).t()
    y = torch.randn(30, 20, dtype=torch.float64)
    assert torch.allclose(sum_product(x, y), torch.sum(x * y), rtol=1e-12, atol=0)


N_PROD = 1 << 18
PRODUCT = N_PROD * F32


def test_sum_product_avoids_product_without_grad():
    x, y = torch.randn(N_PROD), torch.randn(N_PROD)
    plain = peak(lambda: torch.sum(x * y), backward=False)
    lean = peak(lambda: sum_product(x, y), backward=False)
    assert plain >= PRODUCT and plain - lean >= PRODUCT


def test_sum_product_avoids_broadcast_product_in_forward_and_backward():
    a = torch.randn(64, 1, 64, requires_grad=True)
    b = torch.randn(1, 1024, 64)
    product = 64 * 1024 * 64 * F32
    plain = peak(lambda: torch.sum(a * b))
    a.grad = None
    lean = peak(lambda: sum_product(a, b))
    assert plain >= product + a.numel() * F32  # product (or its gradient) + a.grad
    assert lean <= a.numel() * F32 + 1024  # a.grad and a few small sums
    assert plain - lean >= product - 1024


def test_same_shape_dot_does_not_lower_a_training_peak():
    """Documented in docs/losses.md: backward needs an x-sized gradient anyway."""
    x, y = torch.randn(N_PROD, requires_grad=True), torch.randn(N_PROD)
    plain = peak(lambda: torch.sum(x * y))
    x.grad = None
    lean = peak(lambda: sum_product(x, y))
    assert lean >= PRODUCT  # the gradient of x
    assert plain - lean < PRODUCT // 100


# ------------------------------------------------------ linear_cross_entropy

LCE_CASES = [
    # (tokens, D, V, chunk_size, bias, reduction, label_smoothing)
    (37, 8, 50, 6, True, "mean", 0.0),
    (37, 8, 50, 6, True, "sum", 0.0),
    (37, 8, 50, 6, False, "none", 0.0),
    (37, 8, 50, 64, True, "mean", 0.0),  # one chunk bigger than the input
    (16, 16, 300, 1, False, "mean", 0.0),  # one row per chunk
    (64, 16, 300, None, True, "sum", 0.0),  # default chunk size
    (37, 8, 50, 6, True, "mean", 0.1),
    (37, 8, 50, 5, False, "none", 0.2),
]


def _lce_inputs(n: int, d: int, v: int, bias: bool, dtype: torch.dtype, ignore_every: int = 5):
    h = torch.randn(n, d, dtype=dtype, requires_grad=True)
    w = (torch.randn(v, d, dtype=dtype) / d**0.5).requires_grad_()
    b = torch.randn(v, dtype=dtype, requires_grad=True) if bias else None
    t = torch.randint(0, v, (n,))
    t[::ignore_every] = -100
    return h, w, b, t


# F.linear_cross_entropy's chunked path has no label smoothing: impl="torch" refuses it.
LCE_PARAMS = [(i, c) for i in IMPLS for c in LCE_CASES if not (i == "torch" and c[-1])]


def _case_id(c: object) -> str:
    return "-".join(map(str, c)) if isinstance(c, tuple) else str(c)


@pytest.mark.parametrize("impl,case", LCE_PARAMS, ids=_case_id)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-13)])
def test_linear_cross_entropy_matches_cross_entropy(impl, case, dtype, tol):
    n, d, v, chunk, bias, reduction, smoothing = case
    h, w, b, t = _lce_inputs(n, d, v, bias, dtype)
    inputs = (h, w) if b is None else (h, w, b)
    logits = h @ w.T + b if b is not None else h @ w.T
    ref = F.cross_entropy(logits, t, reduction=reduction, label_smoothing=smoothing)
    out = linear_cross_entropy(
        h, w, t, b, chunk_size=chunk, reduction=reduction, label_smoothing=smoothing, impl=impl
    )
    assert out.shape == ref.shape and out.dtype == dtype and rel(out, ref) <= tol
    grad_out = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, inputs, grad_out)
    for name, g, r in zip("hwb", torch.autograd.grad(out, inputs, grad_out), ref_grads):
        assert rel(g, r) <= tol, f"grad of {name}: {rel(g, r)}"
    if reduction == "none":
        assert torch.all(out.detach()[t == -100] == 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_linear_cross_entropy_keeps_leading_dims_and_custom_ignore_index(impl):
    h, w, _, t = _lce_inputs(24, 8, 40, False, torch.float32)
    h3, t3 = h.detach().reshape(2, 12, 8).requires_grad_(), t.reshape(2, 12).clone()
    t3[t3 == -100] = 7  # a real class id used as ignore_index
    ref = F.cross_entropy((h3 @ w.T).transpose(1, 2), t3, ignore_index=7, reduction="none")
    out = linear_cross_entropy(h3, w, t3, ignore_index=7, reduction="none", chunk_size=5, impl=impl)
    assert out.shape == (2, 12) and rel(out, ref) <= 1e-6
    assert rel(torch.autograd.grad(out.sum(), h3)[0], torch.autograd.grad(ref.sum(), h3)[0]) <= 1e-6


@pytest.mark.parametrize("impl", IMPLS)
def test_linear_cross_entropy_all_ignored(impl):
    h, w, b, t = _lce_inputs(8, 4, 10, True, torch.float32)
    t.fill_(-100)
    assert torch.isnan(linear_cross_entropy(h, w, t, b, impl=impl))  # 0/0, like F.cross_entropy
    total = linear_cross_entropy(h, w, t, b, reduction="sum", impl=impl)
    assert total.item() == 0.0
    for g in torch.autograd.grad(total, (h, w, b)):
        assert torch.all(g == 0)


# (bias, reduction, label_smoothing, chunk_size, dtype): every target ignored, e.g. a
# micro-batch that is all prompt. The mean is 0/0 = NaN but its gradients are zeros.
ALL_IGNORED_CASES = [
    (True, "mean", 0.0, 3, torch.float32),
    (False, "mean", 0.0, None, torch.float32),
    (True, "mean", 0.0, 1, torch.float64),
    (True, "mean", 0.1, 3, torch.float32),
    (True, "sum", 0.0, 3, torch.float32),
    (False, "sum", 0.1, 4, torch.float64),
    (True, "none", 0.0, 3, torch.float32),
    (True, "none", 0.2, 5, torch.float64),
]
ALL_IGNORED_PARAMS = [
    (i, c) for i in IMPLS for c in ALL_IGNORED_CASES if not (i == "torch" and c[2])
]


def _same_with_nan(a: Tensor, b: Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("impl,case", ALL_IGNORED_PARAMS, ids=_case_id)
def test_linear_cross_entropy_all_ignored_matches_cross_entropy_exactly(impl, case):
    """Values and gradients bit for bit: one NaN gradient would make the weights NaN."""
    bias, reduction, smoothing, chunk, dtype = case
    h, w, b, t = _lce_inputs(2 * 7, 8, 11, bias, dtype)
    h3, t2 = h.detach().reshape(2, 7, 8).requires_grad_(), t.reshape(2, 7).fill_(-100)
    inputs = (h3, w) if b is None else (h3, w, b)
    ref = F.cross_entropy(
        F.linear(h3, w, b).transpose(1, 2), t2, reduction=reduction, label_smoothing=smoothing
    )
    out = linear_cross_entropy(
        h3, w, t2, b, chunk_size=chunk, reduction=reduction, label_smoothing=smoothing, impl=impl
    )
    assert out.shape == ref.shape and out.dtype == ref.dtype and _same_with_nan(out, ref)
    assert torch.isnan(out).all() if reduction == "mean" else torch.all(out == 0)
    grad_out = -2.5 * torch.ones_like(ref)  # a scaled, negative upstream gradient
    ref_grads = torch.autograd.grad(ref, inputs, grad_out)
    for name, g, r in zip("hwb", torch.autograd.grad(out, inputs, grad_out), ref_grads):
        assert torch.equal(g, r) and torch.all(r == 0), f"grad of {name}: {g}"


@pytest.mark.parametrize("impl", IMPLS)
def test_all_ignored_micro_batch_leaves_weights_finite(impl):
    """An all-prompt micro-batch accumulated with a real one: the update stays finite."""
    h, w, _, t = _lce_inputs(12, 8, 20, False, torch.float32, ignore_every=3)
    ref_w = w.detach().clone().requires_grad_()
    prompt = torch.full_like(t, -100)
    for targets in (prompt, t):
        linear_cross_entropy(h, w, targets, chunk_size=5, impl=impl).backward()
        F.cross_entropy(F.linear(h, ref_w), targets).backward()
    assert torch.isfinite(w.grad).all() and rel(w.grad, ref_w.grad) <= 1e-6


def test_chunked_fallback_never_calls_torch_op(monkeypatch):
    """The fallback (torch < 2.13, or label smoothing) must work with no native op."""

    def boom(*args, **kwargs):
        raise AssertionError("F.linear_cross_entropy called")

    monkeypatch.setattr(F, "linear_cross_entropy", boom, raising=False)
    h, w, b, t = _lce_inputs(20, 8, 30, True, torch.float64)
    ref = F.cross_entropy(h @ w.T + b, t, label_smoothing=0.1)
    assert rel(linear_cross_entropy(h, w, t, b, impl="chunked", label_smoothing=0.1), ref) <= 1e-13
    assert rel(linear_cross_entropy(h, w, t, b, label_smoothing=0.1), ref) <= 1e-13  # auto
    monkeypatch.setattr(losses, "has_native_linear_cross_entropy", lambda: False)
    ref = F.cross_entropy(h @ w.T + b, t)
    assert rel(linear_cross_entropy(h, w, t, b), ref) <= 1e-13  # auto on "old torch"
    with pytest.raises(ValueError, match="impl='chunked'"):
        linear_cross_entropy(h, w, t, b, impl="torch")


def test_chunked_supports_retain_graph_but_not_double_backward():
    h, w, b, t = _lce_inputs(10, 4, 12, True, torch.float64)
    loss = linear_cross_entropy(h, w, t, b, chunk_size=3, impl="chunked")
    first = torch.autograd.grad(loss, w, retain_graph=True)[0]
    assert torch.equal(torch.autograd.grad(loss, w, retain_graph=True)[0], first)
    (g,) = torch.autograd.grad(loss, h, create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()


def test_chunked_low_precision_accumulates_in_float32():
    h, w, b, t = _lce_inputs(40, 16, 64, True, torch.float32)
    ref = F.cross_entropy(h @ w.T + b, t)
    out = linear_cross_entropy(h.bfloat16(), w.bfloat16(), t, b.bfloat16(), impl="chunked")
    assert out.dtype == torch.bfloat16 and abs(out.float() - ref).item() <= 2e-2 * ref.item()


BAD_ARGS = [
    (dict(impl="fast"), ValueError, "impl must be one of"),
    (dict(reduction="batchmean"), ValueError, "reduction must be one of"),
    (dict(label_smoothing=1.5), ValueError, "label_smoothing"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(ignore_index=1.5), TypeError, "ignore_index"),
    (dict(weight=torch.ones(5, 3)), ValueError, r"weight \(V, D\)"),
    (dict(targets=torch.zeros(4, dtype=torch.long)), ValueError, "targets shape"),
    (dict(targets=torch.zeros(6)), TypeError, "class indices"),
    (dict(bias=torch.zeros(4)), ValueError, "bias must have shape"),
]


@pytest.mark.parametrize("override,exc,msg", BAD_ARGS, ids=[str(a[0])[:30] for a in BAD_ARGS])
def test_linear_cross_entropy_rejects_bad_arguments(override, exc, msg):
    args = dict(hidden=torch.randn(6, 4), weight=torch.randn(10, 4), targets=torch.zeros(6).long())
    args.update(override)
    with pytest.raises(exc, match=msg):
        linear_cross_entropy(**args)


@pytest.mark.skipif(not NATIVE, reason="needs F.linear_cross_entropy (torch >= 2.13)")
def test_impl_torch_refuses_label_smoothing():
    with pytest.raises(ValueError, match="label_smoothing=0"):
        linear_cross_entropy(torch.randn(3, 2), torch.randn(5, 2), torch.zeros(3).long(),
                             label_smoothing=0.1, impl="torch")  # fmt: skip


TOKENS, HID, VOCAB, CHUNK = 512, 32, 2048, 32
LOGITS = TOKENS * VOCAB * F32
CHUNK_LOGITS = CHUNK * VOCAB * F32
GRADS = (TOKENS * HID + VOCAB * HID) * F32  # grad of hidden and of weight


@pytest.mark.parametrize("impl", IMPLS)
def test_linear_cross_entropy_peak_drops_by_full_logits(impl):
    h, w, _, t = _lce_inputs(TOKENS, HID, VOCAB, False, torch.float32)
    plain = peak(lambda: F.cross_entropy(h @ w.T, t))
    h.grad = w.grad = None
    lean = peak(lambda: linear_cross_entropy(h, w, t, chunk_size=CHUNK, impl=impl))
    assert plain >= 2 * LOGITS  # logits + log_softmax (and its gradient)
    assert plain - lean >= LOGITS - CHUNK_LOGITS
    if impl == "chunked":  # grads, one chunk's logits and a chunk-sized temporary
        assert lean <= GRADS + 2 * CHUNK_LOGITS + 64 * 1024


# ------------------------------------------------------------ ChunkedLMHead


def test_chunked_lm_head_ties_and_matches_functional():
    emb = nn.Embedding(100, 8)
    head = ChunkedLMHead(weight=emb.weight, chunk_size=4, impl="chunked")
    assert head.weight is emb.weight and head.bias is None
    own = ChunkedLMHead(8, 100, bias=True, reduction="sum")
    assert own.weight.shape == (100, 8) and own.bias.shape == (100,)
    assert {n for n, _ in own.named_parameters()} == {"weight", "bias"}
    h, t = torch.randn(2, 5, 8), torch.randint(0, 100, (2, 5))
    ref = linear_cross_entropy(h, emb.weight, t, chunk_size=4, impl="chunked")
    assert torch.equal(head(h, t), ref)
    assert head.logits(h).shape == (2, 5, 100)
    assert "vocab_size=100" in repr(head)


@pytest.mark.parametrize(
    "kwargs,exc",
    [(dict(), ValueError), (dict(in_features=4, vocab_size=9, chunk=3), TypeError),
     (dict(in_features=4, vocab_size=9, impl="x"), ValueError)],
)  # fmt: skip
def test_chunked_lm_head_rejects_bad_arguments(kwargs, exc):
    with pytest.raises(exc):
        ChunkedLMHead(**kwargs)


# ------------------------------------------- training a tied-embedding model


def _hidden(model: TinyGPT, tokens: Tensor) -> Tensor:
    x = model.embed(tokens) + model.pos[: tokens.shape[1]]
    for block in model.blocks:
        x = block(x)
    return model.ln_f(x)


def _batches(model: TinyGPT, steps: int) -> list[Tensor]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, model.vocab, (3, model.seq + 1), generator=gen)
        tokens[0, -4:] = -100  # padding in the targets
        out.append(tokens)
    return out


def _plain_loss(model: TinyGPT, tokens: Tensor) -> Tensor:
    logits = model(tokens[:, :-1].clamp_min(0))
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _lean_loss(impl: str):
    def loss(model: TinyGPT, tokens: Tensor) -> Tensor:
        head = ChunkedLMHead(weight=model.embed.weight, chunk_size=7, impl=impl)
        return head(_hidden(model, tokens[:, :-1].clamp_min(0)), tokens[:, 1:])

    return loss


def _train(model, opt, loss_fn, batches, attached: bool) -> None:
    handle = layeropt.attach(model, opt) if attached else None
    for tokens in batches:
        loss_fn(model, tokens).backward()
        if attached:
            assert all(p.grad is None for p in model.parameters())
        opt.step()
        opt.zero_grad()
    if handle is not None:
        handle.remove()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cfg", REPRESENTATIVE, ids=config_id)
def test_attached_optimizer_with_lean_loss_matches_torch_optim_bitwise(impl, cfg):
    """layeropt in backward + lean loss == torch.optim + the same lean loss, bit for bit."""
    opt_name, kw = cfg
    torch.manual_seed(0)
    model = TinyGPT(vocab=96, d=16)
    ref = copy.deepcopy(model)
    batches = _batches(model, 3)
    ref_opt = getattr(torch.optim, opt_name)(ref.parameters(), **kw)
    _train(ref, ref_opt, _lean_loss(impl), batches, attached=False)
    lo_opt = getattr(layeropt, opt_name)(model.parameters(), **kw)
    _train(model, lo_opt, _lean_loss(impl), batches, attached=True)
    assert_same(ref.state_dict(), model.state_dict())


@pytest.mark.parametrize("impl", IMPLS)
def test_attached_sgd_with_lean_loss_matches_plain_torch_training(impl):
    """Lean loss + layeropt.SGD vs full logits + torch.optim.SGD: 5 steps, 2e-6 abs.

    Gradients differ by float reassociation only (<= 1e-6 relative, tested above).
    Adam is checked bitwise against torch.optim with the same loss instead: it
    divides by sqrt(v) + 1e-8, which blows rounding noise on gradients that are
    mathematically zero (the attention key bias) up to lr-sized steps.
    """
    torch.manual_seed(0)
    model = TinyGPT(vocab=96, d=16)
    ref, init = copy.deepcopy(model), copy.deepcopy(model)
    batches = _batches(model, 5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    _train(ref, ref_opt, _plain_loss, batches, attached=False)
    opt = layeropt.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt, _lean_loss(impl), batches, attached=True)
    moved = max((p - q).abs().max().item() for p, q in zip(ref.parameters(), init.parameters()))
    assert moved > 1e-2  # training really changed the weights
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p - q).abs().max().item() <= 2e-6, name  # measured: <= 2.8e-7


# ------------------------------------------------------------ memory table


def _bench_losses():
    """benchmarks/bench_losses.py, which measures the table in docs/losses.md."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "bench_losses.py"
    spec = importlib.util.spec_from_file_location("bench_losses", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_memory_table_rows_and_format():
    bench = _bench_losses()
    rows = bench.memory_table(tiny=True)
    assert len(rows) == 6 + 3 * (2 if NATIVE else 1)
    by_case = {case.split(" vs")[0]: (plain, lean) for case, plain, lean in rows}
    plain, lean = by_case["sum(x*y) broadcast"]
    assert plain - lean >= 64 * 256 * 64 * F32 - 1024
    for case, plain, lean in rows[5:]:
        assert lean < plain, case
    table = bench.format_table(rows)
    assert table.count("\n") == len(rows) + 1 and f"{rows[0][1]:,} B" in table


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_chunked_backward_under_bf16_autocast(label_smoothing):
    """The chunked loss (what impl="auto" picks with label smoothing) under bf16 autocast:
    its backward computes in forward's dtype (it raised: bf16 hidden against an fp32
    weight), and its gradients are the plain logits-then-cross-entropy's under the same
    autocast, to bf16's rounding (the chunks sum in another order)."""
    gen = torch.Generator()
    grads = []
    for chunked in (False, True):
        h = torch.randn(6, 8, generator=gen.manual_seed(1), requires_grad=True)
        w = torch.randn(50, 8, generator=gen.manual_seed(2), requires_grad=True)
        t = torch.randint(0, 50, (6,), generator=gen.manual_seed(3))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = torch.tanh(F.linear(h, torch.eye(8)))
            if chunked:
                loss = linear_cross_entropy(hidden, w, t, label_smoothing=label_smoothing,
                                            impl="chunked", chunk_size=4)
            else:
                loss = F.cross_entropy(F.linear(hidden, w).float(), t,
                                       label_smoothing=label_smoothing)
        loss.float().backward()
        grads.append((h.grad, w.grad))
    for a, b in zip(*grads):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-3)


@pytest.mark.skipif(not hasattr(F, "linear_cross_entropy"), reason="torch's op: 2.13+")
def test_two_passes_through_torchs_op_name_the_chunked_impl():
    """layeropt.backward(max_norm=) runs two passes; torch's linear_cross_entropy (what
    impl="auto" takes) lets its backward run once: the error names impl="chunked", and
    nothing was updated (it was torch's bare "called twice")."""
    torch.manual_seed(0)
    m = nn.Linear(8, 8)
    w = nn.Parameter(torch.randn(50, 8))
    opt = layeropt.AdamW([*m.parameters(), w], lr=1e-2)
    layeropt.attach(nn.ModuleDict({"m": m}), opt)
    before = [p.detach().clone() for p in m.parameters()]
    loss = linear_cross_entropy(m(torch.randn(6, 8)), w, torch.randint(0, 50, (6,)))
    with pytest.raises(layeropt.LayeroptError, match=r"backward run only once.*impl='chunked'"):
        layeropt.backward(loss, max_norm=1.0)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before))
