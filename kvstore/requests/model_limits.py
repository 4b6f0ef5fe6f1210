"""The checks of a request against the model's limits that router and engine share: the
router runs them before routing, the engine again on arrival (it may be called directly)."""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.requests.errors import InvalidRequest
from kvstore.requests.sampling_params import SamplingParams


def check_model_limits(
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    max_prompt_tokens: int | None = None,
    ids_field: str = "prompt",
) -> None:
    """A non-empty prompt of token ids below ``vocab_size`` that leaves room for one generated
    token (and is at most ``max_prompt_tokens``), and stop token ids below ``vocab_size``.
    ``ids_field`` names the prompt's ids in errors as the caller's API calls them."""
    n = len(prompt_ids)
    if n == 0:
        raise InvalidRequest("prompt", 0, "must have at least one token")
    bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(ids_field, bad, f"each must be in [0, vocab_size={vocab_size})")
    cap = (
        max_model_len - 1
        if max_prompt_tokens is None
        else min(max_prompt_tokens, max_model_len - 1)
    )
    if n > cap:
        raise InvalidRequest(
            "prompt",
            n,
            f"must be at most {cap} tokens (max_model_len={max_model_len}, one token left to "
            "generate)",
            "shorten the prompt",
        )
    bad = next((t for t in params.stop_token_ids if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequest("stop_token_ids", bad, f"must be < vocab_size={vocab_size}")
    bad = next((t for t, _ in params.logit_bias if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequest("logit_bias", bad, f"token ids must be < vocab_size={vocab_size}")
    top = max(params.allowed_token_ids, default=-1)
    if top >= vocab_size:
        raise InvalidRequest(
            "allowed_token_ids", top, f"token ids must be < vocab_size={vocab_size}"
        )
