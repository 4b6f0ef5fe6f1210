"""A gRPC request's reasoning apart (``GenerateRequest.split_reasoning``): each sample's
``text`` split by its own :class:`~router.serving.reasoning_split.ReasoningSplit` into the
``reasoning`` and the answer, streamed (``GenerateResponse``) or whole (``Completion``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from protos.kvcluster.v1 import kvcluster_pb2 as pb
from router.serving.reasoning_split import ReasoningSplit
from worker.model.reasoning_markers import PromptReasoning, ReasoningMarkers


class ReasoningMessages:
    """The splits of one request's samples. ``earlier``: output tokens the client already
    has (a resumed stream): each split reads them first, so it resumes where the first
    router's left off."""

    def __init__(
        self,
        markers: ReasoningMarkers,
        state: PromptReasoning,
        earlier: Sequence[int],
        tokenizer: Any,
    ) -> None:
        self.markers, self.state = markers, state
        self._earlier = (tokenizer.decode(list(earlier)), list(earlier)) if earlier else None
        self._splits: dict[int, ReasoningSplit] = {}

    def _split(self, index: int) -> ReasoningSplit:
        split = self._splits.get(index)
        if split is None:
            split = self._splits[index] = ReasoningSplit(self.markers, self.state)
            if self._earlier is not None:
                split.feed(*self._earlier)  # (already sent: only the state is wanted)
        return split

    def apply(self, msg: pb.GenerateResponse | pb.Completion) -> None:
        """``msg``'s text (new, or whole) -> its reasoning and its answer."""
        last = isinstance(msg, pb.Completion) or msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        msg.reasoning, msg.text = self._split(msg.index).feed(msg.text, msg.token_ids, last)
