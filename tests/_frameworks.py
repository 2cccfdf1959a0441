"""What the framework tests share: a tiny Llama from a config, its data, accelerate on gloo.

Nothing is downloaded: the model is built from ``LlamaConfig`` with a fixed seed, the data are
fixed token ids, the tokenizer (for TRL) a word-level vocabulary made here.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

VOCAB = 64
SEQ_LEN = 8
EXAMPLES = 32
LLAMA = dict(
    vocab_size=VOCAB,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=SEQ_LEN,
    tie_word_embeddings=False,
)
"""A 2-layer Llama with grouped-query attention, about 8k parameters."""
PARITY_ATOL = 1e-6
"""Ours against the plain optimizer in the same loop: the same update, possibly another kernel."""
NORM_RTOL = 1e-5
"""Logged gradient norms: summed over ranks and units in another order than plain's."""


def tiny_llama() -> nn.Module:
    """The same weights in every call and on every rank."""
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


class OneUnitLlama(nn.Module):
    """``tiny_llama()`` behind a plain module: accelerate's FSDP2 prepare finds no embedding or
    final norm to shard on its own, so the root is the only FSDP unit and the model is one
    bucket, where clipping in backward is exact."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = tiny_llama()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        return self.lm(input_ids=input_ids, labels=labels)


def token_ids(index: int) -> torch.Tensor:
    """Example ``index``: fixed ids, the same in every process."""
    return torch.randint(0, VOCAB, (SEQ_LEN,), generator=torch.Generator().manual_seed(index))


class TokenDataset(torch.utils.data.Dataset):
    """Causal-LM examples (``input_ids`` and ``labels``) for Trainer's default collator."""

    def __len__(self) -> int:
        return EXAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = token_ids(index)
        return {"input_ids": ids, "labels": ids.clone()}


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole (FSDP2 shards gathered: collective when sharded), on the CPU."""
    out = {}
    for name, param in model.named_parameters():
        value = param.full_tensor() if isinstance(param, DTensor) else param
        out[name.removeprefix("module.")] = value.detach().cpu().clone()
    return out


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between the same parameters of two models."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[name] - b[name]).abs().max().item() for name in a)


def local_params(model: nn.Module) -> list[torch.Tensor]:
    """Copies of this rank's part of every trainable parameter."""
    return [
        (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
        for p in model.parameters()
        if p.requires_grad
    ]


@contextlib.contextmanager
def accelerate_on_cpu() -> Iterator[None]:
    """Let accelerate pick FSDP for gloo CPU ranks, in this process only, and start afresh.

    ``AcceleratorState.__init__`` turns an ``fsdp_plugin`` into ``DistributedType.FSDP`` only
    when the distributed type is one of the accelerator types (``MULTI_GPU``, ``MULTI_NPU``,
    ...); on CPU it stays ``MULTI_CPU`` and the model is silently wrapped in DDP. FSDP2 itself
    runs on gloo, so after the original ``__init__`` this applies the same assignments for
    ``MULTI_CPU``. The installed package is not changed; the states accelerate shares between
    instances and the environment variables they set are reset on exit, so each body builds its
    own.
    """
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs) -> None:
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            # As the original's last line: the partial state reports the same type.
            PartialState._shared_state["distributed_type"] = self.distributed_type

    # accelerate and Trainer record their configuration in environment variables
    # (ACCELERATE_USE_FSDP, FSDP_*), which a later Accelerator in this process would read.
    environ = dict(os.environ)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    AcceleratorState.__init__ = init
    try:
        yield
    finally:
        AcceleratorState.__init__ = original
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        os.environ.clear()
        os.environ.update(environ)
    # Not on an error: the other ranks may be blocked in a collective this one left.
    if dist.is_initialized():
        dist.barrier()
