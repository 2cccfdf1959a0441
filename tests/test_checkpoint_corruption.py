"""Broken checkpoints: a clear error naming the problem, on every rank, and nothing changed.

One body on a 2-rank gloo world saves a checkpoint of the tiny Llama preset, breaks a copy of it
in one way per case (garbage, truncation, or one flipped bit in each kind of file), and tries
``checkpoint.load`` into a model and optimizer that have trained one step further (so a partial
load would show). Every rank reports what it raised and which of its local parameter and
optimizer-state shards changed; the tests judge those reports, so a failing case does not break
the shared world.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor

from fused_optim_dist import OptimizerInBackward, checkpoint
from fused_optim_dist import _checkpoint_layout as layout
from fused_optim_dist_recipes.models import PRESETS, Llama, apply_fsdp

WORLD_SIZE = 2
STEP = 1
SHARD_FILE = "__0_0.distcp"
"""Rank 0's shard file in a DCP checkpoint (FileSystemWriter names them __<rank>_<n>.distcp)."""
GARBAGE = b"\x80\x04not a checkpoint\x00\xff" * 8
OTHER_MODEL = dataclasses.replace(PRESETS["tiny"], dim=48, n_layers=3, ffn_hidden=96)
"""Wider (other shapes) and deeper (other names) than the tiny preset."""
VOCAB = PRESETS["tiny"].vocab_size


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_byte(path: Path) -> None:
    """Flip one bit in the middle of ``path``: same size. In a shard, in the middle of its
    largest item (DCP's metadata gives each item's bytes), a tensor element that DCP alone
    would load without a word; the middle of the file may fall in an item's serialized header
    instead, which torch.load refuses."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    if path.suffix == ".distcp":
        storage = FileSystemReader(path.parent).read_metadata().storage_data
        item = max(
            (info for info in storage.values() if info.relative_path == path.name),
            key=lambda info: info.length,
        )
        middle = item.offset + item.length // 2
    data[middle] ^= 0x01
    path.write_bytes(bytes(data))


# label -> how rank 0 breaks the copied checkpoint folder
CORRUPTIONS: dict[str, Callable[[Path], None]] = {
    "truncated_shard": lambda step_dir: _truncate(step_dir / SHARD_FILE),
    "dcp_metadata": lambda step_dir: (step_dir / layout.DCP_METADATA_FILE).write_bytes(GARBAGE),
    "library_metadata": lambda step_dir: (step_dir / layout.METADATA_FILE).write_bytes(GARBAGE),
    # Valid JSON, but not what save wrote (a file emptied to "{}" by a tool, a hand edit).
    "library_metadata_empty_object": lambda step_dir: (step_dir / layout.METADATA_FILE).write_text(
        "{}"
    ),
    "extra": lambda step_dir: (step_dir / layout.EXTRA_FILE).write_bytes(GARBAGE),
    # One flipped bit, the size unchanged: found only by the checksums.
    "flipped_shard_0": lambda step_dir: _flip_byte(step_dir / "__0_0.distcp"),
    "flipped_shard_1": lambda step_dir: _flip_byte(step_dir / "__1_0.distcp"),
    "flipped_dcp_metadata": lambda step_dir: _flip_byte(step_dir / layout.DCP_METADATA_FILE),
    "flipped_extra": lambda step_dir: _flip_byte(step_dir / layout.EXTRA_FILE),
    "flipped_library_metadata": lambda step_dir: _flip_byte(step_dir / layout.METADATA_FILE),
    "flipped_checksum_record": lambda step_dir: _flip_byte(step_dir / "__0_checksums.json"),
}
UNVERIFIED = "flipped_shard_1_unverified"
"""The flipped shard loaded with ``verify_checksums=False``: what DCP alone does."""


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one rank saw when loading a broken checkpoint."""

    error_type: str | None
    """Class name of what ``load`` raised; ``None`` if it returned."""
    is_exception: bool
    """Whether it is an ``Exception`` (``except Exception`` catches it)."""
    message: str
    changed: list[str]
    """Local parameter shards and optimizer-state tensors that differ after the failed load."""


def _build(config=PRESETS["tiny"], *, steps: int) -> tuple[nn.Module, OptimizerInBackward]:
    """The model sharded over the world and an in-backward AdamW, trained ``steps`` steps."""
    torch.manual_seed(0)
    model = apply_fsdp(Llama(config))
    optim = OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=1e-2)
    tokens = torch.randint(
        0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(dist.get_rank())
    )
    for _ in range(steps):
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _snapshot(model: nn.Module, optim: OptimizerInBackward) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter and optimizer-state tensor, copied."""
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {f"param {n}": _local(p).detach().clone() for n, p in model.named_parameters()}
    for param, state in optim.state.items():
        for key, value in state.items():
            tensors[f"state {names[id(param)]}.{key}"] = _local(value).clone()
    return tensors


def _try_load(source: Path, verify_checksums: bool = True) -> Outcome:
    model, optim = _build(steps=STEP + 1)
    before = _snapshot(model, optim)
    try:
        checkpoint.load(source, model, optim, verify_checksums=verify_checksums)
        error = None
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        error = e
    after = _snapshot(model, optim)
    assert after.keys() == before.keys()
    changed = sorted(name for name in before if not torch.equal(before[name], after[name]))
    return Outcome(
        error_type=None if error is None else type(error).__name__,
        is_exception=isinstance(error, Exception),
        message="" if error is None else str(error),
        changed=changed,
    )


def _corruption_body(root: str) -> dict[str, Outcome]:
    root = Path(root)
    model, optim = _build(steps=STEP)
    source = checkpoint.save(root / "source", model, optim, step=STEP).path
    other_model, other_optim = _build(OTHER_MODEL, steps=STEP)
    checkpoint.save(root / "other_model", other_model, other_optim, step=STEP)
    if dist.get_rank() == 0:
        for label, corrupt in CORRUPTIONS.items():
            copy = layout.step_dir(root / label, STEP)
            shutil.copytree(source, copy)
            corrupt(copy)
    dist.barrier()
    outcomes = {label: _try_load(root / label) for label in [*CORRUPTIONS, "other_model"]}
    outcomes[UNVERIFIED] = _try_load(root / "flipped_shard_1", verify_checksums=False)
    # The world is still usable, and the intact checkpoint still loads.
    outcomes["intact"] = _try_load(root / "source")
    return outcomes


@pytest.fixture(scope="module")
def outcomes(worlds, tmp_path_factory) -> tuple[Path, list[dict[str, Outcome]]]:
    root = tmp_path_factory.mktemp("corruption")
    return root, worlds.run(WORLD_SIZE, _corruption_body, root=str(root))


def _assert_refused(outcomes, label: str, *patterns: str) -> None:
    """Every rank raised an ``Exception`` whose message matches each pattern, and changed
    nothing; the patterns may use ``{dir}``, the broken checkpoint's folder.
    """
    root, by_rank = outcomes
    step_dir = layout.step_dir(root / label, STEP)
    for rank, outcome in enumerate(by_rank):
        seen = outcome[label]
        assert seen.error_type is not None, f"rank {rank}: the broken checkpoint loaded"
        problems = [
            f"/{p}/ not in the message"
            for p in patterns
            if not re.search(p.format(dir=re.escape(str(step_dir))), seen.message)
        ]
        if not seen.is_exception:
            problems.append("not an Exception, so `except Exception` misses it")
        if seen.changed:
            problems.append(f"changed {seen.changed}")
        assert not problems, (
            f"rank {rank}: " + "; ".join(problems) + f"\n{seen.error_type}: {seen.message[:2000]}"
        )


def test_intact_checkpoint_loads(outcomes):
    _, by_rank = outcomes
    for outcome in by_rank:
        assert outcome["intact"].error_type is None, outcome["intact"].message
        # The model had trained one step past the checkpoint: loading rewinds every tensor.
        assert len(outcome["intact"].changed) > 0


def test_checkpoint_of_another_model_is_refused_by_name(outcomes):
    _assert_refused(
        outcomes,
        "other_model",
        "does not fit the model and optimizer; nothing was loaded",
        r"'layers\.2\.attention\.wq\.weight' is in the checkpoint but not in the model",
        rf"'tok_embeddings\.weight' has shape \({VOCAB}, 32\) in the model but \({VOCAB}, 48\) "
        "in the checkpoint",
    )


def test_truncated_shard_is_refused_by_name_and_changes_nothing(outcomes):
    _assert_refused(
        outcomes, "truncated_shard", rf"{{dir}}/{re.escape(SHARD_FILE)}", "(?i)truncated|corrupt"
    )


def test_garbage_dcp_metadata_is_refused_by_name_and_changes_nothing(outcomes):
    _assert_refused(
        outcomes,
        "dcp_metadata",
        rf"{{dir}}/{re.escape(layout.DCP_METADATA_FILE)}",
        "(?i)corrupt|unreadable|cannot be read",
    )


def test_garbage_library_metadata_is_refused_by_name_and_changes_nothing(outcomes):
    _assert_refused(
        outcomes,
        "library_metadata",
        rf"{{dir}}/{re.escape(layout.METADATA_FILE)}",
        "(?i)corrupt|not valid JSON",
    )


def test_library_metadata_without_its_keys_is_refused_as_corrupt(outcomes):
    _assert_refused(
        outcomes,
        "library_metadata_empty_object",
        rf"{{dir}}/{re.escape(layout.METADATA_FILE)}",
        "(?i)corrupt",
    )


def test_garbage_extra_is_refused_by_name_and_changes_nothing(outcomes):
    _assert_refused(outcomes, "extra", rf"{{dir}}/{re.escape(layout.EXTRA_FILE)}")


@pytest.mark.parametrize("rank", [0, 1])
def test_flipped_bit_in_a_shard_is_refused_by_name_and_changes_nothing(outcomes, rank):
    # Each rank verifies its share of the shard files: the verdict reaches every rank.
    _assert_refused(
        outcomes,
        f"flipped_shard_{rank}",
        rf"{{dir}}/__{rank}_0\.distcp",
        "is corrupt: its checksum is",
    )


@pytest.mark.parametrize(
    ("label", "file"),
    [
        ("flipped_dcp_metadata", layout.DCP_METADATA_FILE),
        ("flipped_extra", layout.EXTRA_FILE),
        ("flipped_library_metadata", layout.METADATA_FILE),
    ],
)
def test_flipped_bit_in_a_small_file_is_refused_by_name_and_changes_nothing(outcomes, label, file):
    _assert_refused(outcomes, label, rf"{{dir}}/{re.escape(file)}", "(?i)corrupt")


def test_flipped_bit_in_a_checksum_record_is_refused(outcomes):
    # The record no longer matches its shard (or is no longer JSON): either way, named.
    _assert_refused(
        outcomes, "flipped_checksum_record", r"{dir}/__0_(0\.distcp|checksums\.json)", "(?i)corrupt"
    )


def test_skipping_verification_loads_a_flipped_shard_silently(outcomes):
    # Why the checksums exist: DCP itself loads the damaged tensor without a word.
    _, by_rank = outcomes
    for outcome in by_rank:
        assert outcome[UNVERIFIED].error_type is None, outcome[UNVERIFIED].message
