"""ModelRunner: a loaded model, its paged KV cache and one ``execute`` per engine step.

The runner knows nothing about requests. Per step the engine (1) asks the KV manager for
blocks, (2) calls ``copy_blocks`` with the manager's copy-on-write pairs, (3) builds a
``ModelInput`` (usually with ``ModelInput.build``) and (4) calls ``execute`` to get the
logits of the rows it asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from kvstore.blocks.hashing import DEFAULT_BLOCK_SIZE
from worker.attention import create_backend
from worker.attention.base import AttentionMetadata
from worker.kv.transfer import KVLayout
from worker.model.config import ModelConfig
from worker.model.cuda_graphs import DEFAULT_BUCKETS, DecodeGraphs
from worker.model.heap import keep_freed_memory
from worker.model.host_kv import HostKVCache
from worker.model.inputs import ModelInput, SeqChunk
from worker.model.kv_run import KVPayload, layout_of, read_run, write_run
from worker.model.loader import load_model, resolve_dtype
from worker.model.lora import LoraAdapter
from worker.model.lora_slots import LoraSlots

__all__ = ["ModelInput", "ModelRunner", "SeqChunk", "KVCacheSizeError"]

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 256 * 2**20  # KV budget on CPU when neither size is given
DEFAULT_GPU_KV_FRACTION = 0.85  # of the device memory still free after loading the weights


class KVCacheSizeError(ValueError):
    """The KV budget is invalid or too small for one block."""


class ModelRunner:
    """Owns the model and, per layer, K and V of shape
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` (zero-initialised)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int | None = None,
        kv_memory_bytes: int | None = None,
        attn_backend: str = "auto",
        cuda_graph_max_batch: int = 0,
        host_kv_bytes: int = 0,
    ) -> None:
        if block_size < 1:
            raise KVCacheSizeError(f"block_size={block_size} must be >= 1")
        if num_blocks is not None and kv_memory_bytes is not None:
            raise KVCacheSizeError("give num_blocks or kv_memory_bytes, not both")
        self.model_dir = Path(model_dir)
        self.config = cfg = ModelConfig.from_dir(model_dir)
        self.device = torch.device(device)
        if self.device.type == "cpu":
            keep_freed_memory()  # a step's activations are reused, not page-faulted in again
        self.dtype = resolve_dtype(dtype)
        self.block_size = block_size
        self.backend = create_backend(
            attn_backend,
            device=self.device,
            block_size=block_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            scale=cfg.attention_scale,
        )
        self.model = load_model(
            model_dir, self.backend, dtype=self.dtype, device=self.device, config=cfg
        )
        self.lora: LoraSlots | None = None  # adapter slots, made by enable_lora
        self._num_blocks = self._size_cache(num_blocks, kv_memory_bytes)
        no_graphs = DecodeGraphs.supported(self.device, self.backend.name)
        use_graphs = cuda_graph_max_batch > 0 and no_graphs is None
        if cuda_graph_max_batch > 0 and not use_graphs:
            log.info("CUDA graphs off: %s", no_graphs)
        # With graphs, one extra block past num_blocks takes the padded rows' K/V writes.
        physical = self._num_blocks + (1 if use_graphs else 0)
        shape = (physical, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(cfg.num_layers)
        ]
        if host_kv_bytes < 0:
            raise KVCacheSizeError(f"host_kv_bytes={host_kv_bytes} must be >= 0")
        # Host tier: same block layout in host memory (pinned on CUDA, copies overlapped).
        self.host_kv = HostKVCache(
            host_kv_bytes // self.bytes_per_block,
            shape[1:],
            cfg.num_layers,
            dtype=self.dtype,
            device=self.device,
        )
        self.graphs: DecodeGraphs | None = None
        if use_graphs:
            self.graphs = self._capture_graphs(cuda_graph_max_batch)

    def _logits_of_all_rows(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.model(input_ids, positions, self.kv_caches, self.backend.prepare(meta))
        return self.model.compute_logits(hidden)

    def _capture_graphs(self, max_batch: int) -> DecodeGraphs | None:
        """Graphs for decode batches of up to ``max_batch`` sequences (the engine's
        ``max_num_seqs``); None, with the reason logged, if capture fails."""
        buckets = [b for b in DEFAULT_BUCKETS if b < max_batch] + [max_batch]
        graphs = DecodeGraphs(
            self._logits_of_all_rows,
            device=self.device,
            block_size=self.block_size,
            max_blocks_per_seq=-(-self.config.max_position_embeddings // self.block_size),
            pad_block=self._num_blocks,
            buckets=buckets,
        )
        try:
            with torch.inference_mode():
                graphs.capture_all()
        except Exception:  # a failed capture costs speed, never correctness
            log.exception("CUDA graph capture failed; decode steps run eagerly")
            return None
        return graphs

    @property
    def num_blocks(self) -> int:
        """Physical KV blocks per layer: the KV manager's pool size."""
        return self._num_blocks

    @property
    def bytes_per_block(self) -> int:
        """Memory of one block across all layers, K and V."""
        cfg = self.config
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * elem

    def _size_cache(self, num_blocks: int | None, kv_memory_bytes: int | None) -> int:
        if num_blocks is not None:
            if num_blocks < 1:
                raise KVCacheSizeError(f"num_blocks={num_blocks} must be >= 1")
            return num_blocks
        if kv_memory_bytes is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                kv_memory_bytes = int(free * DEFAULT_GPU_KV_FRACTION)
            else:
                kv_memory_bytes = DEFAULT_CPU_KV_BYTES
        blocks = kv_memory_bytes // self.bytes_per_block
        if blocks < 1:
            raise KVCacheSizeError(
                f"kv_memory_bytes={kv_memory_bytes} is below one block "
                f"({self.bytes_per_block} bytes at block_size={self.block_size})"
            )
        return blocks

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (the KV manager's copy-on-write).

        All sources are read before any destination is written, so the pairs act at once.
        """
        if not pairs:
            return
        flat = [b for pair in pairs for b in pair]
        if min(flat) < 0 or max(flat) >= self._num_blocks:
            raise ValueError(f"copy_blocks: block ids must be in [0, {self._num_blocks}): {pairs}")
        dst_ids = [d for _, d in pairs]
        if len(set(dst_ids)) != len(dst_ids):
            raise ValueError(f"copy_blocks: a destination block appears twice: {pairs}")
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor(dst_ids, dtype=torch.long, device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
            v_cache.index_copy_(0, dst, v_cache.index_select(0, src))

    @property
    def num_host_blocks(self) -> int:
        """Blocks of the host KV tier (0: no tier)."""
        return self.host_kv.num_blocks

    @property
    def host_kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the host tier's K and V, with every offload in flight landed."""
        self.host_kv.flush()
        return self.host_kv.caches

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks, ``(device, host)`` pairs (offloads). The device
        blocks may be reused by the next operation (see ``worker/model/host_kv.py``)."""
        if not pairs:
            return
        dev, host = self._pair_index(pairs, "swap_out", self._num_blocks, self.num_host_blocks)
        self.host_kv.offload(self.kv_caches, dev, host)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy host blocks back into device blocks, ``(host, device)`` pairs (loads); later
        work on the current stream sees them (see ``worker/model/host_kv.py``)."""
        if not pairs:
            return
        host, dev = self._pair_index(pairs, "swap_in", self.num_host_blocks, self._num_blocks)
        self.host_kv.load(self.kv_caches, host, dev)

    @staticmethod
    def _pair_index(
        pairs: Sequence[tuple[int, int]], what: str, n_src: int, n_dst: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        src = [s for s, _ in pairs]
        dst = [d for _, d in pairs]
        if min(src) < 0 or max(src) >= n_src or min(dst) < 0 or max(dst) >= n_dst:
            raise ValueError(f"{what}: block ids out of range ({n_src} -> {n_dst}): {pairs}")
        if len(set(dst)) != len(dst):
            raise ValueError(f"{what}: a destination block appears twice: {pairs}")
        return torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long)

    @property
    def kv_layout(self) -> KVLayout:
        """The shape of one block's KV (what an exported run must share to be imported)."""
        cfg = self.config
        return layout_of(
            self.block_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype
        )

    def read_run(self, device_ids: Sequence[int], host_ids: Sequence[int]) -> KVPayload:
        """Device blocks, then host blocks, of every layer as one payload (host memory)."""
        self._check_ids(device_ids, self._num_blocks, "read_run")
        self._check_ids(host_ids, self.num_host_blocks, "read_run")
        host = self.host_kv_caches if host_ids else []
        return read_run(self.kv_layout, self.kv_caches, device_ids, host, host_ids)

    def write_run(
        self, host: bool, block_ids: Sequence[int], payload: KVPayload, offset: int
    ) -> None:
        """Write a checked payload's blocks ``offset..`` into device (or host) blocks."""
        self._check_ids(block_ids, self.num_host_blocks if host else self._num_blocks, "write_run")
        caches = self.host_kv_caches if host else self.kv_caches
        write_run(self.kv_layout, caches, block_ids, payload, offset)

    @staticmethod
    def _check_ids(ids: Sequence[int], n: int, what: str) -> None:
        if ids and (min(ids) < 0 or max(ids) >= n or len(set(ids)) != len(ids)):
            raise ValueError(f"{what}: block ids must be distinct and in [0, {n}): {list(ids)}")

    def build_input(self, seqs: Sequence[SeqChunk]) -> ModelInput:
        """``ModelInput.build`` with this runner's block size and device."""
        return ModelInput.build(seqs, self.block_size, self.device)

    def enable_lora(self, max_loras: int, max_rank: int) -> LoraSlots:
        """Allocate ``max_loras`` adapter slots of rank ``max_rank`` (once; later calls return
        the same slots)."""
        if self.lora is None:
            self.lora = LoraSlots(self.model, self.config, max_loras, max_rank)
        return self.lora

    @torch.inference_mode()
    def execute(
        self, batch: ModelInput, adapters: Sequence[LoraAdapter | None] | None = None
    ) -> torch.Tensor:
        """Run one step; return float32 logits ``[len(batch.logits_indices), vocab_size]``.

        Writes the K/V of every new token into the cache at ``batch.slot_mapping``.
        ``adapters``: per sequence of the batch, its LoRA adapter (None: the base model).
        """
        lora = adapters is not None and any(a is not None for a in adapters)
        if self.graphs is not None and not lora and self.graphs.can_run(batch):
            return self.graphs.run(batch)  # graphs hold the base model only: LoRA runs eagerly
        prepared = self.backend.prepare(batch.attention_metadata())
        if self.lora is not None:
            self.lora.set_batch(
                adapters or [None] * len(batch.query_lens_host), batch.query_lens_host
            )
        try:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, prepared)
        finally:
            if self.lora is not None:
                self.lora.clear_batch()
        return self.model.compute_logits(hidden.index_select(0, batch.logits_indices))
