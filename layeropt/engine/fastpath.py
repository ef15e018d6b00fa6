"""Torch's own update functions on argument lists prepared once per bucket.

Why: a bucket step through torch's ``step`` spends most of its host time
around the kernel, not in it. ``step`` rebuilds its argument lists every call
(``_init_group``: a Python loop over the parameters that looks up each one's
state), and that cost is per parameter - as large as the update itself for
small tensors. For a bucket those lists never change between steps: the same
parameters, the same state tensors (updated in place).

What: :class:`FastPath` keeps, per bucket (the exact list of parameters a
step call is given), the lists torch's ``_init_group`` built for it, and on
later calls hands them - with the gradients read afresh - to the same
functional torch's ``step`` calls (``torch.optim.adam.adam``,
``torch.optim.sgd.sgd``), with every hyperparameter read from the param
group at each call, exactly as ``step`` passes them (so an LR scheduler, a
tensor ``lr``, ``GradScaler``'s ``grad_scale`` / ``found_inf`` attributes
work as in torch). Nothing of the update is re-derived here: the functional
chooses the for-loop, foreach or fused implementation as it does for ``step``.

One shortcut, and what it buys: a ``fused=True`` Adam/AdamW bucket that is a
single (device, dtype) group runs the loop body of torch's ``_fused_adam``
itself (step counters, then ``torch._fused_adam_``/``_fused_adamw_``), its
grouping done once; its CPU step counters are incremented in the form torch's
foreach Adam uses (the same float32 ``+ 1``, bit for bit, a third of the
time: torch's fused Adam wraps a Python ``1`` into a tensor once per
counter). On many-small (``benchmarks/bench_step.py --model many-small
--contenders adam-fused layeropt layeropt:0 --rounds 40 --threads 1 --clock
cpu``, 2026-12-04, this machine's CPU) it takes layeropt from 1.09x to 1.04x
of ``torch.optim.Adam(fused=True)`` at the default buckets and from 1.64x to
1.50x at ``bucket_cap_mb=0``; the same two runs without it are the numbers
before the arrow.

Exactness rules:

* state is never created here. A bucket's first call (and any call after an
  invalidation) goes through torch's ``step`` (``layeropt/engine/subset.py``,
  narrowed); :meth:`FastPath.learn` then asks torch's own ``_init_group``
  for the lists, so they are the very objects ``step`` would pass;
* each call checks, before using a bucket's lists, that ``_init_group`` would
  still return them: same ``optimizer.state`` and param-group objects, the
  same group ``params`` lists, the same values of the group options
  ``_init_group`` reads (``amsgrad``, ``fused``, ``capturable``, ...), and for
  every parameter the same state dict holding the same tensors. Anything else
  (``load_state_dict``, ``add_param_group``, a state tensor replaced, an
  option toggled) drops the bucket's lists and the call takes torch's
  ``step``. A parameter's dtype or device (``model.double()``) is not part of
  the lists: they still hold what ``_init_group`` returns, so the functional
  sees exactly what ``step`` would (including torch's error when the state's
  dtype no longer matches);
* only the exact torch classes in :func:`supported`, through layeropt's own
  subclasses: a user subclass may change ``_init_group`` or ``step``, and
  takes the general path.

``FastPath.taken`` counts the calls that took this path (the tests assert it).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from operator import attrgetter, is_
from typing import Any

import torch
from torch import Tensor
from torch.optim import optimizer as _optimizer_module
from torch.optim.optimizer import Optimizer

__all__ = ["FastPath", "fast_path_for", "supported"]

_GRAD = attrgetter("grad")
_set_grad_enabled = torch._C._set_grad_enabled
# The fused loop body is the one of torch versions that have this helper.
_to_scalar = getattr(_optimizer_module, "_to_scalar", None)


def _module(name: str) -> Any:
    """``torch.optim.<name>`` (``torch.optim`` does not expose every submodule)."""
    try:
        return importlib.import_module(f"torch.optim.{name}")
    except ImportError:  # pragma: no cover - an older torch without it
        return None


# The functionals are looked up in their modules at each call, as torch's step does.
_ADAM, _SGD = map(_module, ("adam", "sgd"))
# What torch's step calls first (named _cuda_graph_capture_health_check before torch 2.6).
_health_check = getattr(
    Optimizer, "_accelerator_graph_capture_health_check", None
) or getattr(Optimizer, "_cuda_graph_capture_health_check")
_MAX_ENTRIES = 4096  # buckets remembered per optimizer; all forgotten beyond it


# -- per optimizer kind: how torch's step calls its functional -------------------
# A kind says how one iteration of the torch class's ``step`` loop body after
# ``_init_group`` calls its functional: the same functional, the same arguments,
# read from the same places at each call.


class _Kind:
    """How one torch optimizer class's ``step`` feeds its functional.

    The functional gets ``params, grads, *lists`` and these keywords: each of
    ``keys`` from the param group, ``flag`` = what ``_init_group`` returned,
    ``grad_scale`` / ``found_inf`` from the optimizer's attributes (GradScaler's),
    and with ``betas`` the group's ``betas`` as ``beta1`` / ``beta2``.

    Attributes:
        name: the torch class's name.
        module / functional: ``torch.optim.<module>.<functional>`` (looked up at
            each call, as ``step`` does).
        lists: how many lists ``_init_group`` fills after params and grads.
        options: group keys ``_init_group`` reads (a change rebuilds the lists).
        keys / flag / betas: the keywords, as above.
        health_check: whether ``step`` starts with
            ``_accelerator_graph_capture_health_check()``.
        writeback: ``(list index, state key)`` that ``step`` stores back into the
            state after the functional (SGD's momentum buffers), if any.
    """

    __slots__ = ("name", "module", "functional", "lists", "options", "keys", "flag", "betas",
                 "health_check", "writeback")

    def __init__(self, name: str, module: Any, functional: str, lists: int,
                 options: tuple[str, ...], keys: tuple[str, ...], flag: str, betas: bool,
                 health_check: bool, writeback: tuple[int, str] | None = None) -> None:  # fmt: skip
        self.name, self.module, self.functional, self.lists = name, module, functional, lists
        self.options, self.keys, self.flag, self.betas = options, keys, flag, betas
        self.health_check, self.writeback = health_check, writeback

    def keywords(self) -> set[str]:
        """Every keyword a call passes (checked against torch's functional)."""
        return {*self.keys, self.flag, "grad_scale", "found_inf",
                *(("beta1", "beta2") if self.betas else ())}


_ADAM_OPTIONS = ("amsgrad", "fused", "capturable", "differentiable", "foreach")
_ADAM_KEYS = ("amsgrad", "lr", "weight_decay", "eps", "maximize", "foreach", "capturable",
              "differentiable", "fused", "decoupled_weight_decay")
# (module, class, _init_group's list arguments after params/grads, kind). A kind is
# used only if torch's signatures are the ones it was written for.
_CANDIDATES: list[tuple[str, str, tuple[str, ...], _Kind]] = [
    ("adam", "Adam", ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps"),
     _Kind("Adam", _ADAM, "adam", 4, _ADAM_OPTIONS, _ADAM_KEYS, "has_complex", True, True)),
    ("adamw", "AdamW",  # AdamW is Adam with decoupled_weight_decay=True
     ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps"),
     _Kind("AdamW", _ADAM, "adam", 4, _ADAM_OPTIONS, _ADAM_KEYS, "has_complex", True, True)),
    ("sgd", "SGD", ("momentum_buffer_list",),
     _Kind("SGD", _SGD, "sgd", 1, ("momentum", "fused"),
           ("weight_decay", "momentum", "lr", "dampening", "nesterov", "maximize", "foreach",
            "fused"), "has_sparse_grad", False, False, writeback=(0, "momentum_buffer"))),
]  # fmt: skip


@functools.cache
def supported() -> dict[type, _Kind]:
    """The torch.optim classes the fast path serves, each with its :class:`_Kind`.

    A kind is used only on torch 2.6 and later (what it was written and
    tested for) and only where the installed torch's ``_init_group`` and
    functional have the signatures it was written for; otherwise the
    general path serves every call.

    Returns:
        ``{torch class: kind}``.
    """
    table: dict[type, _Kind] = {}
    if torch.torch_version.TorchVersion(torch.__version__) < (2, 6):
        return table
    for module, cls_name, init_args, kind in _CANDIDATES:
        try:
            cls = getattr(_module(module), cls_name)
            fn = getattr(kind.module, kind.functional)
            init = inspect.signature(cls._init_group).parameters
            call = inspect.signature(fn).parameters
        except (AttributeError, TypeError, ValueError):
            continue  # an older torch without this class or function
        if module == "adamw" and inspect.unwrap(cls.step).__qualname__ != "Adam.step":
            continue  # torch < 2.6: AdamW has its own step and functional (unwrapped: the
            # first AdamW built sets AdamW.step to torch's profiling wrapper of Adam's)
        if tuple(init)[1:] != ("group", "params_with_grad" if cls_name != "SGD" else "params",
                               "grads", *init_args):  # fmt: skip
            continue
        if not kind.keywords() <= set(call):
            continue
        table[cls] = kind
    return table


def fast_path_for(optimizer: Any) -> FastPath | None:
    """A :class:`FastPath` for a layeropt optimizer, or ``None``.

    Args:
        optimizer: the optimizer.

    Returns:
        A new :class:`FastPath` if the optimizer's class is layeropt's
        in-backward variant of a class in :func:`supported` with nothing of its
        own in between (a user subclass may change ``_init_group`` or
        ``step``), else ``None``. Its lists are forgotten whenever the
        optimizer loads a state dict (a load-state-dict post hook), so they
        never keep replaced state tensors alive.
    """
    cls = type(optimizer)
    mro = cls.__mro__
    base = getattr(cls, "_lo_base", None)  # the class in_backward() was given
    kind = supported().get(base) if base is not None else None
    if kind is None:
        return None
    for k in mro[: mro.index(base)]:  # layeropt's generated class and its mixin only
        if vars(k).get("_lo_base") is not base and "_step_params" not in vars(k):
            return None  # a user class between layeropt's and torch's
    fast = FastPath(kind)
    register = getattr(optimizer, "register_load_state_dict_post_hook", None)
    if register is not None:
        register(fast.forget)
    return fast


def _one_group(params: list[Tensor], grads: list[Tensor], lists: list[list[Any]]) -> Any:
    """The device if torch's grouping leaves these lists one group, as they are; else None."""
    if not params:
        return None
    lists_in = [params, grads, *lists]
    grouped = Optimizer._group_tensors_by_device_and_dtype(lists_in)  # type: ignore[arg-type]
    if len(grouped) != 1:
        return None
    ((device, _), (lists_out, _)), = grouped.items()
    for a, b in zip(lists_in, lists_out):
        if len(a) != len(b) or not all(map(is_, a, b)):
            return None
    return device


class _Chunk:
    """One param group's share of a bucket: what ``step``'s loop body gets for it."""

    __slots__ = ("index", "group", "group_params", "group_len", "options", "params", "lists",
                 "flags", "device")  # fmt: skip

    def __init__(self, index: int, group: dict[str, Any], options: tuple[Any, ...],
                 params: list[Tensor], lists: list[list[Any]], flags: Any) -> None:  # fmt: skip
        self.index, self.group, self.options = index, group, options
        self.group_params = group["params"]
        self.group_len = len(self.group_params)
        self.params, self.lists, self.flags = params, lists, flags
        self.device: torch.device | None = None  # set: the fused loop body applies


class _Entry:
    """A bucket's prepared lists and what must still hold for them to be used."""

    __slots__ = ("chunks", "check_params", "check_dicts", "t_dicts", "t_keys", "t_values")

    def __init__(self, chunks: list[_Chunk], state: Any) -> None:
        self.chunks = chunks
        self.check_params: list[Tensor] = []  # parameters whose state dict the lists use
        self.check_dicts: list[dict[str, Any]] = []
        self.t_dicts: list[dict[str, Any]] = []  # (state dict, key, tensor) the lists hold
        self.t_keys: list[str] = []
        self.t_values: list[Tensor] = []
        for c in chunks:
            for i, p in enumerate(c.params):
                d = state.get(p)
                used = False
                for values in c.lists:
                    if i >= len(values) or values[i] is None:
                        continue
                    t = values[i]
                    key = next((k for k, v in (d or {}).items() if v is t), None)
                    if key is None:
                        raise LookupError("a list element is not in the parameter's state")
                    self.t_dicts.append(d)  # type: ignore[arg-type]
                    self.t_keys.append(key)
                    self.t_values.append(t)
                    used = True
                if used:
                    self.check_params.append(p)
                    self.check_dicts.append(d)  # type: ignore[arg-type]


class FastPath:
    """Per-optimizer prepared lists, one entry per bucket (see the module docstring).

    Attributes:
        taken: calls served by the fast path.
        built: entries built (a bucket's first call, or after an invalidation).
        dropped: entries found invalid and dropped.
    """

    def __init__(self, kind: _Kind) -> None:
        self.kind = kind
        self.taken = 0
        self.built = 0
        self.dropped = 0
        self._entries: dict[tuple[int, ...], _Entry] = {}
        self._state: Any = None  # the optimizer.state / param_groups the entries belong to
        self._groups: Any = None
        self._ngroups = -1

    def _current(self, optimizer: Any) -> bool:
        """Whether the entries belong to the optimizer's present state and groups.

        If not, they are all dropped (they would hold the old state's tensors)
        and the present objects recorded.
        """
        groups = optimizer.param_groups
        if (
            optimizer.state is self._state
            and groups is self._groups
            and len(groups) == self._ngroups
        ):
            return True
        if self._entries:
            self.dropped += len(self._entries)
            self._entries = {}
        self._state, self._groups, self._ngroups = optimizer.state, groups, len(groups)
        return False

    def step(self, optimizer: Any, params: list[Tensor]) -> bool:
        """Update ``params`` with torch's functional on their prepared lists, if valid.

        Args:
            optimizer: the layeropt optimizer (a class this path serves).
            params: the parameters of one step call, each holding a dense ``.grad``.

        Returns:
            ``True`` if they were updated; ``False`` if the bucket has no valid
            lists (nothing was touched: take torch's ``step``, then :meth:`learn`).
        """
        # Runs once per bucket, often with caches cold from backward: few Python steps.
        state, groups = optimizer.state, optimizer.param_groups
        if state is not self._state or groups is not self._groups or len(groups) != self._ngroups:
            self._current(optimizer)
            return False
        key = tuple(map(id, params))
        entry = self._entries.get(key)
        if entry is None:
            return False
        options = self.kind.options
        for c in entry.chunks:  # the lists _init_group would build from these groups
            g = c.group
            if (
                groups[c.index] is not g
                or g["params"] is not c.group_params
                or len(c.group_params) != c.group_len
                or tuple(map(g.get, options)) != c.options
            ):
                return self._drop(key)
        if not (  # each parameter's state dict, holding the same tensors
            all(map(is_, map(state.get, entry.check_params), entry.check_dicts))
            and all(map(is_, map(dict.get, entry.t_dicts, entry.t_keys), entry.t_values))
        ):
            return self._drop(key)
        if self.kind.health_check:
            _health_check(optimizer)
        grad_mode = torch.is_grad_enabled()
        if grad_mode:  # torch's step updates under no_grad (torch.no_grad() costs more)
            _set_grad_enabled(False)
        kind = self.kind
        try:
            for c in entry.chunks:
                g = c.group
                device = c.device
                if device is not None:  # _fused_adam's loop body for its one group
                    exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = c.lists
                    beta1, beta2 = g["betas"]
                    lr = g["lr"]
                    scale = getattr(optimizer, "grad_scale", None)
                    found_inf = getattr(optimizer, "found_inf", None)
                    if scale is not None:
                        scale = scale.to(device, non_blocking=True)
                    if found_inf is not None:
                        found_inf = found_inf.to(device, non_blocking=True)
                    if isinstance(lr, Tensor) and str(lr.device) != "cpu" and lr.device != device:
                        lr = lr.to(device=device, non_blocking=True)
                    if device.type == "cpu":  # foreach Adam's form: the same + 1, faster
                        torch._foreach_add_(steps, torch.tensor(1.0, device="cpu"), alpha=1.0)
                    else:
                        torch._foreach_add_(steps, 1)
                    kernel = torch._fused_adamw_ if g["decoupled_weight_decay"] \
                        else torch._fused_adam_
                    kernel(
                        c.params, list(map(_GRAD, c.params)), exp_avgs, exp_avg_sqs,
                        max_exp_avg_sqs, steps, amsgrad=g["amsgrad"], lr=lr,
                        beta1=_to_scalar(beta1), beta2=_to_scalar(beta2),
                        weight_decay=g["weight_decay"], eps=g["eps"], maximize=g["maximize"],
                        grad_scale=scale, found_inf=found_inf,
                    )  # fmt: skip
                    if found_inf is not None:
                        torch._foreach_sub_(steps, [found_inf] * len(steps))
                    continue
                keywords = dict(zip(kind.keys, map(g.__getitem__, kind.keys)))
                keywords[kind.flag] = c.flags
                keywords["grad_scale"] = getattr(optimizer, "grad_scale", None)
                keywords["found_inf"] = getattr(optimizer, "found_inf", None)
                if kind.betas:
                    keywords["beta1"], keywords["beta2"] = g["betas"]
                lists = list(map(list, c.lists))  # the functional may write into them
                getattr(kind.module, kind.functional)(
                    c.params, list(map(_GRAD, c.params)), *lists, **keywords)
                if kind.writeback is not None and c.group["momentum"] != 0:
                    self._write_back(optimizer, c, lists, key)
        finally:
            if grad_mode:
                _set_grad_enabled(True)
        self.taken += 1
        return True

    def forget(self, optimizer: Any = None) -> None:
        """Drop every entry (also the optimizer's load-state-dict post hook).

        Args:
            optimizer: ignored (the hook's argument).

        Returns:
            None.
        """
        self.dropped += len(self._entries)
        self._entries = {}
        self._state = self._groups = None
        self._ngroups = -1

    def _drop(self, key: tuple[int, ...]) -> bool:
        del self._entries[key]
        self.dropped += 1
        return False

    def _write_back(self, optimizer: Any, c: _Chunk, lists: list[list[Any]],
                    key: tuple[int, ...]) -> None:
        """As ``step``: store into the state what the functional made (SGD's momentum
        buffers, made at its first call with momentum)."""
        index, skey = self.kind.writeback  # type: ignore[misc]
        new, old = lists[index], c.lists[index]
        if not all(map(is_, new, old)):
            state = optimizer.state
            for p, value in zip(c.params, new):
                state[p][skey] = value
            self._entries.pop(key, None)

    def learn(
        self, optimizer: Any, params: list[Tensor], order: list[int], members: list[list[Tensor]]
    ) -> None:
        """Remember the lists torch's ``_init_group`` gives for a call just stepped.

        Called right after torch's ``step`` updated these parameters (their
        gradients still set), so their state exists and ``_init_group``
        only collects it.

        Args:
            optimizer: the optimizer.
            params: the call's parameters, as :meth:`step` will be given them.
            order: indices of the param groups the call touched, ascending.
            members: the call's parameters in each of those groups.

        Returns:
            None. A call whose lists cannot be checked is not remembered.
        """
        self._current(optimizer)
        if len(self._entries) >= _MAX_ENTRIES:
            self.dropped += len(self._entries)
            self._entries = {}
        kind = self.kind
        groups = optimizer.param_groups
        chunks = []
        for i, ps in zip(order, members):
            g = groups[i]
            if any(p.grad is None for p in ps):
                return
            got: list[Tensor] = []
            grads: list[Tensor] = []
            lists: list[list[Any]] = [[] for _ in range(kind.lists)]
            try:
                with torch.no_grad():
                    flags = optimizer._init_group({**g, "params": ps}, got, grads, *lists)
            except Exception:  # noqa: BLE001 - torch's step just ran this; leave it to step
                return
            if len(got) != len(ps) or not all(map(is_, got, ps)):
                return
            chunk = _Chunk(i, g, tuple(map(g.get, kind.options)), list(ps), lists, flags)
            if (kind.functional == "adam" and _to_scalar is not None and g["fused"]
                    and not g["differentiable"]):
                chunk.device = _one_group(ps, grads, lists)  # (fused Adam, as one group)
            chunks.append(chunk)
        try:
            entry = _Entry(chunks, optimizer.state)
        except LookupError:
            return
        self._entries[tuple(map(id, params))] = entry
        self.built += 1

