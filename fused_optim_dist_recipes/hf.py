"""Fine-tune a local Hugging Face ``transformers`` causal LM (optional extra: ``[hf]``).

A model directory is what ``save_pretrained`` writes: ``config.json`` plus safetensors weights,
and optionally tokenizer files. Nothing is downloaded: loading is ``local_files_only``.

Tokenizer choice: the directory's own tokenizer when it has one (``tokenizer.json``,
``tokenizer.model``, ...); otherwise the byte tokenizer of :mod:`fused_optim_dist_recipes.data`,
which needs a vocabulary of at least 257 ids (256 bytes and end-of-document).
"""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fused_optim_dist_recipes.data import ByteTokenizer, Tokenizer

__all__ = [
    "HFTokenizer",
    "decoder_blocks",
    "hf_logits",
    "load_causal_lm",
    "load_tokenizer",
    "save_pretrained",
]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
"""Files ``AutoTokenizer.save_pretrained`` may write; any one of the first three means a
tokenizer is present, and all present ones are copied next to the fine-tuned weights."""
_TOKENIZER_MARKERS = TOKENIZER_FILES[:3]


def _transformers() -> ModuleType:
    try:
        return importlib.import_module("transformers")
    except ImportError:
        raise ImportError(
            "--hf-model needs the optional Hugging Face dependencies; install them with "
            "pip install 'fused_optim_dist[hf]' (transformers and safetensors)"
        ) from None


def _check_model_dir(directory: Path) -> None:
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"{directory} is not a transformers model directory (no config.json); pass the "
            "directory model.save_pretrained() wrote"
        )


def load_causal_lm(directory: str | Path) -> nn.Module:
    """Load ``AutoModelForCausalLM`` from a local directory, in float32, on the CPU.

    Raises:
        ImportError: if ``transformers`` is not installed.
        FileNotFoundError: if ``directory`` has no ``config.json``.
    """
    directory = Path(directory)
    _check_model_dir(directory)
    transformers = _transformers()
    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, local_files_only=True
    )


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder layers of a transformers causal LM, one FSDP unit each.

    Uses ``model.get_decoder().layers`` when the architecture has it, else the longest
    ``nn.ModuleList`` in the model.

    Raises:
        ValueError: if the model holds no ``nn.ModuleList``.
    """
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers):
        return list(layers)
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(
            f"found no repeated decoder layers (nn.ModuleList) in {type(model).__name__}; "
            "this architecture is not supported by --hf-model"
        )
    return list(max(lists, key=len))


def hf_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, vocab) of a transformers causal LM, without building a KV cache."""
    return model(input_ids=tokens, use_cache=False).logits


class HFTokenizer:
    """A transformers tokenizer seen through the :class:`~fused_optim_dist_recipes.data.Tokenizer` API."""

    def __init__(self, tokenizer: object) -> None:
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError(
                f"the tokenizer {type(tokenizer).__name__} has no eos_token; set one (e.g. "
                "tokenizer.eos_token = '</s>') and save it again"
            )
        self._tokenizer = tokenizer
        self.eos_id = int(eos)
        self.vocab_size = len(tokenizer)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tokenizer(text, add_special_tokens=False)["input_ids"])


def load_tokenizer(directory: str | Path, model_vocab_size: int) -> Tokenizer:
    """The directory's tokenizer, or the byte tokenizer when it has none (see module notes).

    Raises:
        ValueError: if the tokenizer's ids do not fit the model's vocabulary.
    """
    directory = Path(directory)
    if any((directory / name).is_file() for name in _TOKENIZER_MARKERS):
        tokenizer: Tokenizer = HFTokenizer(
            _transformers().AutoTokenizer.from_pretrained(directory, local_files_only=True)
        )
        source = f"the tokenizer in {directory}"
    else:
        tokenizer = ByteTokenizer()
        source = f"the byte tokenizer ({directory} has no tokenizer files)"
    if tokenizer.vocab_size > model_vocab_size:
        raise ValueError(
            f"{source} produces ids up to {tokenizer.vocab_size - 1}, but the model's "
            f"vocabulary has {model_vocab_size} ids; save a matching tokenizer with the model"
        )
    return tokenizer


def save_pretrained(model: nn.Module, source_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the (sharded) model in transformers format to ``out_dir``; collective.

    Every rank must call it: the full state dict is gathered to rank 0 (on the CPU), which
    writes config and safetensors weights and copies the tokenizer files of ``source_dir``.
    """
    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    out_dir = Path(out_dir)
    if not dist.is_initialized() or dist.get_rank() == 0:
        model.save_pretrained(out_dir, state_dict=state)
        for name in TOKENIZER_FILES:
            if (Path(source_dir) / name).is_file():
                shutil.copy2(Path(source_dir) / name, out_dir / name)
    return out_dir
