"""Train the byte-level BPE tokenizer of the tiny models (deterministic, offline, < 1 s)."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from worker.model.corpus import CORPUS

# Ids 0..4, in this order, in every tiny tokenizer.
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")


def train_tokenizer(vocab_size: int, add_bos: bool) -> Tokenizer:
    """A byte-level BPE with exactly ``vocab_size`` ids.

    Merges are learnt on the embedded corpus; ids the corpus cannot fill are reserved special
    tokens ``<|reserved_N|>`` (as in Llama 3), so every id the model can emit decodes.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in CORPUS.splitlines() if line.strip()]
    tok.train_from_iterator(lines, trainer)
    missing = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    byte_level = processors.ByteLevel(trim_offsets=False)
    if add_bos:
        bos = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
        tok.post_processor = processors.Sequence([byte_level, bos])
    else:
        tok.post_processor = byte_level
    return tok
