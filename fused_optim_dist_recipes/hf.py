"""Fine-tune a local Hugging Face ``transformers`` causal LM (optional extra: ``[recipes]``).

A model directory is what ``save_pretrained`` writes: ``config.json`` plus safetensors weights,
and optionally tokenizer files. Nothing is downloaded: loading is ``local_files_only``.

Loading never holds the whole model on a rank's host: :func:`empty_causal_lm` builds the model
with its parameters on the meta device, the caller shards it (``apply_fsdp``), and
:func:`load_local_shards` reads from the safetensors files only the rows of each parameter this
rank holds, straight into its shard. Peak host memory per rank is about its shards plus one
tensor's rows when the checkpoint's dtype differs, not the full fp32 model (measured in
``tests/test_hf.py``).

Tokenizer choice: the directory's own tokenizer when it has one (``tokenizer.json``,
``tokenizer.model``, ...); otherwise the byte tokenizer of :mod:`fused_optim_dist_recipes.data`,
which needs a vocabulary of at least 257 ids (256 bytes and end-of-document).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import BinaryIO

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from fused_optim_dist_recipes.data import ByteTokenizer, Tokenizer

__all__ = [
    "HFTokenizer",
    "decoder_blocks",
    "empty_causal_lm",
    "hf_logits",
    "load_local_shards",
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
            "--hf-model needs the application's optional dependencies; install them with "
            "pip install -e '.[recipes]' (transformers and safetensors)"
        ) from None


def _check_model_dir(directory: Path) -> None:
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"{directory} is not a transformers model directory (no config.json); pass the "
            "directory model.save_pretrained() wrote"
        )


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Register every ``nn.Parameter`` created inside on the meta device; buffers stay real.

    Buffers are few and small, and some are computed in ``__init__`` and absent from the
    checkpoint (RoPE's ``inv_freq``), so they must keep their values. A module's ``__init__``
    still creates each parameter with ``torch.empty`` first, which reserves but never touches
    host memory.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)
            module._parameters[name] = meta

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def empty_causal_lm(directory: str | Path) -> nn.Module:
    """``AutoModelForCausalLM`` of ``directory``'s config in float32, parameters on meta.

    Shard it (``apply_fsdp``), then fill it with :func:`load_local_shards`.

    Raises:
        ImportError: if ``transformers`` is not installed.
        FileNotFoundError: if ``directory`` has no ``config.json``.
    """
    directory = Path(directory)
    _check_model_dir(directory)
    transformers = _transformers()
    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    with _parameters_on_meta():
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


# ---------------------------------------------------------------------------------- safetensors

SAFETENSORS_FILE, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
"""What ``save_pretrained`` writes: one file, or shards listed by an index (``weight_map``)."""
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class _SafetensorsFile:
    """Reads rows of the tensors of one ``.safetensors`` file with plain file reads.

    The format: an 8-byte little-endian header length, a JSON header mapping each name to its
    ``dtype``, ``shape`` and ``data_offsets`` (from the end of the header), then the raw
    row-major bytes. Rows ``[start, stop)`` of a tensor are therefore one contiguous byte range,
    read straight into the shard: no memory map, whose resident pages would count against this
    process.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            self.header = json.loads(f.read(length))
        self.header.pop("__metadata__", None)
        self.data_start = 8 + length

    def read_rows_into(
        self, f: BinaryIO, name: str, start: int, stop: int, target: torch.Tensor
    ) -> None:
        """Copy rows ``[start, stop)`` of tensor ``name`` (of a 0-dim tensor: all of it) from
        ``f`` into ``target``, directly when ``target`` is a contiguous CPU tensor of the file's
        dtype, else through a buffer of the rows' size."""
        entry = self.header[name]
        dtype, shape = _SAFETENSORS_DTYPES[entry["dtype"]], entry["shape"]
        rows = (stop - start, *shape[1:]) if shape else ()
        if tuple(target.shape) != rows:
            raise ValueError(f"{name}: rows of shape {rows} cannot fill a shard of {target.shape}")
        direct = target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
        buffer = target.detach() if direct else torch.empty(rows, dtype=dtype)
        f.seek(
            self.data_start
            + entry["data_offsets"][0]
            + start * math.prod(rows[1:]) * dtype.itemsize
        )
        if buffer.numel() and f.readinto(buffer.view(torch.uint8).numpy()) != buffer.nbytes:
            raise ValueError(f"{self.path}: {name} is truncated; the file is incomplete")
        if not direct:
            target.copy_(buffer)


def _safetensors_files(directory: Path) -> dict[str, _SafetensorsFile]:
    """Tensor name -> the file holding it."""
    if (directory / SAFETENSORS_INDEX).is_file():
        weight_map = json.loads((directory / SAFETENSORS_INDEX).read_text())["weight_map"]
        files = {name: _SafetensorsFile(directory / name) for name in set(weight_map.values())}
        return {tensor: files[name] for tensor, name in weight_map.items()}
    if (directory / SAFETENSORS_FILE).is_file():
        single = _SafetensorsFile(directory / SAFETENSORS_FILE)
        return dict.fromkeys(single.header, single)
    raise FileNotFoundError(
        f"{directory} holds neither {SAFETENSORS_FILE} nor {SAFETENSORS_INDEX}; save the model "
        "with save_pretrained(..., safe_serialization=True)"
    )


def _local_rows(param: torch.Tensor) -> tuple[int, int]:
    """Rows ``[start, stop)`` of the full parameter that this rank's local tensor holds.

    FSDP2 shards dim 0 like ``torch.chunk``: chunks of ``ceil(rows / n)`` rows, the last ones
    shorter or empty; HSDP replicates those chunks over its other mesh dimension.
    """
    if param.dim() == 0:
        return 0, 0
    if not isinstance(param, DTensor):
        return 0, param.shape[0]
    rows, start = param.shape[0], 0
    for mesh_dim, placement in enumerate(param.placements):
        if placement.is_shard(0):
            mesh = param.device_mesh
            chunk = math.ceil(rows / mesh.size(mesh_dim))
            start = min(mesh.get_local_rank(mesh_dim) * chunk, rows)
        elif not placement.is_replicate():
            raise ValueError(
                f"a parameter placed {param.placements} cannot be loaded by rows; only FSDP2's "
                "Shard(0) (with Replicate for HSDP) is supported"
            )
    return start, start + param.to_local().shape[0]


@torch.no_grad()
def load_local_shards(model: nn.Module, directory: str | Path, device: torch.device) -> None:
    """Materialize ``model``'s meta parameters on ``device`` and fill this rank's shards.

    ``model`` comes from :func:`empty_causal_lm`, sharded with FSDP2 (or not). Each rank reads
    only the rows of each parameter it holds, so no rank ever holds the full model; nothing is
    collective, but every rank must see ``directory``.

    Raises:
        ValueError: if a parameter is missing from the checkpoint or has another shape there.
    """
    directory = Path(directory)
    files = _safetensors_files(directory)
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    model.to_empty(device=device)
    for name, buffer in model.named_buffers():
        buffer.copy_(buffers[name])
    handles: dict[Path, BinaryIO] = {}
    with contextlib.ExitStack() as stack:
        for name, param in model.named_parameters():
            source = files.get(name)
            if source is None:
                raise ValueError(
                    f"{directory} has no tensor named {name!r}; the checkpoint's tensor names "
                    "must be the model's parameter names (save_pretrained of this model class)"
                )
            if list(source.header[name]["shape"]) != list(param.shape):
                raise ValueError(
                    f"{name}: {tuple(source.header[name]['shape'])} in {source.path}, "
                    f"{tuple(param.shape)} in the model built from {directory / 'config.json'}"
                )
            if source.path not in handles:
                handles[source.path] = stack.enter_context(source.path.open("rb"))
            local = param.to_local() if isinstance(param, DTensor) else param
            source.read_rows_into(handles[source.path], name, *_local_rows(param), local)


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
    """A transformers tokenizer seen through the ``fused_optim_dist_recipes.data.Tokenizer`` API."""

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

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)


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
