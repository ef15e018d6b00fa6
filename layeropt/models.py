"""Small built-in models for the demo, the tests and the benchmarks.

Each one exercises a way a gradient can reach a parameter: a plain chain
(:class:`MLP`), skip connections (:class:`UNet`), tied input/output weights
(:class:`TinyGPT`), a module reused in a loop (:class:`LoopNet`), and frozen
parameters plus a branch that never runs (:class:`FrozenBranchNet`).
``make_model(name)`` returns a model and a function producing a batch and loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

__all__ = ["MLP", "UNet", "TinyGPT", "LoopNet", "FrozenBranchNet", "make_model", "MODELS"]


class MLP(nn.Module):
    """A chain of Linear + GELU layers."""

    def __init__(self, d_in: int = 16, hidden: int = 32, depth: int = 3, d_out: int = 4) -> None:
        super().__init__()
        dims = [d_in] + [hidden] * depth
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.head(x)


class UNet(nn.Module):
    """A two-level U-Net: encoder outputs are reused by the decoder (skip connections)."""

    def __init__(self, channels: int = 1, width: int = 8) -> None:
        super().__init__()
        w = width
        self.enc1 = nn.Conv2d(channels, w, 3, padding=1)
        self.enc2 = nn.Conv2d(w, 2 * w, 3, stride=2, padding=1)
        self.mid = nn.Conv2d(2 * w, 2 * w, 3, padding=1)
        self.up = nn.Conv2d(2 * w, 4 * w, 1)  # 4w channels -> pixel shuffle to w
        self.dec1 = nn.Conv2d(2 * w, w, 3, padding=1)  # [upsampled, enc1 skip]
        self.out = nn.Conv2d(w, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        e1 = F.silu(self.enc1(x))
        e2 = F.silu(self.enc2(e1))
        m = F.silu(self.mid(e2)) + e2  # skip around the bottleneck
        u = rearrange(self.up(m), "b (c h2 w2) h w -> b c (h h2) (w w2)", h2=2, w2=2)
        d = F.silu(self.dec1(torch.cat([u, e1], dim=1)))  # skip from enc1
        return self.out(d)


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = rearrange(self.qkv(self.ln1(x)), "b t (n h e) -> n b h t e", n=3, h=self.heads)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(rearrange(a, "b h t e -> b t (h e)"))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A GPT-like causal LM whose output head is tied to the token embedding."""

    def __init__(
        self, vocab: int = 64, d: int = 32, layers: int = 2, heads: int = 2, seq: int = 16
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) / math.sqrt(d))
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.seq = seq
        self.vocab = vocab

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.embed.weight.t()  # tied head


class LoopNet(nn.Module):
    """One extractor applied in a loop (shared by every iteration), then a head."""

    def __init__(self, d: int = 16, steps: int = 3) -> None:
        super().__init__()
        self.extractor = nn.Linear(d, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, 2)
        self.steps = steps

    def forward(self, x: Tensor) -> Tensor:
        h = x
        for _ in range(self.steps):
            h = torch.tanh(self.extractor(h)) + self.mix(x)
        return self.head(h)


class FrozenBranchNet(nn.Module):
    """Frozen layers, a branch never called, and a scale used at both ends."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.frozen = nn.Linear(d, d).requires_grad_(False)
        self.body = nn.Linear(d, d)
        self.unused = nn.Linear(d, d)  # owned by the optimizer, never gets a grad
        self.scale = nn.Parameter(torch.ones(d))
        self.head = nn.Linear(d, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.body(self.frozen(x * self.scale)).relu()
        return self.head(h * self.scale)


def _regression(model: nn.Module, shape: tuple[int, ...], d_out: int | None = None):
    def batch(gen: torch.Generator) -> tuple[Tensor, Tensor]:
        x = torch.randn(*shape, generator=gen)
        out_shape = (shape[0], d_out) if d_out else shape
        return x, torch.randn(*out_shape, generator=gen)

    def loss(m: nn.Module, data: tuple[Tensor, Tensor]) -> Tensor:
        return F.mse_loss(m(data[0]), data[1])

    return batch, loss


def _lm(model: TinyGPT, batch_size: int):
    def batch(gen: torch.Generator) -> Tensor:
        return torch.randint(0, model.vocab, (batch_size, model.seq + 1), generator=gen)

    def loss(m: nn.Module, tokens: Tensor) -> Tensor:
        logits = m(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    return batch, loss


BatchFn = Callable[[torch.Generator], object]
LossFn = Callable[[nn.Module, object], Tensor]


def make_model(name: str, seed: int = 0, **kwargs: int) -> tuple[nn.Module, BatchFn, LossFn]:
    """Build a named model with a batch generator and a loss function.

    Args:
        name: one of :data:`MODELS`.
        seed: seed for the initial weights.
        **kwargs: passed to the model's constructor.

    Returns:
        ``(model, batch_fn, loss_fn)``: ``batch_fn(generator)`` draws a batch and
        ``loss_fn(model, batch)`` computes the scalar loss.
    """
    torch.manual_seed(seed)
    if name == "mlp":
        m = MLP(**kwargs)
        return m, *_regression(m, (4, m.layers[0].in_features), m.head.out_features)
    if name == "unet":
        m = UNet(**kwargs)
        return m, *_regression(m, (2, m.enc1.in_channels, 8, 8))
    if name == "gpt":
        m = TinyGPT(**kwargs)
        return m, *_lm(m, batch_size=2)
    if name == "loop":
        m = LoopNet(**kwargs)
        return m, *_regression(m, (4, m.extractor.in_features), 2)
    if name == "frozen":
        m = FrozenBranchNet(**kwargs)
        return m, *_regression(m, (4, m.body.in_features), 3)
    raise ValueError(f"unknown model {name!r}; choose one of {MODELS}")


MODELS = ("mlp", "unet", "gpt", "loop", "frozen")
