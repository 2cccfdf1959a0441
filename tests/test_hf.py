"""Hugging Face causal LMs: sharded loading (values and host memory) and the fine-tuning job.

Every model is made here with ``save_pretrained``; nothing is downloaded.
"""

from __future__ import annotations

import gc
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_finetune import REPO, RUN_TIMEOUT_S, SCRIPT, _env, _losses

from fused_optim_dist_recipes import hf
from fused_optim_dist_recipes.data import ByteTokenizer, read_documents
from fused_optim_dist_recipes.launch import spawn
from fused_optim_dist_recipes.metrics import KIB
from fused_optim_dist_recipes.models import apply_fsdp

transformers = pytest.importorskip("transformers")

MIB = KIB * KIB
LOAD_RANKS = 2
SHARDED_PEAK_BOUND = 1.5
"""A rank's peak growth while loading, over its share of the parameter bytes: the shards, plus
FSDP2's bookkeeping and the allocator's slack."""
LLAMA = dict(
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
"""What every test model shares: a 2-layer Llama with grouped-query attention."""
MEMORY_MODEL = {**LLAMA, "vocab_size": 16384, "hidden_size": 256, "intermediate_size": 512}
"""Embeddings and head dominate: 2 x 16384 x 256 of the 9.6M parameters (36.5 MiB in fp32)."""
SMALL_MODEL = {**LLAMA, "vocab_size": 320, "hidden_size": 32, "intermediate_size": 64}
"""Room for the 300 ids of the test tokenizer."""


def _tiny_hf_model(directory: Path, texts: list[str]) -> None:
    """A 2-layer Llama with a BPE tokenizer trained on ``texts``, saved to ``directory``."""
    tokenizers = pytest.importorskip("tokenizers")
    byte_level = tokenizers.pre_tokenizers.ByteLevel
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = byte_level(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "</s>"], initial_alphabet=byte_level.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer)
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(directory)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL_MODEL)).save_pretrained(
        directory
    )


# ---------------------------------------------------------------------------------- loading


def _status_kib(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE).group(1))


def _host_peak_growth(build):
    """``build()`` and how far it raised this process's peak resident set size, in bytes.

    Writing 5 to ``/proc/self/clear_refs`` resets the peak (``VmHWM``) to the current RSS.
    """
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    result = build()
    return result, (_status_kib("VmHWM") - before) * KIB


def _sharded_load(directory: str) -> torch.nn.Module:
    model = hf.empty_causal_lm(directory)
    apply_fsdp(model, blocks=hf.decoder_blocks(model))
    hf.load_local_shards(model, directory, torch.device("cpu"))
    return model


def _full_load(directory: str) -> torch.nn.Module:
    """What ``--hf-model`` did before: every rank loads the whole model, then shards it."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, local_files_only=True
    )
    apply_fsdp(model, blocks=hf.decoder_blocks(model))
    return model


def _load_both_ways(directory: str) -> list[dict[str, int]]:
    """Rank body: load sharded, then whole; check they agree; every rank's peak growth."""
    # Import what both paths need first (a model on meta costs no memory), so neither pays.
    hf.empty_causal_lm(directory)
    sharded, sharded_peak = _host_peak_growth(lambda: _sharded_load(directory))
    full, full_peak = _host_peak_growth(lambda: _full_load(directory))
    for (name, ours), (_, reference) in zip(
        sharded.state_dict().items(), full.state_dict().items(), strict=True
    ):
        ours = ours.to_local() if hasattr(ours, "to_local") else ours
        reference = reference.to_local() if hasattr(reference, "to_local") else reference
        torch.testing.assert_close(ours, reference, rtol=0, atol=0, msg=name)
    tokens = torch.randint(0, MEMORY_MODEL["vocab_size"], (2, 16))
    torch.testing.assert_close(hf.hf_logits(sharded, tokens), hf.hf_logits(full, tokens))
    param_bytes = sum(p.numel() * p.element_size() for p in full.parameters())
    row = {"sharded": sharded_peak, "full": full_peak, "param_bytes": param_bytes}
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    return rows


@pytest.mark.slow
def test_sharded_load_matches_full_load_in_a_fraction_of_host_memory(tmp_path, monkeypatch):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**MEMORY_MODEL)).save_pretrained(
        tmp_path
    )
    # A fixed mmap threshold: every large buffer is mapped when allocated and unmapped when
    # freed, so freed memory is not silently reused and peaks are measured, not hidden.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(64 * KIB))
    rows = spawn(LOAD_RANKS, _load_both_ways, str(tmp_path))
    param_bytes = rows[0]["param_bytes"]
    for rank, row in enumerate(rows):
        print(
            f"rank {rank}: peak host memory growth, sharded {row['sharded'] / MIB:.1f} MiB, "
            f"full {row['full'] / MIB:.1f} MiB (parameters {param_bytes / MIB:.1f} MiB)"
        )
        # Its shards (half the parameters) and little else; the full load holds the whole model.
        assert row["sharded"] < SHARDED_PEAK_BOUND * param_bytes / LOAD_RANKS, row
        assert row["full"] > param_bytes, row


def test_loader_names_missing_and_misshapen_tensors(tmp_path):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL_MODEL)).save_pretrained(tmp_path)
    model = hf.empty_causal_lm(tmp_path)
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers()), "RoPE's inv_freq must stay real"
    hf.load_local_shards(model, tmp_path, torch.device("cpu"))
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    for (name, ours), (_, theirs) in zip(
        model.state_dict().items(), reference.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=name)

    transformers.LlamaConfig(**{**SMALL_MODEL, "intermediate_size": 96}).save_pretrained(tmp_path)
    with pytest.raises(
        ValueError, match=r"mlp\.gate_proj\.weight: \(64, 32\) in .* \(96, 32\) in the model"
    ):
        hf.load_local_shards(hf.empty_causal_lm(tmp_path), tmp_path, torch.device("cpu"))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"neither model\.safetensors nor"):
        hf.load_local_shards(hf.empty_causal_lm(tmp_path), tmp_path, torch.device("cpu"))


# ---------------------------------------------------------------------------------- the job


@pytest.mark.slow
def test_hf_model_fine_tunes_with_its_tokenizer(tmp_path):
    texts = read_documents()[:4]
    model_dir, data_dir, out = tmp_path / "model", tmp_path / "data", tmp_path / "run"
    _tiny_hf_model(model_dir, texts)
    data_dir.mkdir()
    for index, text in enumerate(texts):
        (data_dir / f"{index}.txt").write_text(text)
    # Plain `python`, one process: the launcher path without torchrun.
    flags = ["--seq-len", "32", "--batch-size", "8", "--max-steps", "8", "--lr", "1e-2",
             "--eval-every", "4", "--sample-tokens", "16", "--sample-prompt", "def "]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--hf-model", str(model_dir), "--data", str(data_dir),
         *flags, "--output-dir", str(out)],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    losses = _losses(out)
    assert losses[8] < losses[1] - 0.3, losses
    from safetensors.torch import load_file

    before = load_file(model_dir / "model.safetensors")
    after = load_file(out / "hf_model" / "model.safetensors")
    assert before.keys() == after.keys()
    assert not torch.equal(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"])
    assert (out / "hf_model" / "tokenizer.json").is_file()
    # The held-out loss, and samples before and after (the prompt encoded and decoded with the
    # directory's BPE tokenizer comes back as it was).
    summary = json.loads((out / "summary.json").read_text())
    assert [step for step, _ in summary["heldout_losses"]] == [4, 8]
    assert [texts["step"] for texts in summary["samples"]] == [0, 8]
    for texts in summary["samples"]:
        assert texts["greedy"].startswith("def ")
        assert texts["greedy"] in (out / "samples.txt").read_text()


def test_hf_directory_without_tokenizer_uses_bytes(tmp_path):
    assert isinstance(hf.load_tokenizer(tmp_path, model_vocab_size=300), ByteTokenizer)
    with pytest.raises(ValueError, match="model's vocabulary has 200 ids"):
        hf.load_tokenizer(tmp_path, model_vocab_size=200)
