"""The served model's fixed limits, and the check of a request against them that the router
makes before routing (the worker checks again, with its engine's own limits)."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.requests.errors import InvalidRequest
from kvstore.requests.model_limits import check_model_limits
from kvstore.requests.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What the router checks before routing (the worker checks again)."""

    model_id: str  # folded into block 0's key; must equal the workers'
    vocab_size: int  # token ids must be below it
    max_model_len: int  # prompt + generated tokens must fit
    max_prompt_tokens: int  # prompts longer than this are rejected


def check_limits(token_ids: list[int], params: SamplingParams, limits: ModelLimits) -> None:
    check_model_limits(
        token_ids,
        params,
        vocab_size=limits.vocab_size,
        max_model_len=limits.max_model_len,
        max_prompt_tokens=limits.max_prompt_tokens,
        ids_field="token_ids",
    )
    room = limits.max_model_len - len(token_ids)
    if params.max_tokens > room:
        raise InvalidRequest(
            "max_tokens",
            params.max_tokens,
            f"must be at most {room}: max_model_len={limits.max_model_len} minus the prompt's "
            f"{len(token_ids)} tokens",
            "lower max_tokens or shorten the prompt",
        )
