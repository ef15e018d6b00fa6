"""What a plan trains: a model, its inputs, its loss, and how to checkpoint it.

A :class:`Workload` is built inside ``FakeTensorMode``, so every function in it
makes fake tensors: no memory, any size. :func:`hf_workload` makes one from a
Hugging Face causal-LM config - a ``config.json``, a directory holding one, a
model name whose config is in the local Hugging Face cache, or one of the
public shapes in :data:`BUILTIN_SHAPES` (nothing is downloaded).

Example:
    >>> sorted(BUILTIN_SHAPES)[:3]
    ['gpt2', 'gpt2-large', 'gpt2-medium']
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import os
import re
import shutil
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import LayeroptError

__all__ = ["Workload", "PlanError", "BUILTIN_SHAPES", "ATTENTION", "hf_workload", "load_config"]


class PlanError(LayeroptError, ValueError):
    """A plan cannot be made as asked (see the message for the fix)."""


@dataclasses.dataclass
class Workload:
    """One training step to simulate, as functions run on fake tensors.

    Attributes:
        name: what to call the model in the report.
        build: ``() -> nn.Module``, the model (built under ``FakeTensorMode``).
        inputs: ``(model) -> batch``, one batch.
        loss: ``(model, batch) -> Tensor``, the scalar loss.
        checkpoint: ``(model) -> undo``: turns activation checkpointing on
            and returns a callable that turns it off; ``None``: no
            checkpointing variants.
        chunked_loss: ``(model, batch) -> Tensor``, the same loss computed
            without full logits (:func:`layeropt.losses.linear_cross_entropy`);
            ``None`` where it does not apply.
        description: a short line about the shape (for the report).
        seq: tokens per sequence, for language models (for the report).
        batch: sequences per batch, for language models (for the report).
        attention: a Hugging Face model's attention implementation (``"sdpa"``
            or ``"eager"``; for the report), ``None`` for other models.
    """

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[nn.Module], Any]
    loss: Callable[[nn.Module, Any], Tensor]
    checkpoint: Callable[[nn.Module], Callable[[], None]] | None = None
    chunked_loss: Callable[[nn.Module, Any], Tensor] | None = None
    description: str = ""
    seq: int | None = None
    batch: int | None = None
    attention: str | None = None


#: The attention implementations a Hugging Face model is planned with: ``sdpa``
#: (a GPU's flash attention modelled on the ``"cuda"`` target) and ``eager`` (the
#: model's own matmuls and softmax, the scores of a whole sequence alive).
ATTENTION = ("sdpa", "eager")

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

#: Public model shapes, as the ``config.json`` fields that set memory.
BUILTIN_SHAPES: dict[str, dict[str, Any]] = {
    "llama-2-7b": dict(
        model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "llama-2-13b": dict(
        model_type="llama", vocab_size=32000, hidden_size=5120, intermediate_size=13824,
        num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
        max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "llama-3.2-1b": dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE, tie_word_embeddings=True,
    ),
    "llama-3.2-3b": dict(
        model_type="llama", vocab_size=128256, hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE, tie_word_embeddings=True,
    ),
    "llama-3.1-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(_LLAMA3_ROPE, factor=8.0), tie_word_embeddings=False,
    ),
    "gpt2": dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=768,
                 n_layer=12, n_head=12),
    "gpt2-medium": dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=1024,
                        n_layer=24, n_head=16),
    "gpt2-large": dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=1280,
                       n_layer=36, n_head=20),
    "gpt2-xl": dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=1600,
                    n_layer=48, n_head=25),
}  # fmt: skip


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise PlanError(
            "planning a Hugging Face model needs transformers: pip install 'layeropt[hf]' "
            "(or pip install transformers), or pass a model factory to layeropt.plan.plan()."
        ) from e
    return transformers


def load_config(model: str | os.PathLike[str] | Any) -> tuple[str, Any]:
    """Find a Hugging Face config without downloading anything.

    Args:
        model: a ``config.json`` path, a directory holding one, a name in
            :data:`BUILTIN_SHAPES`, a model name whose config is in the local
            Hugging Face cache (``"meta-llama/Llama-3.2-1B"``), or a
            ``transformers`` config object.

    Returns:
        ``(name, config)``: a config file's model is named by its
        ``_name_or_path`` (or ``model_type``) and the file's path.

    Raises:
        PlanError: none of these (the message says what was tried, the
            nearest built-in name and how to get a config.json).

    Example:
        >>> name, config = load_config("gpt2")  # doctest: +SKIP
        >>> config.n_layer  # doctest: +SKIP
        12
    """
    transformers = _transformers()
    if isinstance(model, transformers.PretrainedConfig):
        name = getattr(model, "name_or_path", "") or type(model).__name__
        return name, copy.deepcopy(model)
    text = os.fspath(model)
    path = text
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise PlanError(f"directory {text!r} holds no config.json; pass the config file itself")
    if os.path.isfile(path):
        label, config = _from_json(path)
        return f"{label} from {os.path.normpath(path)}", config
    if text.lower() in BUILTIN_SHAPES:
        fields = dict(BUILTIN_SHAPES[text.lower()])
        return text.lower(), transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    if text.endswith(".json"):
        raise PlanError(f"config file {text!r} does not exist")
    try:
        config = transformers.AutoConfig.from_pretrained(text, local_files_only=True)
    except OSError:  # not in the local cache, or not a repository id at all
        raise _not_found(text) from None
    except (ValueError, KeyError) as e:  # in the cache, but transformers cannot read it
        raise PlanError(
            f"the cached config of {text!r} cannot be read by transformers "
            f"{transformers.__version__}: {e}; upgrade transformers or pass a model factory"
        ) from None
    return text, config


#: A Hugging Face repository id: ``owner/name`` (what ``hf download`` takes).
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def _not_found(text: str) -> PlanError:
    """What was tried, the nearest built-in shape, and only commands that can work."""
    looks_like_path = text.startswith((".", "/", "~")) or (
        os.sep in text and not _REPO_ID.fullmatch(text)
    )
    if looks_like_path:
        return PlanError(
            f"{text!r}: no such file or directory; pass the path of a config.json, or of "
            "the folder holding one"
        )
    close = difflib.get_close_matches(text.lower(), BUILTIN_SHAPES, n=1) or (
        difflib.get_close_matches(text.lower().rpartition("/")[2], BUILTIN_SHAPES, n=1)
    )
    if close:
        nearest = (f"Did you mean the built-in shape {close[0]!r} "
                   f"(`python -m layeropt plan {close[0]}`)? ")  # fmt: skip
    else:
        nearest = f"Built-in shapes: {', '.join(sorted(BUILTIN_SHAPES))}. "
    if _REPO_ID.fullmatch(text):
        command = next((c for c in ("hf", "huggingface-cli") if shutil.which(c)), None)
        if command is not None:
            login = "hf auth login" if command == "hf" else "huggingface-cli login"
            fetch = (f"If {text} is a Hugging Face repository, `{command} download {text} "
                     f"config.json` puts its config in the cache (a few KiB; a gated model "
                     f"needs `{login}` first); then plan it again. ")  # fmt: skip
        else:
            fetch = (f"If {text} is a Hugging Face repository, its config is at "
                     f"https://huggingface.co/{text}/resolve/main/config.json. ")  # fmt: skip
    else:
        fetch = ("A Hugging Face model is named by its repository id, owner/name "
                 "(meta-llama/Llama-2-7b-hf). ")  # fmt: skip
    return PlanError(
        f"{text!r} is not a config.json, a directory holding one, a built-in shape or a "
        f"model whose config is in the local Hugging Face cache. {nearest}{fetch}"
        "Offline, pass the path of a config.json (or of the folder holding it): "
        "`python -m layeropt plan path/to/config.json`."
    )


def _from_json(path: str) -> tuple[str, Any]:
    """``(label, config)``: the label is the config's ``_name_or_path`` or ``model_type``."""
    transformers = _transformers()
    try:
        with open(path) as f:
            fields = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"cannot read {path!r} as JSON: {e}") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise PlanError(
            f"{path!r} has no \"model_type\": it is not a Hugging Face config.json"
        )
    model_type = fields.pop("model_type")
    label = fields.get("_name_or_path") or model_type
    try:
        return label, transformers.AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError) as e:
        raise PlanError(
            f"transformers {transformers.__version__} does not know model_type "
            f"{model_type!r} (from {path!r}): upgrade transformers or pass a model factory"
        ) from e


def hf_workload(
    model: str | os.PathLike[str] | Any,
    *,
    seq: int | None = None,
    batch: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    max_positions: int | None = None,
    attention: str = "sdpa",
    chunked_impl: str = "auto",
) -> Workload:
    """A :class:`Workload` for a Hugging Face causal LM: ``model(input_ids=ids, labels=ids).loss``.

    Args:
        model: anything :func:`load_config` takes.
        seq: tokens per sequence (default 2048, or the model's positions if
            fewer).
        batch: sequences per batch.
        dtype: the dtype of the parameters (pure ``bfloat16`` or ``float32``
            training; no autocast).
        max_positions: the model's positions (``max_position_embeddings``
            or ``n_positions``), replacing the config's: to plan a ``seq``
            longer than the config allows (learned position embeddings grow).
        attention: ``"sdpa"`` (default) or ``"eager"`` (:data:`ATTENTION`): the
            ``attn_implementation`` the model is built with.
        chunked_impl: the chunked loss's ``impl`` (:func:`~layeropt.losses.linear_cross_entropy`):
            ``"chunked"`` where its backward runs twice (``layeropt.backward``'s
            clipping; torch's own op runs it once).

    Returns:
        The workload: attention through ``attention``, ``use_cache=False``,
        checkpointing with ``use_reentrant=False``, and a chunked-loss variant
        when the output layer is an ``nn.Linear``.
    """
    if attention not in ATTENTION:
        raise PlanError(f"attention must be one of {', '.join(ATTENTION)}, got {attention!r}")
    transformers = _transformers()
    name, config = load_config(model)
    config.use_cache = False
    key = next((k for k in ("n_positions", "max_position_embeddings") if getattr(config, k, None)),
               None)  # fmt: skip
    if max_positions is not None:
        if key is None:
            raise PlanError(f"--max-positions: {name}'s config sets no positions; leave it out")
        if max_positions < 1:
            raise PlanError(f"--max-positions must be >= 1, got {max_positions}")
        setattr(config, key, max_positions)
    limit = getattr(config, key) if key else None
    if seq is None:
        seq = min(2048, limit or 2048)
    if limit is not None and seq > limit:
        raise PlanError(
            f"--seq {seq} is longer than the {limit} positions of {name} ({key} in its "
            f"config): plan --seq {limit} or less, or add --max-positions {seq} to plan it "
            f"with {seq} positions (max_positions= in Python)"
        )
    if not (seq >= 1 and batch >= 1):
        raise PlanError(f"seq and batch must be >= 1, got seq={seq}, batch={batch}")
    vocab = config.vocab_size

    def build() -> nn.Module:
        try:
            m = transformers.AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation=attention
            )
        except ValueError as e:
            raise PlanError(
                f"{name} ({type(config).__name__}) is not a causal LM transformers can build "
                f"with {attention} attention: {e}"
            ) from e
        return m.train()

    def inputs(m: nn.Module) -> Tensor:
        return torch.randint(0, vocab, (batch, seq))

    def loss(m: nn.Module, ids: Tensor) -> Tensor:
        return m(input_ids=ids, labels=ids).loss

    def checkpoint(m: nn.Module) -> Callable[[], None]:
        kwargs = {"use_reentrant": False}
        if hasattr(m, "activation_checkpointing_enable"):
            m.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            return m.activation_checkpointing_disable
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return m.gradient_checkpointing_disable

    def chunked(m: nn.Module, ids: Tensor) -> Tensor:
        from ..losses import linear_cross_entropy

        base = getattr(m, m.base_model_prefix)
        hidden = base(input_ids=ids).last_hidden_state
        head = m.get_output_embeddings()
        targets = F.pad(ids[:, 1:], (0, 1), value=-100)  # HF's shift, last position ignored
        return linear_cross_entropy(hidden, head.weight, targets, head.bias, impl=chunked_impl)

    return Workload(
        name=name,
        seq=seq,
        batch=batch,
        build=build,
        inputs=inputs,
        loss=loss,
        checkpoint=checkpoint,
        chunked_loss=chunked if _plain_head(config) else None,
        description=type(config).__name__,
        attention=attention,
    )


def _plain_head(config: Any) -> bool:
    """Whether the loss is cross-entropy of a plain linear head (chunking applies)."""
    return not any(
        getattr(config, k, None) for k in ("final_logit_softcapping", "logit_scale")
    )
