"""The model as the engine sees it: block-table batches in, next-token logits out."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvstore.blocks.hashing import DEFAULT_BLOCK_SIZE
from worker.engine.detokenizer import TokenizerLike
from worker.engine.sampler import token_logprobs
from worker.engine.sched_output import ScheduledChunk
from worker.kv import TierTransfers
from worker.kv.transfer import KVLayout
from worker.model.lora_config import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS

if TYPE_CHECKING:
    from worker.model.lora import LoraAdapter
    from worker.model.runner import ModelRunner


class ModelExecutor(ABC):
    """Runs scheduled chunks through a model whose KV lives in the engine's block pool.

    Executor's obligations: ``num_blocks``/``block_size`` describe its KV tensors; a chunk's
    K/V are written into the slots its block table names before anything attends to them;
    ``execute`` returns float32 logits, one row per chunk with ``wants_logits``, in order.
    Caller's obligations: ``copy_blocks`` runs the KV manager's copy-on-write pairs before the
    ``execute`` that needs them; block tables cover every chunk's ``start + num_tokens``.
    """

    block_size: int
    num_blocks: int
    vocab_size: int
    max_model_len: int  # longest context the model supports
    eos_token_ids: tuple[int, ...]
    tokenizer: TokenizerLike | None
    num_host_blocks: int = 0  # host KV tier blocks (0: no host tier, so no transfers)
    max_loras: int = 0  # LoRA adapter slots (0: serves the base model only)
    # seconds of ``execute`` so far spent building the model input before the model ran (the
    # engine's ``prepare`` stage); an executor that does not tell leaves it 0
    prepare_seconds: float = 0.0

    @abstractmethod
    def swap(self, transfers: TierTransfers) -> None:
        """Run the host tier's copies: ``to_host`` (device -> host) first, then ``to_device``
        (host -> device), each as one batched copy. The KV manager produces transfers only
        when ``num_host_blocks`` > 0."""

    @abstractmethod
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole KV blocks src -> dst (all sources read before any write)."""

    @abstractmethod
    def execute(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Compute the chunks; logits [rows, vocab_size], float32, on the model's device (the
        sampler runs there): one row per chunk wanting logits, ``num_tokens`` rows for a
        chunk carrying drafts (row j predicts the token after its j-th token)."""

    @abstractmethod
    def add_lora(self, name: str, path: str) -> str:
        """Register a PEFT adapter folder under ``name``; return its stable adapter id.
        A chunk whose request names the adapter (``params.lora``) runs with it. The engine
        calls it only when ``max_loras`` > 0."""

    @abstractmethod
    def remove_lora(self, name: str) -> None:
        """Forget the adapter ``name`` and free its device slot. The engine calls it only
        for a name ``add_lora`` registered, after ending the requests that use it (no later
        chunk names it)."""

    def loaded_loras(self) -> list[str]:
        """Names of the adapters in device slots now (engine thread)."""
        return []

    # Block runs (``worker/kv/transfer.py``). An executor whose ``kv_layout`` is None holds
    # KV in no exchangeable layout: the engine neither exports nor imports for it.
    kv_layout: KVLayout | None = None

    def read_run(self, device_ids: Sequence[int], host_ids: Sequence[int]) -> object:
        """The KV of device blocks then host blocks, as one payload (between steps)."""
        raise KVTransferUnsupported(type(self).__name__)

    def check_run(self, payload: object, n_blocks: int) -> object:
        """``payload`` if it holds ``n_blocks`` intact blocks of ``kv_layout``; else raise
        ``ImportRefused``."""
        raise KVTransferUnsupported(type(self).__name__)

    def write_run(self, host: bool, block_ids: Sequence[int], payload: object, offset: int) -> None:
        """Write a checked payload's blocks ``offset..`` into device (``host``: host) blocks."""
        raise KVTransferUnsupported(type(self).__name__)


class KVTransferUnsupported(RuntimeError):
    """This executor has no exchangeable KV layout (``kv_layout`` is None)."""

    def __init__(self, executor: str) -> None:
        super().__init__(f"{executor} cannot export or import KV blocks")
        self.executor = executor  # the executor's class name

    def __reduce__(self) -> tuple:  # Ray moves it between processes: rebuilt from its fields
        return type(self), (self.executor,), self.__dict__


class RunnerExecutor(ModelExecutor):
    """:class:`worker.model.runner.ModelRunner` behind the executor interface."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: TokenizerLike | None,
        *,
        max_loras: int = DEFAULT_MAX_LORAS,
        max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
    ) -> None:
        from worker.engine.input_batch import InputBatch  # local: keep engine imports light

        self.runner = runner
        # the running sequences' rows of the model input, kept from step to step
        self._batch = InputBatch(runner.block_size, runner.device)
        cfg = runner.config
        self.block_size = runner.block_size
        self.num_blocks = runner.num_blocks
        self.vocab_size = cfg.vocab_size
        self.max_model_len = cfg.max_position_embeddings
        eos = list(cfg.eos_token_ids)
        if tokenizer is not None:
            eos += list(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.eos_token_ids = tuple(dict.fromkeys(eos))
        self.tokenizer = tokenizer
        self.num_host_blocks = runner.num_host_blocks
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self._loras: dict[str, LoraAdapter] = {}  # registered adapters (host weights)

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int | None = None,
        kv_memory_bytes: int | None = None,
        attn_backend: str = "auto",
        cuda_graph_max_batch: int = 0,
        host_kv_bytes: int = 0,
        max_loras: int = DEFAULT_MAX_LORAS,
        max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
    ) -> RunnerExecutor:
        from kvstore.runtime.pauses import freeze_long_lived
        from worker.model.runner import ModelRunner
        from worker.model.tokenizer import Tokenizer

        runner = ModelRunner(
            model_dir,
            dtype=dtype,
            device=device,
            block_size=block_size,
            num_blocks=num_blocks,
            kv_memory_bytes=kv_memory_bytes,
            attn_backend=attn_backend,
            cuda_graph_max_batch=cuda_graph_max_batch,
            host_kv_bytes=host_kv_bytes,
        )
        tokenizer = Tokenizer.from_dir(model_dir)
        # The model and its libraries live as long as the engine: no full-heap GC scans of them
        freeze_long_lived()
        return cls(runner, tokenizer, max_loras=max_loras, max_lora_rank=max_lora_rank)

    def add_lora(self, name: str, path: str) -> str:
        from worker.model.lora import LoraError, load_adapter

        runner = self.runner
        adapter = load_adapter(name, path, runner.config, self.max_lora_rank, runner.dtype)
        old = self._loras.get(name)
        if old is not None and old.adapter_id != adapter.adapter_id:
            raise LoraError(
                f"adapter {name!r} is registered with other weights "
                f"({old.adapter_id}); register the new ones under a new name"
            )
        self.runner.enable_lora(self.max_loras, self.max_lora_rank)
        self._loras[name] = adapter
        return adapter.adapter_id

    def remove_lora(self, name: str) -> None:
        del self._loras[name]
        if self.runner.lora is not None:
            self.runner.lora.drop(name)

    def adapter(self, name: str) -> LoraAdapter:
        """The registered adapter ``name`` (its host weights)."""
        return self._loras[name]

    def loaded_loras(self) -> list[str]:
        return list(self.runner.lora.slot_of) if self.runner.lora is not None else []

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        self.runner.copy_blocks(pairs)

    @property
    def kv_layout(self) -> KVLayout:  # type: ignore[override]
        return self.runner.kv_layout

    def read_run(self, device_ids: Sequence[int], host_ids: Sequence[int]) -> object:
        return self.runner.read_run(device_ids, host_ids)

    def check_run(self, payload: object, n_blocks: int) -> object:
        from worker.model.kv_run import check_payload

        return check_payload(payload, self.runner.kv_layout, n_blocks)

    def write_run(self, host: bool, block_ids: Sequence[int], payload: object, offset: int) -> None:
        self.runner.write_run(host, block_ids, payload, offset)  # type: ignore[arg-type]

    def swap(self, transfers: TierTransfers) -> None:
        self.runner.swap_out(transfers.to_host)
        self.runner.swap_in(transfers.to_device)

    def execute(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        t0 = time.perf_counter()
        wants = [_wanted(c) for c in chunks]
        adapters = (
            [self._loras[c.req.params.lora] if c.req.params.lora else None for c in chunks]
            if self._loras
            else None
        )
        batch = self._batch.build(chunks, wants)
        self.prepare_seconds += time.perf_counter() - t0
        # Logits stay on the runner's device: the sampler works there and sends back only ids.
        logits = self.runner.execute(batch, adapters).float()
        if "all" not in wants:
            return logits
        return _take_prompt_logprobs(chunks, wants, logits)


def _wanted(c: ScheduledChunk) -> str:
    """A chunk of a prompt whose logprobs were asked for wants every position's logits, and
    a chunk verifying drafts one row per draft and one for the token after them."""
    if c.drafts:
        return "all"
    prompt = c.req.prompt_logprobs
    if prompt is not None and c.start < len(prompt) and len(c.token_ids) > 0:
        return "all"
    return "last" if c.wants_logits else "none"


def _take_prompt_logprobs(
    chunks: Sequence[ScheduledChunk], wants: list[str], logits: torch.Tensor
) -> torch.Tensor:
    """Record the prompt logprobs of the chunks that wanted every position (row j of a
    chunk predicts the token at start + j + 1) and return one row per chunk that wants its
    next token, as :meth:`ModelExecutor.execute` promises."""
    keep: list[int] = []
    row = 0
    for c, want in zip(chunks, wants, strict=True):
        if want == "none":
            continue
        if want == "last":
            keep.append(row)
            row += 1
            continue
        n, prompt = c.num_tokens, c.req.prompt_logprobs
        if c.drafts:
            keep.extend(range(row, row + n))
            row += n
            continue
        assert prompt is not None
        ids = c.req.prompt_ids
        upto = min(c.start + n, len(ids) - 1)  # positions start+1 .. upto are prompt tokens
        if upto > c.start:
            targets = ids[c.start + 1 : upto + 1]
            k = c.req.params.prompt_logprobs or 0
            for j, lp in enumerate(token_logprobs(logits[row : row + len(targets)], targets, k)):
                prompt[c.start + 1 + j] = lp
        if c.wants_logits:
            keep.append(row + n - 1)
        row += n
    assert row == logits.shape[0], (row, logits.shape)
    return logits.index_select(0, torch.tensor(keep, dtype=torch.long, device=logits.device))
