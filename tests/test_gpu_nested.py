"""Nested backwards on a CUDA device, where autograd runs a CUDA gradient's hooks on its device
thread, not on the thread that called ``backward()``.

A backward run from a hook of another (GradCache) is told from one nested in a Function's
``backward`` (reentrant checkpointing) by the frames on the hook's thread
(``_torch_internals.enclosing_backward``); on the device thread the outer backward's own frame
is on the caller's thread, so the inference differs from the CPU's, tested in
``test_never_silent.py``. Skipped without CUDA (see ``conftest.py``).
"""

from __future__ import annotations

import pytest
import torch
from _toy import assert_match, batch, loss_fn, make_models
from test_never_silent import ADAMW, _checkpointed, _grad_cache_backward

from fused_optim_dist import InBackwardOptions, OptimizerInBackward

pytestmark = pytest.mark.gpu

MAX_GRAD_NORM = 0.5
"""Below every step's gradient norm of the toy model, so clipping engages."""


def _cuda_models(checkpointed: bool = False):
    model, reference = (m.cuda() for m in make_models())
    if checkpointed:
        model, reference = _checkpointed(model), _checkpointed(reference)
    optim = OptimizerInBackward(
        model.parameters(),
        torch.optim.AdamW,
        # One bucket: clipping must see every gradient of the outer backward.
        options=InBackwardOptions(max_grad_norm=MAX_GRAD_NORM, bucket_numel=1 << 20),
        **ADAMW,
    )
    return model, reference, optim, torch.optim.AdamW(reference.parameters(), **ADAMW)


def _cuda_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(t.cuda() for t in batch(step))


def test_reentrant_checkpointing_is_one_pass_on_cuda():
    """The checkpointed blocks' backwards run on the device thread inside the Function's
    ``backward``: one pass with the outer backward, its norm and clipping the plain loop's."""
    model, reference, optim, plain = _cuda_models(checkpointed=True)
    for step in range(3):
        x, y = _cuda_batch(step)
        loss_fn(model, x, y).backward()
        optim.step()
        optim.zero_grad()
        loss_fn(reference, x, y).backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_GRAD_NORM)
        torch.testing.assert_close(optim.grad_norm(), norm, rtol=1e-5, atol=1e-6)
        plain.step()
        plain.zero_grad()
    assert_match(model, reference)


def test_backwards_nested_in_a_hook_refused_on_cuda_then_equal_under_accumulate():
    """GradCache's surrogate backwards, run from a tensor hook of the outer loss on the device
    thread: refused at the first nested gradient with nothing moved; under ``accumulate()``
    with ``step()`` after, as the message says, equal to the plain loop."""
    model, *_ = _cuda_models()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="run from a hook of another backward"):
        _grad_cache_backward(model, *_cuda_batch(0))
    for param, old in zip(model.parameters(), before, strict=True):
        assert torch.equal(param.detach(), old)

    model, reference, optim, plain = _cuda_models()
    for step in range(3):
        _grad_cache_backward(model, *_cuda_batch(step), nested=optim.accumulate)
        optim.step()
        optim.zero_grad()
        _grad_cache_backward(reference, *_cuda_batch(step))
        torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_GRAD_NORM)
        plain.step()
        plain.zero_grad()
    assert_match(model, reference)
