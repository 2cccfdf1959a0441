"""The fine-tuning application built on ``fused_optim_dist``: what the job, the benchmarks and
the tests share, kept apart from the library (extra ``[recipes]``: matplotlib, transformers).

* ``models``: a Llama-style decoder with presets, and ``apply_fsdp`` (one FSDP2 unit a block).
* ``data``: text corpora, tokenizers, and a batch sampler that is a pure function of the step.
* ``metrics``: the progress line, ``metrics.jsonl``, the loss plot, memory and machine probes.
* ``hf``: local Hugging Face causal LMs, loaded shard by shard onto an FSDP2 mesh.
* ``launch``: one process per rank on this machine, for benchmarks and tests.
"""
