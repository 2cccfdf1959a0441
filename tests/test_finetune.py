"""The fine-tuning job: model, data, flags, and end-to-end runs (torchrun and a persistent world).

Launcher paths (torchrun on one node, two nodes, plain ``python``) run real subprocesses; the
resume checks run ``main()`` inside the session's 2-rank gloo world, which costs no start-up.
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fused_optim_dist import build_optimizer, checkpoint
from fused_optim_dist_recipes.data import BatchSampler, ByteTokenizer, read_documents, tokenize
from fused_optim_dist_recipes.launch import rendezvous_store
from fused_optim_dist_recipes.metrics import HELD_OUT_KEY, METRIC_KEYS, MetricsLog, read_metrics
from fused_optim_dist_recipes.models import PRESETS, Llama, LlamaConfig, apply_fsdp

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "finetune.py"
RUN_TIMEOUT_S = 600
"""A job that runs longer is hung: the longest here took 57 s on 2 cores at a load average of
15 (the suite beside two busy processes)."""
PNG_MAGIC = b"\x89PNG"

# A few-second configuration of the job on the tiny preset, with a small held-out split and
# short samples.
TINY = [
    "--model",
    "tiny",
    "--seq-len",
    "32",
    "--batch-size",
    "8",
    "--warmup-steps",
    "2",
    "--lr",
    "1e-2",
    "--log-every",
    "5",
    "--eval-tokens",
    "2048",
    "--sample-tokens",
    "8",
]


def _load_script():
    spec = importlib.util.spec_from_file_location("finetune", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


finetune = _load_script()


def _env() -> dict[str, str]:
    # One thread per process: the test machine's cores are shared by the ranks.
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _check_ok(procs: list[subprocess.CompletedProcess]) -> None:
    for proc in procs:
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-6000:]}"


def _torchrun(launcher_args: list[str], job_args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *launcher_args, str(SCRIPT), *job_args],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(popens: list[subprocess.Popen]) -> list[subprocess.CompletedProcess]:
    done = []
    for popen in popens:
        try:
            out, _ = popen.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for other in popens:
                other.kill()
            raise
        done.append(subprocess.CompletedProcess(popen.args, popen.returncode, out))
    _check_ok(done)
    return done


def _losses(output_dir: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_metrics(output_dir / "metrics.jsonl")}


def _heldout_losses(output_dir: Path) -> dict[int, float]:
    rows = read_metrics(output_dir / "metrics.jsonl")
    return {row["step"]: row[HELD_OUT_KEY] for row in rows if HELD_OUT_KEY in row}


def _run_main(argv: list[str]) -> dict:
    """Test body: the job's ``main`` on every rank of the already-initialised world."""
    return finetune.main(argv)


# ---------------------------------------------------------------------------------- model


def test_config_rejects_inconsistent_shapes():
    with pytest.raises(ValueError, match="must divide dim"):
        LlamaConfig(dim=30, n_heads=4)
    with pytest.raises(ValueError, match="must divide n_heads"):
        LlamaConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="positive int"):
        LlamaConfig(n_layers=0)
    with pytest.raises(ValueError, match="even head dimension"):
        LlamaConfig(dim=12, n_heads=4, n_kv_heads=2)


def test_presets_sizes_and_causality():
    assert PRESETS["12x256"].n_layers == 12 and PRESETS["12x256"].dim == 256
    with torch.device("meta"):
        assert 0.9e9 < Llama(PRESETS["1b"]).num_params < 1.1e9
    torch.manual_seed(0)
    model = Llama(PRESETS["tiny"])
    tokens = torch.randint(0, 256, (2, 12))
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 256
    logits, logits_changed = model(tokens), model(changed)
    assert logits.shape == (2, 12, PRESETS["tiny"].vocab_size)
    torch.testing.assert_close(logits[:, :7], logits_changed[:, :7], rtol=0, atol=0)
    assert not torch.allclose(logits[:, 7:], logits_changed[:, 7:])
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        model(torch.zeros(1, PRESETS["tiny"].max_seq_len + 1, dtype=torch.long))


def _sharded_matches_reference(activation_checkpointing: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Llama(PRESETS["tiny"])
    reference = copy.deepcopy(model)
    apply_fsdp(model, activation_checkpointing=activation_checkpointing)
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))
    local = tokens.chunk(world)[rank]
    loss = F.cross_entropy(model(local[:, :-1]).flatten(0, 1), local[:, 1:].flatten())
    loss.backward()
    ref_loss = F.cross_entropy(reference(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    ref_loss.backward()
    for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(
            param.grad.full_tensor(),
            ref.grad,
            atol=1e-6,
            rtol=1e-5,
            msg=lambda m, name=name: f"{name}: {m}",
        )


@pytest.mark.parametrize("activation_checkpointing", [False, True])
def test_apply_fsdp_matches_unsharded_gradients(worlds, activation_checkpointing):
    worlds.run(2, _sharded_matches_reference, activation_checkpointing=activation_checkpointing)


# ---------------------------------------------------------------------------------- data


def test_sampler_is_pure_and_independent_of_the_split():
    tokens = tokenize(["abcdefghijklmnopqrstuvwxyz" * 8, "0123456789" * 5], ByteTokenizer())
    sampler = BatchSampler(tokens, seq_len=6, global_batch=8, seed=3)
    again = BatchSampler(tokens.clone(), seq_len=6, global_batch=8, seed=3)
    whole = sampler.windows(5, 0, 8)
    for grad_accum, world in ((1, 1), (2, 2), (4, 2), (1, 8)):
        parts = [
            again.micro_batch(5, micro=m, grad_accum=grad_accum, rank=r, world_size=world)
            for m in range(grad_accum)
            for r in range(world)
        ]
        torch.testing.assert_close(torch.cat([x for x, _ in parts]), whole[:, :-1])
        torch.testing.assert_close(torch.cat([y for _, y in parts]), whole[:, 1:])
    assert not torch.equal(sampler.windows(6, 0, 8), whole)
    with pytest.raises(ValueError, match="multiple of 6"):
        sampler.micro_batch(0, micro=0, grad_accum=3, rank=0, world_size=2)
    with pytest.raises(ValueError, match="fewer than one training window"):
        BatchSampler(tokens[:5], seq_len=6, global_batch=1, seed=0)


def test_read_documents_default_corpus_and_user_files(tmp_path):
    default = read_documents()
    assert len(default) > 50 and any("def " in doc for doc in default[:5])
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.jsonl").write_text('{"text": "second"}\n\n{"text": "third"}\n')
    (tmp_path / ".hidden").write_text("skipped")
    assert read_documents(tmp_path) == ["first", "second", "third"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_documents(tmp_path / "missing")
    (tmp_path / "bad.jsonl").write_text('{"body": "no text field"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: expected a JSON object"):
        read_documents(tmp_path / "bad.jsonl")
    tokens = tokenize(["hé"], ByteTokenizer())
    assert tokens.tolist() == [*"hé".encode(), ByteTokenizer.eos_id]


def test_metrics_log_drops_rows_after_the_resume_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    row = dict.fromkeys(METRIC_KEYS, 1.0)
    log = MetricsLog(path)
    for step in range(1, 6):
        log.write({**row, "step": step})
    log.close()
    log = MetricsLog(path, resume_step=3)
    log.write({**row, "step": 4, "loss": 2.0})
    log.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [
        (1, 1.0),
        (2, 1.0),
        (3, 1.0),
        (4, 2.0),
    ]
    with pytest.raises(ValueError, match="lacks keys"):
        MetricsLog(path).write({"step": 1})


def test_warmup_then_cosine():
    factor = finetune.warmup_cosine(warmup_steps=4, max_steps=14)
    values = [factor(step) for step in range(15)]
    assert values[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert all(a >= b for a, b in itertools.pairwise(values[4:]))
    assert values[14] == pytest.approx(finetune.MIN_LR_RATIO)


# ---------------------------------------------------------------------------------- flags


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch-size", "0"], "expected a positive integer"),
        (["--model", "huge"], "invalid choice: 'huge'"),
        (["--optimizer", "nosuch"], "--optimizer 'nosuch': expected one of"),
        (["--optimizer-kwargs", "[1]"], "expected a JSON object"),
        (["--optimizer-kwargs", "{bad"], "not valid JSON"),
        (["--batch-size", "16", "--grad-accum", "3"], "not a multiple of --grad-accum 3"),
        (["--max-steps", "5", "--warmup-steps", "5"], "must be below --max-steps 5"),
        (["--max-grad-norm", "-1"], "--max-grad-norm must be a finite number >= 0"),
        (["--data", "/nonexistent/corpus.jsonl"], "--data /nonexistent/corpus.jsonl does not"),
        (["--init-from", "/nonexistent/ckpt"], "--init-from /nonexistent/ckpt does not exist"),
        (["--hf-model", "/nonexistent/model"], "no config.json there"),
        (["--lr", "nan"], "expected a finite number > 0"),
        (["--dim", "30"], "n_heads (4) must divide dim (30)"),
        (["--optimizer-kwargs", '{"betaz": 1}'], "unexpected keyword argument 'betaz'"),
        (["--optimizer-kwargs", '{"lr": 1}'], "set the learning rate with --lr"),
        (["--optimizer", "torch.optim.Nope"], "cannot import optimizer class"),
        (["--optimizer", "lbfgs"], "requires a closure"),
        (["--skip-nonfinite", "--no-in-backward"], "options of the in-backward optimizer"),
        (["--clip-grad-value", "0.5"], "pass --max-grad-norm 0 with it"),
        (["--clip-grad-value", "0"], "expected a finite number > 0"),
        (["--seq-len", "32", "--eval-tokens", "16"], "--eval-tokens 16 holds no whole sequence"),
        (["--sample-top-k", "0"], "expected a positive integer"),
        (["--eval-every", "-1"], "expected an integer >= 0"),
    ],
)
def test_bad_flags_exit_with_a_clear_message(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        finetune.main([*argv, "--output-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not dist.is_initialized()


def test_config_from_flags(tmp_path):
    out = ["--output-dir", str(tmp_path)]
    cfg = finetune.parse_args(
        ["--optimizer", "sgd", "--optimizer-kwargs", '{"momentum": 0.9}', "--no-in-backward", *out]
    )
    assert isinstance(cfg, finetune.JobConfig)
    # A class with a fused kernel on float32 weights runs it, unless a kernel is chosen.
    assert (cfg.optimizer, cfg.optimizer_kwargs) == (
        "torch.optim.SGD",
        {"momentum": 0.9, "fused": True},
    )
    assert not cfg.in_backward and cfg.output_dir == tmp_path
    for kwargs, dtype, kernel in (
        ('{"foreach": true}', "float32", {"foreach": True}),
        ("{}", "bfloat16", {}),
    ):
        chosen = finetune.parse_args(
            ["--optimizer-kwargs", kwargs, "--param-dtype", dtype, *out]
        ).optimizer_kwargs
        assert chosen == kernel, (kwargs, dtype, chosen)
    compact = finetune.parse_args(["--optimizer", "compactadamw", *out])
    assert compact.optimizer_kwargs == {}  # no fused kernel to choose
    # The default warmup fits any run; an explicit one must (see the bad-flags cases).
    for max_steps, warmup in ((1, 0), (20, 2), (300, finetune.DEFAULT_WARMUP_STEPS)):
        assert finetune.parse_args(["--max-steps", str(max_steps), *out]).warmup_steps == warmup


def test_in_backward_options_reach_the_optimizer(tmp_path):
    out = ["--output-dir", str(tmp_path), "--optimizer", "sgd", "--lr", "1", "--max-grad-norm"]
    grad = torch.tensor([2.0, -3.0, 0.1])

    def step(argv: list[str], gradient: torch.Tensor) -> tuple[torch.Tensor, object]:
        cfg = finetune.parse_args(argv)
        param = torch.nn.Parameter(torch.zeros(3))
        optim = build_optimizer(
            [param], cfg.optimizer, in_backward=cfg.in_backward, **cfg.optimizer_arguments()
        )
        (param * gradient).sum().backward()  # steps in backward
        return param.detach(), optim

    clamped, _ = step([*out, "0", "--clip-grad-value", "0.5"], grad)
    torch.testing.assert_close(clamped, -grad.clamp(-0.5, 0.5))
    clipped, _ = step([*out, "0.5"], grad)
    torch.testing.assert_close(clipped, -grad * 0.5 / grad.norm())
    poisoned, optim = step([*out, "0", "--skip-nonfinite"], grad * float("nan"))
    assert torch.equal(poisoned, torch.zeros(3)) and optim.nonfinite_steps == 1


def test_hf_flags_exclude_preset_flags(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit):
        finetune.main(["--hf-model", str(tmp_path), "--dim", "64"])
    assert "drop --model/--dim/--n-layers" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- runs


@pytest.mark.slow
def test_default_run_under_torchrun_learns_and_writes_outputs(tmp_path):
    out = tmp_path / "run"
    # The default job (small preset, stdlib corpus), shortened.
    flags = [
        "--max-steps",
        "16",
        "--seq-len",
        "64",
        "--batch-size",
        "8",
        "--warmup-steps",
        "3",
        "--output-dir",
        str(out),
    ]
    (proc,) = _finish([_torchrun(["--standalone", "--nproc-per-node", "2"], flags)])
    rows = read_metrics(out / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, 17))
    for row in rows:
        assert set(METRIC_KEYS) <= row.keys()
        assert all(np.isfinite(row[key]) for key in METRIC_KEYS)
    losses = [row["loss"] for row in rows]
    assert np.mean(losses[-3:]) < losses[0] - 0.5, losses
    assert (out / "loss.png").read_bytes()[:4] == PNG_MAGIC
    config = json.loads((out / "config.json").read_text())
    assert config["world_size"] == 2 and config["model"] == "small"
    assert checkpoint.latest(out / "checkpoints") is not None
    assert f"outputs in {out}/" in proc.stdout
    assert "fine-tuning" in proc.stdout and proc.stdout.count("outputs in") == 1  # rank 0 only


def _copy_without_last_checkpoint(source: Path, target: Path) -> None:
    """``source`` as a run interrupted after its second-to-last checkpoint would leave it."""
    shutil.copytree(source, target)
    shutil.rmtree(checkpoint.latest(target / "checkpoints"))


def _assert_losses_match(
    run: Path, reference: Path, steps: range, atol: float, same_steps: bool = True
) -> None:
    """Training losses at ``steps``, and held-out losses at those of ``steps`` the reference
    computed them at."""
    got, want = _losses(run), _losses(reference)
    if same_steps:
        assert sorted(got) == sorted(want), "the resumed run's metrics.jsonl has other steps"
    for step in steps:
        assert abs(got[step] - want[step]) <= atol, (step, got[step], want[step])
    got, want = _heldout_losses(run), _heldout_losses(reference)
    if same_steps:
        assert sorted(got) == sorted(want), "the resumed run has held-out losses at other steps"
    for step in sorted(want.keys() & set(steps)):
        assert abs(got[step] - want[step]) <= atol, ("held-out", step, got[step], want[step])


# 20 steps on 2 ranks with 2 micro-batches per step, checkpoints at steps 10 and 20 and the
# held-out loss every 5 steps. Without clipping, a resumed run must reproduce the uninterrupted
# one exactly, held-out losses included; with in-backward clipping too, as the checkpoint
# carries its history (test below).
RESUMABLE = [
    *TINY,
    "--eval-every",
    "5",
    "--max-steps",
    "20",
    "--grad-accum",
    "2",
    "--save-every",
    "10",
    "--max-grad-norm",
    "0",
]


@pytest.fixture(scope="module")
def straight_run(worlds, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("straight")
    worlds.run(2, _run_main, argv=[*RESUMABLE, "--output-dir", str(out)])
    return out


@pytest.mark.slow
def test_resume_gives_the_uninterrupted_losses(worlds, straight_run, tmp_path):
    # In-backward checkpoint at step 10, resumed in backward: the same numbers.
    resumed = tmp_path / "resumed"
    _copy_without_last_checkpoint(straight_run, resumed)
    summary, _ = worlds.run(
        2, _run_main, argv=[*RESUMABLE, "--resume", "--output-dir", str(resumed)]
    )
    assert summary["steps"] == 10
    assert sorted(_heldout_losses(straight_run)) == [5, 10, 15, 20]
    _assert_losses_match(resumed, straight_run, range(1, 21), atol=1e-6)

    # ... resumed with the plain optimizer, which writes checkpoints at 15 and 20 ...
    plain = tmp_path / "plain"
    _copy_without_last_checkpoint(straight_run, plain)
    worlds.run(
        2,
        _run_main,
        argv=[
            *RESUMABLE,
            "--resume",
            "--no-in-backward",
            "--save-every",
            "5",
            "--output-dir",
            str(plain),
        ],
    )
    _assert_losses_match(plain, straight_run, range(11, 21), atol=1e-5)

    # ... and the plain optimizer's step-15 checkpoint resumed in backward.
    back = tmp_path / "back"
    _copy_without_last_checkpoint(plain, back)
    worlds.run(2, _run_main, argv=[*RESUMABLE, "--resume", "--output-dir", str(back)])
    _assert_losses_match(back, straight_run, range(16, 21), atol=1e-5)


def test_existing_checkpoints_need_resume(straight_run, capsys):
    with pytest.raises(SystemExit):
        finetune.main([*RESUMABLE, "--output-dir", str(straight_run)])
    assert "already holds checkpoints (newest: step_" in capsys.readouterr().err


@pytest.mark.slow
def test_resume_with_clipping_in_backward_gives_the_uninterrupted_losses(worlds, tmp_path):
    clipped = [*RESUMABLE[:-2], "--max-grad-norm", "0.5"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    worlds.run(2, _run_main, argv=[*clipped, "--output-dir", str(straight)])
    _copy_without_last_checkpoint(straight, resumed)
    worlds.run(2, _run_main, argv=[*clipped, "--resume", "--output-dir", str(resumed)])
    _assert_losses_match(resumed, straight, range(1, 21), atol=1e-6)


BF16_LOSS_ATOL = 0.05
"""bf16 rounding of activations moves the tiny model's loss by about 1e-2 nats."""


@pytest.mark.slow
def test_activation_checkpointing_and_bf16_flags(worlds, straight_run, tmp_path):
    straight = _losses(straight_run)
    # Steps 1-3 do not depend on --max-steps (warmup, then the top of the cosine).
    short = [*RESUMABLE, "--max-steps", "3"]
    worlds.run(
        2,
        _run_main,
        argv=[*short, "--activation-checkpointing", "--output-dir", str(tmp_path / "ac")],
    )
    _assert_losses_match(tmp_path / "ac", straight_run, range(1, 4), atol=1e-6, same_steps=False)
    worlds.run(
        2,
        _run_main,
        argv=[*short, "--mixed-precision", "bf16", "--output-dir", str(tmp_path / "bf16")],
    )
    bf16 = _losses(tmp_path / "bf16")
    # bf16 compute really ran (step 1 differs), and two updates made from bf16 gradients train
    # like fp32 ones: losses after them agree, and fall by as much.
    assert bf16[1] != straight[1], bf16
    for step in (1, 2, 3):
        assert abs(bf16[step] - straight[step]) < BF16_LOSS_ATOL, (step, bf16, straight)
    drop, bf16_drop = straight[1] - straight[3], bf16[1] - bf16[3]
    assert drop > 4 * BF16_LOSS_ATOL and abs(bf16_drop - drop) < 0.1 * drop, (bf16, straight)
    config = json.loads((tmp_path / "bf16" / finetune.CONFIG_FILE).read_text())
    assert config["mixed_precision"] == "bf16"


@pytest.mark.slow
def test_init_from_exported_weights_or_a_checkpoint(worlds, straight_run, tmp_path):
    trained = _losses(straight_run)
    for name, source in (
        ("weights", straight_run / finetune.WEIGHTS_FILE),
        ("checkpoint", straight_run / finetune.CHECKPOINT_SUBDIR),
    ):
        out = tmp_path / name
        worlds.run(
            2,
            _run_main,
            argv=[*TINY, "--max-steps", "3", "--init-from", str(source), "--output-dir", str(out)],
        )
        # Step 1's batch is the same in both runs: the trained weights fit it much better.
        first = _losses(out)[1]
        assert first < trained[1] - 1.0 and abs(first - trained[20]) < 0.5, (name, first)
    with pytest.raises(FileNotFoundError, match="no checkpoint there"):
        finetune._init_from(tmp_path, Llama(PRESETS["tiny"]))


@pytest.mark.slow
def test_two_nodes_on_one_machine(tmp_path):
    data = tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in read_documents()[:3]))
    out = tmp_path / "run"
    flags = [*TINY, "--max-steps", "4", "--data", str(data), "--output-dir", str(out)]
    # The test hosts the rendezvous store, bound before either node starts, and both agents
    # join it as clients (is_host=0): no port is picked and released for a node to bind later.
    store = rendezvous_store()
    nodes = [
        _torchrun(
            [
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(node),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{store.port}",
                "--rdzv-conf",
                "is_host=0",
                "--rdzv-id",
                "two-nodes",
            ],
            flags,
        )
        for node in range(2)
    ]
    _finish(nodes)
    assert json.loads((out / "config.json").read_text())["world_size"] == 2
    assert sorted(_losses(out)) == [1, 2, 3, 4]
