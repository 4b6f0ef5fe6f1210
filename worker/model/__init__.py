"""Llama-family models from Hugging Face folders and GGUF files, run over a paged KV cache.

No re-exports, so that the torch-free modules (``config``, ``tokenizer``, ``gguf_file``,
``default_model``) load without torch for the router. The modules:

* ``runner.ModelRunner(model_dir, dtype=..., device=..., block_size=..., num_blocks=...,
  kv_memory_bytes=..., attn_backend=...)`` with ``num_blocks``, ``copy_blocks(pairs)``,
  ``build_input(seqs)`` and ``execute(model_input) -> logits``;
* ``inputs.ModelInput`` / ``inputs.SeqChunk``: the flat step batch and its builder;
* ``config.ModelConfig``: parsed ``config.json``; ``tokenizer.Tokenizer``: encode/decode/chat;
* ``build_tiny.build_tiny_model(out_dir, family, size, seed)``: random-weight model, offline;
* ``default_model.resolve_default_model()``: the default model (SmolLM2-135M-Instruct GGUF);
* ``errors``: ``ModelLoadError`` > ``UnsupportedModelError``, ``WeightMismatchError``.
"""
