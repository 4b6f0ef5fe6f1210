"""Adapter slots on the device and the batched LoRA delta (punica / S-LoRA style).

Every adaptable projection group of every layer has stacked weights with one row per slot:
``A [max_loras, in, slices * R]`` and, per output slice, ``B [max_loras, R, out]`` (R =
``max_lora_rank``; smaller ranks and untargeted modules are zero-padded, which adds exact
zeros). The model fuses q/k/v into one GEMM and gate/up into another, so their A's are
concatenated (one shrink GEMM reads x once) and each B expands into its own column slice of
the fused output.

A step's batch mixes base-model tokens and several adapters' tokens: the runner hands
:meth:`LoraSlots.set_batch` each sequence's adapter and token count; tokens are grouped by
slot and each group runs shrink + expand as two GEMMs (gather rows, ``index_add_`` back), so
the cost is one pair of small GEMMs per adapter in the batch, independent of how the batch
interleaves them. Base-model tokens get no delta and a batch without adapters costs nothing.

Slots are filled on demand, evicting the least recently used adapter that the current batch
does not use; the scheduler keeps the adapters of running requests within ``max_loras``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from worker.model.config import ModelConfig
from worker.model.lora import LoraAdapter

# group -> (input module dims key, output slices): the model's fused GEMMs
GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


def slot_bytes(cfg: ModelConfig, max_rank: int, element_size: int) -> int:
    """Device memory of one adapter slot: per layer, A and B of q/k/v, o, gate/up, down at
    rank ``max_rank`` (what :attr:`LoraSlots.bytes_per_slot` allocates)."""
    h, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    kv, inter = cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    # A: one [in, R] per projection; B: one [R, out] per projection
    per_rank = (3 * h + q + 2 * kv) + (q + h) + (2 * h + 2 * inter) + (inter + h)
    return cfg.num_layers * max_rank * per_rank * element_size


class LoraSlots:
    """``max_loras`` device slots for adapters of one model, and the hooks that apply them."""

    def __init__(self, model: nn.Module, cfg: ModelConfig, max_loras: int, max_rank: int) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        weight = model.model.embed_tokens.weight
        dev, dtype = weight.device, weight.dtype
        h, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
        kv, inter = cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        out = {
            "q_proj": q,
            "k_proj": kv,
            "v_proj": kv,
            "o_proj": h,
            "gate_proj": inter,
            "up_proj": inter,
            "down_proj": h,
        }
        fan_in = {"qkv": h, "o": q, "gate_up": h, "down": inter}
        # [layer][group] -> (A, [B per slice])
        self.weights: list[dict[str, tuple[torch.Tensor, list[torch.Tensor]]]] = []
        for _ in range(cfg.num_layers):
            layer = {}
            for g, mods in GROUPS.items():
                a = torch.zeros(max_loras, fan_in[g], len(mods) * max_rank, dtype=dtype, device=dev)
                bs = [
                    torch.zeros(max_loras, max_rank, out[m], dtype=dtype, device=dev) for m in mods
                ]
                layer[g] = (a, bs)
            self.weights.append(layer)
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # loaded adapter -> slot, LRU first
        self._free = list(range(max_loras))
        self._groups: list[tuple[int, torch.Tensor | None]] = []  # this batch: (slot, rows)
        self.loads = 0  # adapters copied into a slot (a reload after eviction counts again)
        self._device = dev
        self._install(model)

    @property
    def bytes_per_slot(self) -> int:
        """Device memory one adapter slot takes (all layers, A and B, at ``max_lora_rank``)."""
        total = 0
        for layer in self.weights:
            for a, bs in layer.values():
                total += (a[0].numel() + sum(b[0].numel() for b in bs)) * a.element_size()
        return total

    # ---- slots ---------------------------------------------------------------------------

    def _load(self, adapter: LoraAdapter, slot: int) -> None:
        for li, layer in enumerate(self.weights):
            for mods, (a, bs) in zip(GROUPS.values(), layer.values(), strict=True):
                a[slot].zero_()
                for s, (mod, b) in enumerate(zip(mods, bs, strict=True)):
                    b[slot].zero_()
                    ab = adapter.weights.get((li, mod))
                    if ab is None:
                        continue
                    r0 = s * self.max_rank
                    a[slot, :, r0 : r0 + adapter.rank].copy_(ab[0].T)
                    b[slot, : adapter.rank].copy_(ab[1].T)
        self.loads += 1

    def ensure(self, adapters: Sequence[LoraAdapter]) -> dict[str, int]:
        """Slots of ``adapters`` (distinct, at most ``max_loras``), loading missing ones into
        free slots or over the least recently used adapters not among them."""
        wanted = {a.name: a for a in adapters}
        if len(wanted) > self.max_loras:
            raise ValueError(f"{len(wanted)} adapters in one batch > max_loras={self.max_loras}")
        for name, adapter in wanted.items():
            if name in self.slot_of:
                self.slot_of.move_to_end(name)
                continue
            if self._free:
                slot = self._free.pop(0)
            else:
                victim = next(n for n in self.slot_of if n not in wanted)
                slot = self.slot_of.pop(victim)
            self._load(adapter, slot)
            self.slot_of[name] = slot
        return {name: self.slot_of[name] for name in wanted}

    def drop(self, name: str) -> None:
        """Forget a loaded adapter (its slot becomes free)."""
        slot = self.slot_of.pop(name, None)
        if slot is not None:
            self._free.append(slot)

    # ---- one step ------------------------------------------------------------------------

    def set_batch(self, adapters: Sequence[LoraAdapter | None], query_lens: Sequence[int]) -> None:
        """Per sequence of the flat batch (in order): its adapter (None: base) and new tokens."""
        self._groups = []
        used = [a for a in adapters if a is not None]
        if not used:
            return
        slots = self.ensure(list({a.name: a for a in used}.values()))
        per_seq = [-1 if a is None else slots[a.name] for a in adapters]
        if len(set(per_seq)) == 1:  # one adapter for the whole batch: no gather / scatter
            self._groups = [(per_seq[0], None)]
            return
        token_slot = torch.repeat_interleave(torch.tensor(per_seq), torch.tensor(list(query_lens)))
        for slot in sorted(set(slots.values())):
            rows = (token_slot == slot).nonzero().squeeze(1).to(self._device)
            self._groups.append((slot, rows))

    def clear_batch(self) -> None:
        self._groups = []

    def add_delta(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += LoRA delta of ``group`` for this batch's adapter tokens (in place)."""
        a, bs = self.weights[layer][group]
        r = self.max_rank
        for slot, rows in self._groups:
            xs = x if rows is None else x.index_select(0, rows)
            shrunk = xs @ a[slot]
            if len(bs) == 1:
                delta = shrunk @ bs[0][slot]
            else:
                delta = torch.cat(
                    [shrunk[:, i * r : (i + 1) * r] @ b[slot] for i, b in enumerate(bs)], dim=1
                )
            if rows is None:
                out.add_(delta)
            else:
                out.index_add_(0, rows, delta)

    # ---- wiring into the model -----------------------------------------------------------

    def _install(self, model: nn.Module) -> None:
        """Wrap the fused q/k/v and gate/up GEMMs and hook o_proj and down_proj of every layer
        (the model's code is unchanged; parameters keep their names)."""
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            assert attn.qkv is not None and mlp.gate_up is not None, "fuse the model first"
            attn.qkv = _WithLora(attn.qkv, self, i, "qkv")
            mlp.gate_up = _WithLora(mlp.gate_up, self, i, "gate_up")
            attn.o_proj.register_forward_hook(_hook(self, i, "o"))
            mlp.down_proj.register_forward_hook(_hook(self, i, "down"))


class _WithLora:
    """A fused GEMM plus this batch's LoRA deltas."""

    def __init__(self, base, slots: LoraSlots, layer: int, group: str) -> None:
        self.base, self.slots, self.layer, self.group = base, slots, layer, group
        self.weight, self.bias = base.weight, base.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.slots._groups:
            self.slots.add_delta(self.layer, self.group, x, out)
        return out


def _hook(slots: LoraSlots, layer: int, group: str):
    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        if slots._groups:
            slots.add_delta(layer, group, args[0], out)
        return out

    return hook
