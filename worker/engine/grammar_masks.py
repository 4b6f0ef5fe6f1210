"""Per-step token masks of the constrained rows (see ``structured.py``): filled by the
requests' matchers in one parallel call on a helper thread while the model runs, unpacked
from llguidance's 32-bit words and shipped to the logits' device for the sampler."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


@dataclass(slots=True)
class TokenMask:
    """Grammar constraints of a batch: the tokens a grammar bans in its rows (the sampler
    sets their logits to -inf)."""

    rows: torch.Tensor | None  # [k] long, on the logits' device: the constrained rows
    # (None: every row of the batch, in order)
    banned: torch.Tensor  # [k, vocab] bool, on the logits' device: True = not allowed


def _unpack(bits: torch.Tensor, vocab: int, shifts: torch.Tensor) -> torch.Tensor:
    """[k, words] int32 bitmasks -> [k, vocab] bool, True where the bit is 0 (banned)."""
    k, words = bits.shape
    return ((bits.unsqueeze(-1) >> shifts) & 1).view(k, words * 32)[:, :vocab] == 0


class GrammarMasks:
    """The masks of one step's constrained rows. :meth:`start` fills the bitmasks on a helper
    thread (llguidance's parallel filler, GIL released) while the model computes the logits,
    and for logits on the CPU unpacks them there too; :meth:`mask` ships the rows a batch
    samples to the logits' device (a GPU unpacks them itself).

    Obligation: between ``start`` and ``wait`` nothing touches the matchers (the engine waits
    before it forks samples, which copy them)."""

    def __init__(self) -> None:
        self._exec: llguidance.LLExecutor | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._order: list[int] = []  # the logits rows of this step's masks, in order
        self._host: torch.Tensor | None = None  # [rows, words] int32 bitmasks (GPU logits)
        self._banned: torch.Tensor | None = None  # [rows, vocab] bool (CPU logits)
        self._shifts: dict[torch.device, torch.Tensor] = {}  # bit positions, per device

    def _fill(self, matchers: Sequence[Any], vocab: int) -> torch.Tensor:
        if self._exec is None:
            self._exec = llguidance.LLExecutor()
        words = (vocab + 31) // 32
        bits = torch.full((len(matchers), words), -1, dtype=torch.int32)
        pairs = [(m, k) for k, m in enumerate(matchers)]
        self._exec.unsafe_compute_mask_ptr(pairs, bits.data_ptr(), words * 4, len(matchers))
        return bits

    def _shift(self, device: torch.device) -> torch.Tensor:
        shifts = self._shifts.get(device)
        if shifts is None:
            shifts = self._shifts[device] = _SHIFTS.to(device)
        return shifts

    def start(self, rows: dict[int, Any], vocab: int, device: torch.device) -> None:
        """Begin the masks of ``rows`` (logits row -> its sequence's matcher); ``device``:
        where the logits are expected (the CPU: unpacked here too; a wrong guess costs only
        the unpacking in :meth:`mask`)."""
        self._order, self._host, self._banned, self._pending = [], None, None, None
        if not rows:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        order = list(rows)
        shifts = self._shift(torch.device("cpu")) if device.type == "cpu" else None

        def fill() -> tuple[torch.Tensor, torch.Tensor | None]:
            bits = self._fill([rows[r] for r in order], vocab)
            return bits, (_unpack(bits, vocab, shifts) if shifts is not None else None)

        self._order = order
        self._pending = self._pool.submit(fill)

    def wait(self) -> None:
        """The work started by :meth:`start` is over (a failure leaves the rows to
        :meth:`mask`, which fills them again, one request at a time)."""
        if self._pending is not None:
            try:
                self._host, self._banned = self._pending.result()
            except Exception:  # noqa: BLE001 - refilled per request, where it fails alone
                self._order, self._host, self._banned = [], None, None
            self._pending = None

    def mask(
        self, rows: Sequence[int], matchers: Sequence[Any | None], logits: torch.Tensor
    ) -> TokenMask | None:
        """The mask of a batch to sample: position ``i`` samples logits row ``rows[i]`` with
        ``matchers[i]`` (None: unconstrained). A forked sample shares its parent's row and,
        before its first token, its state, hence its mask."""
        self.wait()
        vocab, device = logits.shape[-1], logits.device
        pos = [i for i, m in enumerate(matchers) if m is not None]
        if not pos:
            return None
        every = len(pos) == len(matchers)
        if self._order and every and list(rows) == self._order:  # the usual step
            if self._banned is not None and device.type == "cpu":
                return TokenMask(None, self._banned)
            assert self._host is not None
            bits = self._host
        else:
            index = {r: k for k, r in enumerate(self._order)}
            if all(rows[i] in index for i in pos) and self._host is not None:
                bits = self._host[[index[rows[i]] for i in pos]]
            else:  # not prepared (a failed fill, a fallback): fill these rows now
                bits = self._fill([matchers[i] for i in pos], vocab)
        if device.type != "cpu":
            bits = bits.pin_memory().to(device, non_blocking=True)
        banned = _unpack(bits, vocab, self._shift(device))
        if every:
            return TokenMask(None, banned)
        idx = torch.tensor(pos, dtype=torch.long)
        return TokenMask(idx.to(device, non_blocking=True), banned)


def allow_token(
    mask: TokenMask, matchers: Sequence[Any | None], positions: Sequence[int], token: int
) -> None:
    """Let ``token`` through ``mask`` (as :meth:`GrammarMasks.mask` made it from
    ``matchers``) at the batch ``positions``, each of them constrained: a reasoning model's
    first token may open its reasoning whatever the grammar says (see ``structured.py``)."""
    if mask.rows is None:  # every position is constrained: its row is its position
        at = list(positions)
    else:  # the mask's rows are the constrained positions, in order
        rank = {p: k for k, p in enumerate(i for i, m in enumerate(matchers) if m is not None)}
        at = [rank[p] for p in positions]
    mask.banned[at, token] = False


def grammar_rows(jobs: list, guarded: Callable[[Any, Callable[[], object]], None]) -> list:
    """``jobs`` ((request, sequence, row) to sample) less those whose matcher is in an error
    state: ``guarded`` fails each of their requests with the matcher's message."""
    ok = []
    for job in jobs:
        req, seq, _ = job
        if seq.matcher is not None and seq.matcher.is_error():

            def fail(m: Any = seq.matcher) -> None:
                raise RuntimeError(f"structured outputs: the grammar failed: {m.get_error()}")

            guarded(req, fail)
        else:
            ok.append(job)
    return ok
