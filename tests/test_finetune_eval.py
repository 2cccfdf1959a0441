"""The fine-tuning job's held-out loss and samples: the split, the reduction over ranks, the
generation on a sharded model, and the job's outputs on 1 and 2 ranks.

Distributed bodies run in the session's persistent worlds; every figure is compared with a
single-process computation on an unsharded copy of the same model.
"""

from __future__ import annotations

import copy
import io
import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_finetune import PNG_MAGIC, TINY, _heldout_losses, _run_main, finetune

from fused_optim_dist_recipes.data import ByteTokenizer, split_held_out
from fused_optim_dist_recipes.evaluation import evaluating, generate, held_out_loss
from fused_optim_dist_recipes.metrics import HELD_OUT_KEY, ProgressLine, plot_loss_curve
from fused_optim_dist_recipes.models import PRESETS, Llama, apply_fsdp

EOS = 0
LOSS_RTOL = 1e-6
"""Float32 forward passes over differently sized batches agree to about this; the sums over
tokens and ranks are in float64."""
CROSS_WORLD_RTOL = 1e-5
"""Two training steps on 1 and 2 ranks reduce gradients in another order: losses agree to this."""


# ---------------------------------------------------------------------------------- the split


def test_held_out_block_is_fixed_by_the_seed_and_never_trained_on():
    tokens = torch.arange(1, 1001)  # every id once: where a token went shows
    train, windows = split_held_out(tokens, held_out_tokens=100, seq_len=16, seed=3, eos_id=EOS)
    again, same = split_held_out(
        tokens.clone(), held_out_tokens=100, seq_len=16, seed=3, eos_id=EOS
    )
    assert torch.equal(train, again) and torch.equal(windows, same)
    # 100 tokens hold 6 sequences of 16: windows of 17 overlapping by one token, so the block of
    # 97 consecutive tokens is every window's first 16 tokens and the last window's last.
    assert windows.shape == (6, 17)
    block = torch.cat([windows[:, :-1].flatten(), windows[-1, -1:]])
    assert torch.equal(block, torch.arange(block[0], block[0] + 97))
    assert torch.equal(windows[1:, 0], windows[:-1, -1])
    # The rest trains, joined by one end-of-document id, and no held-out token is in it.
    assert train.numel() == 1000 - 97 + 1 and (train == EOS).sum() == 1
    assert torch.equal(torch.sort(torch.cat([train[train != EOS], block])).values, tokens)
    _, elsewhere = split_held_out(tokens, held_out_tokens=100, seq_len=16, seed=4, eos_id=EOS)
    assert not torch.equal(elsewhere, windows)
    with pytest.raises(ValueError, match="holds no whole sequence of 16 tokens"):
        split_held_out(tokens, held_out_tokens=15, seq_len=16, seed=0, eos_id=EOS)
    with pytest.raises(ValueError, match="holding out 993 leaves 7, fewer than one training"):
        split_held_out(tokens, held_out_tokens=992, seq_len=16, seed=0, eos_id=EOS)


def test_byte_tokenizer_round_trip_and_partial_characters():
    tokenizer = ByteTokenizer()
    text = "def f():\n    return 'é'\n"
    assert tokenizer.decode([*tokenizer.encode(text), tokenizer.eos_id]) == text
    assert tokenizer.decode(list(tokenizer.encode("é"))[:1]) == "\ufffd"


def test_progress_line_always_shows_a_held_out_loss_and_the_plot_draws_it(tmp_path):
    rows = [
        {"step": step, "loss": 3.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0,
         "peak_mem_bytes": 1} | ({HELD_OUT_KEY: 2.5} if step == 3 else {})
        for step in range(1, 6)
    ]  # fmt: skip
    stream = io.StringIO()
    progress = ProgressLine(5, every=2, stream=stream)
    for row in rows:
        progress.update(row)
    lines = stream.getvalue().splitlines()
    assert [line.split("|")[0].strip() for line in lines] == ["step 2/5", "step 3/5", "step 4/5",
                                                              "step 5/5"]  # fmt: skip
    assert "| held-out 2.5000 |" in lines[1] and "held-out" not in lines[0] + lines[2]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert plot_loss_curve(metrics, tmp_path / "loss.png").read_bytes()[:4] == PNG_MAGIC


# ---------------------------------------------------------------------------------- on ranks

PROMPT = list(b"def main():\n")
NEW_TOKENS = 12
CONTEXT = 16
"""Shorter than prompt + generated text, so the context window slides."""


def _reference_greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    """Greedy decoding in one process, written out independently of ``generate``."""
    tokens = list(prompt)
    for _ in range(NEW_TOKENS):
        logits = model(torch.tensor([tokens[-CONTEXT:]]))[0, -1, : ByteTokenizer.vocab_size]
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :]


def _evaluate_body() -> dict:
    """Rank body: held-out loss and samples of a sharded tiny Llama, with the single-process
    reference computed on an unsharded copy."""
    torch.manual_seed(0)
    model = Llama(PRESETS["tiny"])
    reference = copy.deepcopy(model)
    apply_fsdp(model)
    windows = torch.randint(0, 256, (5, 9), generator=torch.Generator().manual_seed(1))
    out: dict = {"losses": {}, "reference_losses": {}}
    cpu = torch.device("cpu")
    with evaluating(model), evaluating(reference):
        # (windows, batch size): 5 windows on 2 ranks are slices of 3 and 2, one batch short;
        # 3 windows in batches of 1 leave rank 1 a pass with no window of its own.
        for count, batch_size in ((5, 2), (3, 1), (1, 4)):
            some = windows[:count]
            out["losses"][count, batch_size] = held_out_loss(
                model, some, batch_size=batch_size, device=cpu
            )
            targets = some[:, 1:].flatten()
            out["reference_losses"][count, batch_size] = F.cross_entropy(
                reference(some[:, :-1]).flatten(0, 1), targets
            ).item()
        common = dict(
            max_new_tokens=NEW_TOKENS,
            context=CONTEXT,
            vocab_size=ByteTokenizer.vocab_size,
            eos_id=ByteTokenizer.eos_id,
            device=cpu,
        )
        out["greedy"] = generate(model, PROMPT, **common)
        out["reference_greedy"] = _reference_greedy(reference, PROMPT)
        out["top_k"] = generate(model, PROMPT, top_k=5, seed=7, **common)
        out["top_k_again"] = generate(model, PROMPT, top_k=5, seed=7, **common)
        out["top_k_other_seed"] = generate(model, PROMPT, top_k=5, seed=8, **common)
    assert model.training, "evaluating() restores training mode"
    out["rank"] = dist.get_rank()
    return out


def test_held_out_loss_and_generation_match_one_process_on_any_world_size(worlds):
    results = [*worlds.run(1, _evaluate_body), *worlds.run(2, _evaluate_body)]
    first = results[0]
    for result in results:
        # The mean over the whole split, whatever the slices and the batches.
        for key, loss in result["losses"].items():
            assert loss == pytest.approx(result["reference_losses"][key], rel=LOSS_RTOL), key
            assert loss == pytest.approx(first["losses"][key], rel=LOSS_RTOL), key
        assert result["greedy"] == result["reference_greedy"] == first["greedy"]
        assert len(result["greedy"]) == NEW_TOKENS
        assert result["top_k"] == result["top_k_again"] == first["top_k"]
    assert first["top_k_other_seed"] != first["top_k"]


# ---------------------------------------------------------------------------------- the job


@pytest.mark.slow
def test_job_reports_held_out_loss_and_samples_equal_on_one_and_two_ranks(worlds, corpus, tmp_path):
    flags = [
        *TINY,
        *("--data", str(corpus), "--max-steps", "4", "--eval-every", "3"),
        *("--sample-tokens", "12", "--sample-top-k", "4", "--sample-prompt", "import "),
    ]
    summaries = {}
    for world_size in (1, 2):
        out = tmp_path / f"ranks{world_size}"
        summary, *others = worlds.run(
            world_size, _run_main, argv=[*flags, "--output-dir", str(out)]
        )
        for other in others:  # timings and memory are each rank's own
            assert other["heldout_losses"] == summary["heldout_losses"]
            assert other["samples"] == summary["samples"]
        summaries[world_size] = summary
        # Every 3 steps and at the end, in metrics.jsonl as in the summary.
        assert [step for step, _ in summary["heldout_losses"]] == [3, 4]
        assert _heldout_losses(out) == dict(summary["heldout_losses"])
        # Before and after training, greedy and top-k, in the file and the summary.
        assert [texts["step"] for texts in summary["samples"]] == [0, 4]
        written = (out / finetune.SAMPLES_FILE).read_text()
        for texts in summary["samples"]:
            for kind in ("greedy", "top_k"):
                assert texts[kind].startswith("import ") and texts[kind] in written
    one, two = summaries[1], summaries[2]
    for (step, loss), (step_two, loss_two) in zip(
        one["heldout_losses"], two["heldout_losses"], strict=True
    ):
        assert step == step_two and loss == pytest.approx(loss_two, rel=CROSS_WORLD_RTOL)
    assert [t["greedy"] for t in one["samples"]] == [t["greedy"] for t in two["samples"]]
    # Training changed what the model writes.
    assert one["samples"][0]["greedy"] != one["samples"][1]["greedy"]
