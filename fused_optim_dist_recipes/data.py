"""Text corpora for language-model fine-tuning, and a sampler that is a pure function of the step.

The default corpus is the Python standard library's own top-level ``.py`` files: every machine
with Python has it, so the fine-tuning job runs with nothing downloaded. Text is tokenized once
into one stream of token ids with an end-of-document id between documents; training windows are
drawn from that stream at offsets that depend only on ``(seed, step)``, so a resumed run sees
exactly the batches the uninterrupted run would have seen, whatever the world size.

A held-out split (:func:`split_held_out`) is one block of the stream at an offset drawn from the
seed, cut into whole sequences; training windows are drawn from the rest only.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

__all__ = [
    "BatchSampler",
    "ByteTokenizer",
    "Tokenizer",
    "default_corpus_files",
    "read_documents",
    "split_held_out",
    "tokenize",
]

JSONL_SUFFIX = ".jsonl"
JSONL_TEXT_KEY = "text"


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """One more than the largest id ``encode`` returns or ``eos_id``."""

    @property
    def eos_id(self) -> int:
        """The id placed after every document."""

    def encode(self, text: str) -> list[int] | np.ndarray:
        """Token ids of ``text``, without special tokens."""

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens left out."""


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, and 256 as end of document: any text, no vocabulary file."""

    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: list[int]) -> str:
        # A model may end mid-character: undecodable bytes show as U+FFFD, not an error.
        return bytes(i for i in ids if i < self.eos_id).decode("utf-8", errors="replace")


def default_corpus_files() -> list[Path]:
    """The standard library's top-level ``.py`` files, sorted by name (about 5 MB on 3.11).

    Raises:
        FileNotFoundError: if this Python installation ships no standard-library sources.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    if not files:
        raise FileNotFoundError(
            f"found no .py files in the standard library directory {stdlib}; this Python "
            "ships no sources, so pass --data with your own text files"
        )
    return files


def _files_under(path: Path) -> list[Path]:
    """``path`` itself, or every non-hidden regular file below it, sorted by relative path."""
    if path.is_file():
        return [path]
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not files:
        raise ValueError(f"data directory {path} holds no files; put .txt or .jsonl files in it")
    return files


def _read_jsonl(path: Path) -> Iterator[str]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not valid JSON ({error.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(JSONL_TEXT_KEY), str):
                raise ValueError(
                    f"{path}:{number}: expected a JSON object with a string field "
                    f"{JSONL_TEXT_KEY!r}, found {line.strip()[:80]!r}"
                )
            yield record[JSONL_TEXT_KEY]


def read_documents(path: str | Path | None = None) -> list[str]:
    """The documents of a corpus, in a deterministic order.

    Args:
        path: ``None`` for the default corpus (:func:`default_corpus_files`); a file; or a
            directory, read recursively in sorted order, hidden files skipped. A ``.jsonl``
            file holds one document per line in its ``"text"`` field; any other file is one
            UTF-8 document (undecodable bytes replaced).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: for an empty directory, a malformed JSONL line, or no text at all.
    """
    if path is None:
        files = default_corpus_files()
    else:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(
                f"data path {path} does not exist; pass a text file, a .jsonl file with a "
                f"{JSONL_TEXT_KEY!r} field per line, or a directory of them"
            )
        files = _files_under(path)
    documents: list[str] = []
    for file in files:
        if file.suffix == JSONL_SUFFIX:
            documents.extend(_read_jsonl(file))
        else:
            documents.append(file.read_text(encoding="utf-8", errors="replace"))
    documents = [doc for doc in documents if doc]
    if not documents:
        raise ValueError(f"no text found in {path if path is not None else 'the default corpus'}")
    return documents


def tokenize(documents: list[str], tokenizer: Tokenizer) -> torch.Tensor:
    """One int64 stream: each document's ids followed by ``tokenizer.eos_id``."""
    eos = np.array([tokenizer.eos_id], dtype=np.int64)
    pieces: list[np.ndarray] = []
    for doc in documents:
        pieces.append(np.asarray(tokenizer.encode(doc), dtype=np.int64))
        pieces.append(eos)
    return torch.from_numpy(np.concatenate(pieces))


_HELD_OUT_STREAM = 0
"""Second word of the held-out block's seed ``[seed, 0]``: never a training batch's
``[seed, step]``, as steps count from 1."""


def split_held_out(
    tokens: torch.Tensor, *, held_out_tokens: int, seq_len: int, seed: int, eos_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut a held-out block out of a token stream; return (training stream, held-out windows).

    The block holds ``held_out_tokens // seq_len`` whole sequences: windows of ``seq_len + 1``
    tokens overlapping by one, so every token of the block but its first is a target exactly
    once. Its offset is drawn from ``seed`` alone, so the split is the same for every world size,
    every rank and a resumed run. The training stream is what is left on either side, joined by
    ``eos_id`` so that no training window runs from one side into the other as if it were text.

    Raises:
        ValueError: if the block holds no whole sequence, or leaves too little to train on.
    """
    windows = held_out_tokens // seq_len
    if windows < 1:
        raise ValueError(
            f"a held-out split of {held_out_tokens} tokens holds no whole sequence of "
            f"{seq_len} tokens; hold out at least {seq_len} tokens, or none"
        )
    length = windows * seq_len + 1
    left = tokens.numel() - length
    if left < seq_len + 2:
        raise ValueError(
            f"the corpus has {tokens.numel()} tokens; holding out {length} leaves {left}, fewer "
            f"than one training window of seq_len + 1 = {seq_len + 1}; hold out fewer tokens or "
            "use more data"
        )
    rng = np.random.default_rng([seed, _HELD_OUT_STREAM])
    start = int(rng.integers(0, left + 1))
    held_out = tokens[start : start + length]
    eos = torch.tensor([eos_id], dtype=tokens.dtype)
    sides = [piece for piece in (tokens[:start], tokens[start + length :]) if piece.numel()]
    train = torch.cat([sides[0], eos, sides[1]]) if len(sides) == 2 else sides[0].clone()
    return train, held_out.unfold(0, seq_len + 1, seq_len).contiguous()


class BatchSampler:
    """Random windows of a token stream; the batch of a step depends only on (seed, step).

    The global batch of step ``s`` is ``global_batch`` windows of ``seq_len + 1`` tokens at
    offsets drawn by ``numpy.random.default_rng([seed, s])``. :meth:`micro_batch` hands each
    (micro-batch, rank) pair a disjoint equal slice of it, so the union over ranks and
    micro-batches is the same global batch for any world size and accumulation count.

    Raises:
        ValueError: if the stream is too short for one window.
    """

    def __init__(self, tokens: torch.Tensor, *, seq_len: int, global_batch: int, seed: int) -> None:
        if tokens.ndim != 1 or tokens.numel() < seq_len + 2:
            raise ValueError(
                f"the corpus has {tokens.numel()} tokens, fewer than one training window of "
                f"seq_len + 1 = {seq_len + 1}; use more data or a shorter --seq-len"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed

    def windows(self, step: int, start: int, count: int) -> torch.Tensor:
        """Windows ``start .. start + count - 1`` of step ``step``'s global batch: (count, T+1)."""
        rng = np.random.default_rng([self.seed, step])
        offsets = rng.integers(0, self.tokens.numel() - self.seq_len, size=self.global_batch)
        picked = torch.from_numpy(offsets[start : start + count])
        return self.tokens[picked[:, None] + torch.arange(self.seq_len + 1)]

    def micro_batch(
        self, step: int, *, micro: int, grad_accum: int, rank: int, world_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (global_batch / (grad_accum * world), seq_len).

        Raises:
            ValueError: if ``global_batch`` is not a multiple of ``grad_accum * world_size``.
        """
        shares = grad_accum * world_size
        if self.global_batch % shares:
            raise ValueError(
                f"the global batch of {self.global_batch} sequences does not split evenly over "
                f"{grad_accum} micro-batches x {world_size} ranks; make --batch-size a multiple "
                f"of {shares}"
            )
        size = self.global_batch // shares
        window = self.windows(step, (micro * world_size + rank) * size, size)
        return window[:, :-1], window[:, 1:]
