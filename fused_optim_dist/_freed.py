"""What ``.grad`` holds once its gradient was stepped in backward: a freed gradient.

[Note: freed gradients]
A plain optimizer leaves each gradient on its parameter until ``zero_grad()``, and loops rely
on it: they read it between backward and ``step()`` (``clip_grad_norm_(model.parameters())``,
``GradScaler.unscale_``, gradient logging), zero it in place (``model.zero_grad(
set_to_none=False)``), or never zero it, so that the next backward adds to it and ``step()``
steps the sum. Here each gradient is stepped and freed in backward; with ``.grad`` left
``None`` every one of those loops ran on and trained differently in silence (the clip clipped
nothing and returned 0; a kept zero gradient, which the plain optimizer steps, was not stepped;
nothing was summed).

So a stepped parameter's ``.grad`` holds a ``FreedGradient`` instead, until ``zero_grad()``
(ours or the module's, ``set_to_none=True``) drops it as any gradient, or ours with
``set_to_none=False`` puts a zero gradient in its place (see [Note: gradients kept as zeros]):
a tensor with the gradient's shape, dtype and device but no storage (a DTensor wrapping one,
for a DTensor parameter), which raises, naming the fix, on any operation that would read it,
zero it, or add to it. The next backward adds to it if nothing dropped it (autograd's
``AccumulateGrad`` runs ``grad += new``, FSDP2's reduce-scatter ``grad._local_tensor += new``):
that raises there, before the parameter moves, as a second gradient (no ``step()`` since), or
as a gradient never zeroed since ``step()``. Conversions (``Module.to`` converting the
gradients) give another freed gradient. Checks of ``p.grad is None`` see a gradient: it is one,
as far as the plain loop is concerned; ``is_freed`` tells the two apart. ``step()`` reads them
too: a parameter updated in backward whose freed gradient is gone by ``step()`` had its
gradient dropped (``model.zero_grad()`` between backward and ``step()``, where the plain
optimizer steps nothing), and freed gradients still in place at a ``step()`` with no backward
since the last would be stepped a second time by the plain optimizer: both raise.

One freed gradient per parameter, made at its first release and reused while the ``.grad``
setter accepts it (same dtype, device and size): a backward allocates nothing for them. It
names its parameter by ``id``, never by a weak reference: ``torch.utils.swap_tensors`` refuses
a tensor that has one, and with it ``Module.to()`` of DTensor parameters (FSDP2's, tensor
parallel ones) and every conversion under
``torch.__future__.set_swap_module_params_on_conversion(True)``. The optimizer, which holds its
parameters, tells which one an id is.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NoReturn

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from fused_optim_dist._torch_internals import current_backward_id, impl_address

__all__ = [
    "FreedGradient",
    "FreedGradients",
    "freed_hidden",
    "is_freed",
    "keep_as_zeros",
    "refuse_freed",
]

_aten = torch.ops.aten
# In-place or out-of-place addition: how the next backward accumulates into a gradient.
_ACCUMULATING = {_aten.add_.Tensor, _aten.add.Tensor}
_ZEROING = {_aten.zero_.default, _aten._foreach_zero_.default}
# Metadata-preserving copies that give another freed gradient (Module.to, detach()).
_CONVERTING = {_aten._to_copy.default, _aten.detach.default}
_UNSCALING = _aten._amp_foreach_non_finite_check_and_unscale_.default

Refusal = Callable[[int, str, Any], NoReturn]
"""``(param_id, operation, func)``: raise for ``operation`` (``"accumulate"``, ``"zero"`` or
``"read"``, by ``func``) on the freed gradient of the parameter whose ``id`` is ``param_id``."""


class FreedGradient(torch.Tensor):
    """The place of a gradient stepped in backward: shape, dtype and device, no storage. Any
    operation on it raises. See [Note: freed gradients]."""

    _param_id: int
    _refuse: Refusal

    @staticmethod
    def __new__(
        cls,
        like: torch.Tensor,
        param_id: int,
        refuse: Refusal,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> FreedGradient:
        """Shaped like ``like``, with ``dtype`` and ``device`` if given, else ``like``'s."""
        made = torch.Tensor._make_wrapper_subclass(
            cls,
            like.shape,
            strides=like.stride(),
            dtype=dtype or like.dtype,
            device=device or like.device,
        )
        made._param_id = param_id
        made._refuse = refuse
        return made

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        freed = next(a for a in tree_leaves((args, kwargs)) if isinstance(a, FreedGradient))
        if func in _CONVERTING:
            kwargs = kwargs or {}
            return FreedGradient(
                freed,
                freed._param_id,
                freed._refuse,
                dtype=kwargs.get("dtype"),
                device=kwargs.get("device"),
            )
        if func in _ACCUMULATING and args and args[0] is freed and current_backward_id() != -1:
            # Autograd adds a new gradient to the held one as ``held + new`` (in place or
            # not), inside a backward; ``param.add_(grad)`` (another optimizer's step) only
            # reads it, and so does an addition outside a backward (the loop's own: noise
            # added to the gradients between backward and step()).
            operation = "accumulate"
        elif func in _ZEROING:
            operation = "zero"
        else:
            operation = "read"
        freed._refuse(freed._param_id, operation, func)

    def untyped_storage(self) -> torch.UntypedStorage:
        """An empty storage: a freed gradient holds no memory, and memory trackers
        (``FSDPMemTracker``) that read its storage count none."""
        return torch.UntypedStorage(0, device=self.device)

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"FreedGradient(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"device={self.device}: stepped in backward and freed)"
        )


def is_freed(grad: torch.Tensor | None) -> bool:
    """Whether ``grad`` (a parameter's ``.grad``) is a gradient stepped in backward and freed.
    See [Note: freed gradients]."""
    if isinstance(grad, DTensor):
        grad = grad._local_tensor
    return type(grad) is FreedGradient


def refuse_freed(param: torch.Tensor | None, operation: str, func: Any) -> NoReturn:
    """Raise for ``operation`` on a freed gradient, naming the fix; the protocol's own cases
    (a second gradient before ``step()``) are the optimizer's, checked before this."""
    what = "a parameter" if param is None else f"a parameter of shape {tuple(param.shape)}"
    if operation == "accumulate":
        raise RuntimeError(
            f"{what} received a gradient, but its gradient from before the last step() was "
            "never dropped (no zero_grad() since): a plain optimizer would add the two, and "
            "step the sum at its next step() unless a zero_grad() drops it first. "
            "OptimizerInBackward stepped that gradient in backward and freed it, so it stops "
            "here, before this parameter moves. Call optim.zero_grad() (or "
            "model.zero_grad()) after each step(); to sum gradients over several backwards "
            "on purpose, run all but the last under `with optim.accumulate():`. If this "
            "backward's gradients must not reach these parameters at all (an actor's loss "
            "through a critic the critic's optimizer steps), freeze them around it "
            "(requires_grad_(False)) or pass backward(inputs=...) the parameters it trains."
        )
    if operation == "zero":
        raise RuntimeError(
            f"{what}: its gradient was stepped in backward and freed by "
            "OptimizerInBackward, and holds no memory to zero in place "
            "(model.zero_grad(set_to_none=False) or .grad.zero_()), where a plain optimizer "
            "keeps a zero gradient that it steps even when the next backward gives the "
            "parameter none. Call optim.zero_grad(set_to_none=False), which puts a zero "
            "gradient in its place, or optim.zero_grad() or model.zero_grad() "
            "(set_to_none=True, torch's default) instead."
        )
    if func is _UNSCALING:
        raise RuntimeError(
            "torch.amp.GradScaler.unscale_ cannot unscale gradients OptimizerInBackward "
            "already stepped in backward. Train with bf16 autocast, which needs no loss "
            "scaling, and skip_nonfinite=True; or use the plain optimizer with GradScaler."
        )
    raise RuntimeError(
        f"{what}: its gradient was stepped in backward and freed by OptimizerInBackward, "
        f"so {func} cannot use it (a plain optimizer would keep it until zero_grad()). "
        "Clip with max_grad_norm= (or clip_grad_value=) on the optimizer "
        "(torch.nn.utils.clip_grad_norm_ or clip_grad_value_ over the model would clip "
        "nothing here) and read the norm with optim.grad_norm() or "
        "fused_optim_dist.training.clip_grad_norm_(optim, max_norm); in Hugging Face Trainer "
        "use fused_optim_dist.integrations.transformers.in_backward_trainer, in accelerate "
        "fused_optim_dist.integrations.accelerate. To change gradients before their update "
        "(noise, masks, scaling), register a hook on the parameter (param.register_hook), "
        "which runs before the gradient is accumulated and stepped. To inspect gradients, "
        "run the backward under `with optim.accumulate():` and read them before the step's "
        "last backward; call zero_grad() to drop freed gradients. Another optimizer cannot "
        "step parameters this one steps in backward: give each optimizer its own parameters."
    )


class FreedGradients:
    """Puts freed gradients on stepped parameters, each made once and reused. See [Note:
    freed gradients].

    Args:
        refuse: what a freed gradient calls to raise (the optimizer's: it knows whether the
            parameter is waiting for ``step()``).
    """

    __slots__ = ("_committed", "_made", "_refuse", "_since_step")

    def __init__(self, refuse: Refusal) -> None:
        self._refuse = refuse
        # id(param) -> (the address of its TensorImpl, its freed gradient); the address tells
        # most recycled ids apart, and a parameter given another TensorImpl by swap_tensors.
        self._made: dict[int, tuple[int, torch.Tensor]] = {}
        # The ids given a freed gradient since the last step(), and those given one before it
        # that may still hold it (no zero_grad() of ours since). See [Note: gradients a step()
        # already committed].
        self._since_step: set[int] = set()
        self._committed: set[int] = set()

    def put(self, params: Iterable[torch.Tensor]) -> None:
        """Set each parameter's ``.grad`` to its freed gradient."""
        with torch._C.DisableTorchFunctionSubclass():
            for param in params:
                self._since_step.add(id(param))
                made = self._made.get(id(param))
                if made is None or made[0] != impl_address(param):
                    made = self._made[id(param)] = self._make(param)
                try:
                    param.grad = made[1]
                except RuntimeError:
                    # The .grad setter checks dtype, device and size: the parameter changed
                    # since (Module.to, a reassigned .data).
                    made = self._made[id(param)] = self._make(param)
                    param.grad = made[1]

    def stepped(self) -> None:
        """``step()`` committed the updates whose freed gradients were put since the last."""
        self._committed |= self._since_step
        self._since_step = set()

    def cleared(self) -> None:
        """``zero_grad()`` dropped every freed gradient (or made it a zero gradient)."""
        self._committed.clear()
        self._since_step.clear()

    def committed(self, *params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """Those of ``params`` (one or more iterables of them) still holding the freed
        gradient of an update that an earlier ``step()`` committed, not given it again since.

        [Note: gradients a step() already committed]
        A plain optimizer steps every gradient its parameters hold at ``step()``, however
        old: a loop that calls ``zero_grad()`` once per iteration but ``step()`` twice (one
        optimizer over an actor and a critic, the critic's loss stepped, then the actor's,
        whose backward reaches the actor only) steps the critic's gradient a second time at
        the second ``step()``. Here it was stepped once, in backward, and freed; the next
        backward to step finds it still in place, and the optimizer refuses there, before
        anything moves (the second ``step()`` went through before, the critic 3.7e-2 from
        the plain loop after four iterations, no error). A backward that adds to such a
        gradient is refused by the gradient itself; a ``step()`` with no backward since the
        last, or after backwards under ``accumulate()`` only (which step nothing), by
        ``step()``. Only the parameters given a freed gradient before the last ``step()``
        and not dropped by a ``zero_grad()`` of this optimizer are read: none in the loop
        that zeroes through the optimizer; after a module's ``zero_grad()``, each once."""
        if not self._committed:
            return []
        with torch._C.DisableTorchFunctionSubclass():
            held = [
                param
                for param in itertools.chain(*params)
                if id(param) in self._committed
                and id(param) not in self._since_step
                and _holds_own_freed(param, param.grad)
            ]
        self._committed = {id(param) for param in held}
        return held

    def dropped(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """Those of ``params``, each given its freed gradient, whose ``.grad`` no longer holds
        it (dropped by ``model.zero_grad()``, or replaced, also through ``.grad.data =``). A
        copy of it (``p.grad = p.grad.detach()``, a conversion) still holds it."""
        with torch._C.DisableTorchFunctionSubclass():
            return [param for param in params if not _holds_own_freed(param, param.grad)]

    def _make(self, param: torch.Tensor) -> tuple[int, torch.Tensor]:
        if isinstance(param, DTensor):
            local = FreedGradient(param._local_tensor, id(param), self._refuse)
            return impl_address(param), DTensor(local, param._spec, requires_grad=False)
        return impl_address(param), FreedGradient(param, id(param), self._refuse)


def _holds_own_freed(param: torch.Tensor, grad: torch.Tensor | None) -> bool:
    """Whether ``grad`` is a freed gradient of ``param`` (the one made for it, or a copy) that
    holds no values: ``grad.data = values`` (``Tensor.set_data``, which no dispatch sees)
    gives the object its storage, and so a nonzero address."""
    local = grad._local_tensor if isinstance(grad, DTensor) else grad
    return (
        type(local) is FreedGradient
        and local._param_id == id(param)
        and torch.Tensor.data_ptr(local) == 0
    )


def keep_as_zeros(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """For ``zero_grad(set_to_none=False)``: give each of ``params`` whose ``.grad`` (in
    ``grads``) is a freed one a new gradient, uninitialised (the caller zeroes it with the
    others), shaped and placed like the parameter.

    [Note: gradients kept as zeros]
    The plain ``zero_grad(set_to_none=False)`` keeps every gradient it holds, as zeros, and its
    next ``step()`` steps each of them, gradient or not: a parameter that gets no gradient in
    the backward between (a branch not taken, an unrouted expert) is stepped with zeros, which
    still moves it under weight decay, momentum or Adam's moments. So a freed gradient becomes
    a real zero gradient here too, holding the memory the plain loop holds until the
    parameter is stepped. The next backward adds into it, as autograd (or FSDP2's
    reduce-scatter) adds into the plain loop's, and the bucket steps the sum; a parameter it
    does not reach still holds its zeros when the backward ends, where every trainable
    parameter holding a gradient is stepped, in that backward's pass (its norm, its
    clipping); ``step()`` with no backward steps them all. What the loop does with them in
    between (``model.zero_grad()``, ``p.grad = None``, the parameter removed from
    ``param_groups``) it does to real gradients, as in the plain loop: no bookkeeping of its
    own can go stale. A frozen parameter holding its zeros (a layer frozen after training) is
    refused where the next stepping backward starts: the plain optimizer steps it, this one
    steps trainable parameters only. A module's ``zero_grad(set_to_none=False)`` meets the
    freed gradients and is refused (see [Note: freed gradients])."""
    with torch._C.DisableTorchFunctionSubclass():
        for param, grad in zip(params, grads, strict=True):
            if grad is not None and is_freed(grad):
                if isinstance(param, DTensor):
                    local = torch.empty_like(param._local_tensor)
                    param.grad = DTensor(local, param._spec, requires_grad=False)
                else:
                    param.grad = torch.empty_like(param)


@contextlib.contextmanager
def freed_hidden(params: Sequence[torch.Tensor]) -> Iterator[None]:
    """Within, those of ``params`` holding a freed gradient hold none: for the wrapped class's
    step on parameters without a gradient (a group no gradient reached, a bucket skipped as
    non-finite), which the plain optimizer's step skips by ``p.grad is None``. Restored after."""
    with torch._C.DisableTorchFunctionSubclass():
        held = [(p, p.grad) for p in params]
        hidden = [(p, grad) for p, grad in held if grad is not None and is_freed(grad)]
        for param, _ in hidden:
            param.grad = None
    try:
        yield
    finally:
        with torch._C.DisableTorchFunctionSubclass():
            for param, grad in hidden:
                param.grad = grad
