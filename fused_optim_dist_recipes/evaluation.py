"""What a run shows besides its training loss: the loss on held-out data, and generated text.

Both run on the sharded model as it trains: every rank runs the same forward passes, because
each FSDP2 forward all-gathers parameters and a rank that skipped one would leave the others
waiting. Both are collective when a process group is initialised, and return the same value on
every rank.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["evaluating", "generate", "held_out_loss"]

Logits = Callable[[torch.Tensor], torch.Tensor]
"""Token ids (B, T) -> next-token logits (B, T, vocab)."""


@contextlib.contextmanager
def evaluating(module: nn.Module) -> Iterator[None]:
    """``module`` in eval mode with autograd off, restored after (dropout off for evaluation)."""
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        module.train(was_training)


def _rank_and_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def held_out_loss(
    logits: Logits, windows: torch.Tensor, *, batch_size: int, device: torch.device
) -> float:
    """Mean next-token cross-entropy over every target token of ``windows``; collective.

    ``windows`` (n, T + 1) is the whole held-out split, the same on every rank. Rank r takes the
    r-th contiguous slice of ``ceil(n / world)`` windows and runs it in batches of at most
    ``batch_size``; every rank runs the same number of forward passes, one whose slice has run
    out running a window it does not count (the last slice may be short or empty). The sums of
    the losses (in float64) and of the target counts are summed over the ranks, so the result is
    the mean over the whole split for any world size, up to rounding in the forward pass.
    """
    rank, world = _rank_and_world()
    per_rank = math.ceil(windows.shape[0] / world)
    mine = windows[rank * per_rank : (rank + 1) * per_rank]
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, target count
    for first in range(0, per_rank, batch_size):
        chunk = mine[first : first + batch_size]
        if not len(chunk):
            logits(windows[:1, :-1].to(device))  # keeps the ranks' all-gathers matched
            continue
        inputs, targets = chunk[:, :-1].to(device), chunk[:, 1:].to(device)
        losses = F.cross_entropy(
            logits(inputs).flatten(0, 1).float(), targets.flatten(), reduction="none"
        )
        totals[0] += losses.double().sum()
        totals[1] += targets.numel()
    if world > 1:
        dist.all_reduce(totals)
    # Host sync, once per evaluation.
    return (totals[0] / totals[1]).item()


def generate(
    logits: Logits,
    prompt: Sequence[int],
    *,
    max_new_tokens: int,
    context: int,
    vocab_size: int,
    eos_id: int,
    device: torch.device,
    top_k: int | None = None,
    seed: int = 0,
) -> list[int]:
    """Continue ``prompt`` by up to ``max_new_tokens`` token ids; collective.

    Greedy (the most likely id) without ``top_k``; otherwise drawn from the ``top_k`` most
    likely ids in proportion to their probabilities, with a generator seeded by ``seed``. Each
    step runs the model on the last ``context`` tokens (no KV cache: the model is sharded and
    small, and this keeps one code path for every architecture) and considers only ids below
    ``vocab_size`` (the tokenizer's; a model's embedding table may be padded). Rank 0's choice
    is broadcast, so every rank continues the same text and runs the same number of forward
    passes even if rounding differed between them. Stops after ``eos_id``, which is not
    returned. An empty prompt starts from ``eos_id``: the start of a document.
    """
    tokens = list(prompt) or [eos_id]
    start = len(tokens) if prompt else 1
    generator = torch.Generator().manual_seed(seed)
    for _ in range(max_new_tokens):
        window = torch.tensor([tokens[-context:]], dtype=torch.long, device=device)
        scores = logits(window)[0, -1, :vocab_size].float()
        if top_k is None:
            choice = scores.argmax().reshape(1)
        else:
            values, ids = scores.topk(min(top_k, vocab_size))
            drawn = torch.multinomial(values.softmax(0).cpu(), 1, generator=generator)
            choice = ids[drawn.to(ids.device)]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(choice, src=0)
        token = int(choice.item())  # host sync, once per generated token
        if token == eos_id:
            break
        tokens.append(token)
    return tokens[start:]
