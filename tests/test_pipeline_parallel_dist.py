"""Pipeline parallelism (``torch.distributed.pipelining``) with ``OptimizerInBackward``, against
the plain optimizer running the same loop on the same stages.

A schedule runs one backward per micro-batch. With FSDP2 stages it runs all of them with
gradient sync off, then reduces each stage's gradients itself after the last one (it calls the
units' post-backward, outside any backward) and divides them by the number of micro-batches
(``scale_grads=True``, the default): the gradients are held until ``step()`` ([Note: gradients
reduced outside backward] in ``optimizer.py``), which steps them as the plain optimizer does,
clipped by their global norm where ``max_grad_norm`` is set. Stages that are plain modules run
each micro-batch's backward in autograd: ``schedule.step()`` under ``optim.accumulate()``
leaves ``step()`` the sum, as the plain loop; without it the first micro-batch is stepped in
its backward and the next one is refused.

Two stages on 2 ranks (one rank per stage) and on 4 (each stage FSDP2-sharded over 2 ranks,
rows that do not divide evenly, or replicated over them by ``replicate``, whose stages the
schedule reduces alike); four stages, two a rank, for the interleaved schedules; a one-stage
pipeline on 1 rank for the refusal, which on several stages would leave the other stages
waiting in their receives. Clipped runs also check the norm the loop measures between the
schedule and ``step()`` ([Note: gradients held for step()] in ``optimizer.py``)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from fused_optim_dist import OptimizerInBackward, clip_grad_norm_
from fused_optim_dist.compact_adamw import CompactAdamW

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zero-bubble": ScheduleInterleavedZeroBubble,
}
"""Schedules of one stage a rank, then of several (the model's four blocks as four stages,
two a rank). The zero-bubble one runs each micro-batch's backward as two: the inputs'
gradients first, the weights' later."""
MULTI_STAGE = ("interleaved-1f1b", "zero-bubble")
MICRO_BATCHES = 4
STEPS = 3
CLIP = 0.005
"""Below every global gradient norm of these runs (checked), so every step is clipped."""


DATA_PARALLEL = {"fully_shard": fully_shard, "replicate": replicate}


def _stage(
    stage_index: int, stages: int, dp_mesh: Any = None, data_parallel: str | None = None
) -> nn.Module:
    """Stage ``stage_index`` of a model of four blocks cut into ``stages`` equal stages, the same
    weights on every rank; each block a unit of ``data_parallel`` over ``dp_mesh`` where it is
    given."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(8, 13), nn.Tanh(), nn.Linear(13, 8)) for _ in range(4)]
    per_stage = len(blocks) // stages
    part = nn.Sequential(*blocks[stage_index * per_stage : (stage_index + 1) * per_stage])
    if data_parallel is not None:
        apply = DATA_PARALLEL[data_parallel]
        for block in part:
            apply(block, mesh=dp_mesh)
        apply(part, mesh=dp_mesh)
    return part


def _stages(schedule: str, mesh: Any, data_parallel: str | None) -> list[PipelineStage]:
    """This rank's stages of the pipeline: one of two, or two of four (``MULTI_STAGE``: rank
    ``r`` of the pipeline holds stages ``r`` and ``r + 2``, as the interleaved schedules take
    them)."""
    rank, ranks = mesh.get_local_rank("pp"), mesh["pp"].size()
    stages = 2 * ranks if schedule in MULTI_STAGE else ranks
    return [
        PipelineStage(
            _stage(index, stages, mesh["dp"], data_parallel),
            index,
            stages,
            torch.device("cpu"),
            group=mesh["pp"].get_group(),
        )
        for index in range(rank, stages, ranks)
    ]


def _train(
    ours: bool,
    *,
    data_parallel: str | None,
    schedule: str,
    scale_grads: bool,
    cls: type[torch.optim.Optimizer],
    clip: float | None,
    clip_by: str = "optimizer",
) -> tuple[list[torch.Tensor], list[float]]:
    """``STEPS`` steps of a pipeline over two ranks (data parallel over the ranks left, FSDP2 or
    one rank a pipeline rank), one optimizer over this rank's stages, both loops calling
    ``fused_optim_dist.clip_grad_norm_`` between the schedule and ``step()`` (the plain one
    clips there, ours measures, and ``max_grad_norm`` clips at ``step()``, whose norm follows),
    or with ``clip_by="loop"`` both clipping there with ``torch.nn.utils.clip_grad_norm_``
    (ours without ``max_grad_norm``: the gradients are real until ``step()``); their full
    parameters, and the norms."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    stages = _stages(schedule, mesh, data_parallel)
    params = [p for stage in stages for p in stage.submod.parameters()]
    kwargs = dict(lr=1e-2, weight_decay=0.01)
    by_optimizer = clip if clip_by == "optimizer" else None
    optim = (
        OptimizerInBackward(params, cls, max_grad_norm=by_optimizer, **kwargs)
        if ours
        else cls(params, **kwargs)
    )

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(output, target)
        return loss if scale_grads else loss / MICRO_BATCHES  # the schedule's mean, or ours

    run = SCHEDULES[schedule](
        stages if schedule in MULTI_STAGE else stages[0],
        n_microbatches=MICRO_BATCHES,
        loss_fn=loss_fn,
        scale_grads=scale_grads,
    )
    first = mesh.get_local_rank("pp") == 0
    data = torch.Generator().manual_seed(1 + mesh.get_local_rank("dp"))
    norms = []
    for _ in range(STEPS):
        x, y = torch.randn(16, 8, generator=data), torch.randn(16, 8, generator=data)
        optim.zero_grad()
        with optim.accumulate() if ours and not data_parallel else contextlib.nullcontext():
            # An interleaved schedule's first rank holds the last stage too: it takes both.
            run.step(x, target=y if len(stages) > 1 else None) if first else run.step(target=y)
        if clip is not None and clip_by == "loop":
            norms.append(torch.nn.utils.clip_grad_norm_(params, clip).item())
        elif clip is not None:
            # Ours measures the held gradients; step() clips them.
            norms.append(clip_grad_norm_(optim, clip).item())
        optim.step()
        if by_optimizer is not None and ours:
            norms.append(optim.grad_norm().item())
    full = [p.detach().full_tensor() if data_parallel else p.detach().clone() for p in params]
    return full, norms


def _equal_body(**options: Any) -> None:
    plain, plain_norms = _train(False, **options)
    ours, ours_norms = _train(True, **options)
    for a, b in zip(ours, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    if options["clip"] is not None:
        assert min(plain_norms) > options["clip"], plain_norms
        # Each step's norm measured before step(), then grad_norm() after it if ours clips.
        repeat = 2 if options.get("clip_by", "optimizer") == "optimizer" else 1
        expected = [norm for norm in plain_norms for _ in range(repeat)]
        torch.testing.assert_close(ours_norms, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("world", "data_parallel", "schedule", "scale_grads", "cls", "clip", "clip_by"),
    [
        (2, "fully_shard", "gpipe", True, torch.optim.AdamW, None, "optimizer"),
        (2, "fully_shard", "1f1b", False, torch.optim.AdamW, None, "optimizer"),
        (4, "fully_shard", "1f1b", True, torch.optim.AdamW, CLIP, "optimizer"),
        (4, "fully_shard", "gpipe", True, CompactAdamW, None, "optimizer"),
        (2, None, "gpipe", True, torch.optim.AdamW, None, "optimizer"),
        (2, None, "1f1b", True, torch.optim.AdamW, CLIP, "optimizer"),
        (2, "fully_shard", "interleaved-1f1b", True, torch.optim.AdamW, None, "optimizer"),
        (4, "fully_shard", "zero-bubble", True, torch.optim.AdamW, CLIP, "optimizer"),
        (2, None, "zero-bubble", True, torch.optim.AdamW, None, "optimizer"),
        (4, "replicate", "1f1b", True, torch.optim.AdamW, CLIP, "optimizer"),
        (4, "fully_shard", "1f1b", True, torch.optim.AdamW, CLIP, "loop"),
    ],
    ids=[
        "fsdp-gpipe-2",
        "fsdp-1f1b-sum-2",
        "fsdp-1f1b-clip-4",
        "fsdp-gpipe-compact-4",
        "stages-gpipe-2",
        "stages-1f1b-clip-2",
        "fsdp-interleaved-1f1b-2",
        "fsdp-zero-bubble-clip-4",
        "stages-zero-bubble-2",
        "replicate-1f1b-clip-4",
        "fsdp-1f1b-clip-in-the-loop-4",
    ],
)
def test_pipeline_equal_plain(
    worlds, world, data_parallel, schedule, scale_grads, cls, clip, clip_by
):
    worlds.run(
        world,
        _equal_body,
        data_parallel=data_parallel,
        schedule=schedule,
        scale_grads=scale_grads,
        cls=cls,
        clip=clip,
        clip_by=clip_by,
    )


def _refused_body(schedule: str, match: str, cause: str) -> None:
    """A one-stage pipeline of plain modules, ``schedule.step()`` without ``accumulate()``:
    the first micro-batch's backward stepped the stage; refused (1F1B, the second micro-batch's
    forward run after it: our error, naming ``accumulate()``; GPipe, every forward run before:
    autograd's check, in the second backward, of the weights they saved). ``step()`` then
    accepts the update made, as after any failed backward: the plain optimizer's step on the
    first micro-batch's gradients."""
    part, reference = _stage(0, 1), _stage(0, 1)
    stage = PipelineStage(part, 0, 1, torch.device("cpu"))
    optim = OptimizerInBackward(part.parameters(), torch.optim.AdamW, lr=1e-2)
    run = SCHEDULES[schedule](stage, n_microbatches=MICRO_BATCHES, loss_fn=nn.functional.mse_loss)
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    with pytest.raises(RuntimeError, match=match) as raised:
        run.step(x, target=y)
    assert cause in str(raised.value.__cause__)
    optim.step()
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    first = len(x) // MICRO_BATCHES
    nn.functional.mse_loss(reference(x[:first]), y[:first]).backward()
    plain.step()
    for a, b in zip(part.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("schedule", "match", "cause"),
    [
        ("1f1b", "failed to run forward", "schedule: schedule.step() under it"),
        ("gpipe", "Failed to run stage backward", "modified by an inplace operation"),
    ],
)
def test_pipeline_of_plain_stages_without_accumulate_refused(worlds, schedule, match, cause):
    worlds.run(1, _refused_body, schedule=schedule, match=match, cause=cause)
