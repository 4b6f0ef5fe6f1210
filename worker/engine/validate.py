"""Checks of a request against the engine (the model's limits are the shared
:func:`kvstore.requests.model_limits.check_model_limits`; SamplingParams checks itself)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvstore.requests.errors import InvalidRequest
from kvstore.requests.model_limits import check_model_limits
from kvstore.requests.sampling_params import SamplingParams
from worker.engine.config import EngineConfig


def validate_request(
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    config: EngineConfig,
    vocab_size: int,
    max_model_len: int,
    num_blocks: int,
    has_tokenizer: bool,
    eos_ids: Collection[int] = (),
) -> None:
    """Raise :class:`InvalidRequest` if the request can never be served by this engine."""
    check_model_limits(prompt_ids, params, vocab_size=vocab_size, max_model_len=max_model_len)
    n = len(prompt_ids)
    bs = config.block_size
    width = params.width
    blocks = -(-(n + 1) // bs) + (width - 1)  # prompt + first token, one private block per fork
    if blocks > num_blocks:
        raise InvalidRequest(
            "prompt",
            n,
            f"needs {blocks} KV blocks ({n} prompt tokens + 1, width {width}) but "
            f"the whole KV cache has {num_blocks} blocks of {bs} tokens",
            "shorten the prompt or give the worker more KV memory",
        )
    if not config.enable_chunked_prefill and n > config.max_num_batched_tokens:
        raise InvalidRequest(
            "prompt",
            n,
            f"must be <= max_num_batched_tokens={config.max_num_batched_tokens} "
            "with chunked prefill off",
        )
    field = "beam_width" if params.use_beam_search else "n"
    if width > config.max_num_seqs:
        raise InvalidRequest(field, width, f"must be <= max_num_seqs={config.max_num_seqs}")
    if params.min_tokens > 0:  # before min_tokens, EOS and the stop ids are masked out
        banned = params.stop_token_set | (set() if params.ignore_eos else set(eos_ids))
        if len(banned) >= vocab_size:
            raise InvalidRequest(
                "stop_token_ids",
                f"<{len(params.stop_token_ids)} ids>",
                f"with min_tokens={params.min_tokens} they and EOS ban every token of the "
                f"vocabulary (vocab_size={vocab_size}): nothing could be generated",
            )
        if params.allowed_token_ids and banned.issuperset(params.allowed_token_ids):
            raise InvalidRequest(
                "allowed_token_ids",
                f"<{len(params.allowed_token_ids)} ids>",
                f"are all EOS or stop ids, masked until min_tokens={params.min_tokens}: "
                "nothing could be generated",
            )
    if params.bad_words and not has_tokenizer:
        raise InvalidRequest("bad_words", list(params.bad_words), "bad words need a tokenizer")
    if params.stop and not has_tokenizer:
        raise InvalidRequest("stop", list(params.stop), "stop strings need a tokenizer")
