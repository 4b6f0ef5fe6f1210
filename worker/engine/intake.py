"""A new request on its way in: its prompt as token ids, then the :class:`Request` the
scheduler queues, with its first sequence (and its beam search). The checks against the
engine's limits between the two are :func:`worker.engine.validate.validate_request`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from collections.abc import Sequence as Seq

from kvstore.requests.errors import InvalidRequest
from kvstore.requests.sampling_params import SamplingParams
from worker.engine.beam import BeamSearch
from worker.engine.detokenizer import OutputText, TokenizerLike
from worker.engine.request import Request, Sequence, sample_generator
from worker.kv import HashContext

Prompt = str | list[int]


def prompt_token_ids(prompt: Prompt, tokenizer: TokenizerLike | None) -> list[int]:
    """``prompt`` as token ids (a text prompt needs a tokenizer); raises InvalidRequest."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequest("prompt", prompt[:32], "text prompts need a tokenizer")
        return list(tokenizer.encode(prompt))
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise InvalidRequest("prompt", type(prompt).__name__, "must be text or token ids")
    return list(prompt)


def bad_word_ids(words: Seq[str], tokenizer: TokenizerLike) -> tuple[tuple[int, ...], ...]:
    """Each of vLLM's ``bad_words`` as the token ids that spell it at the start of a text and,
    where a leading space makes other tokens of as many, after a space."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out.append(bare)
        if spaced and len(spaced) == len(bare) and spaced[0] != bare[0]:
            out.append(spaced)
    return tuple(dict.fromkeys(ids for ids in out if ids))


def banned_by_words(words: tuple[tuple[int, ...], ...], seq: Sequence) -> list[int]:
    """The tokens that would complete one of ``words`` now: a one-token word always, a
    longer one where its other tokens end the sequence's output (earlier attempts' too)."""
    out_len = len(seq.token_ids) - seq.output_start
    banned = []
    for ids in words:
        k = len(ids) - 1
        if k == 0 or (out_len >= k and tuple(seq.token_ids[-k:]) == ids[:-1]):
            banned.append(ids[-1])
    return banned


def new_request(
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    arrival: int,
    ctx: HashContext,
    max_model_len: int,
    eos_ids: Collection[int],
    new_text: Callable[[Request], OutputText | None],
    continued: int = 0,
    bad_words: tuple[tuple[int, ...], ...] = (),
) -> Request:
    """A checked request, ready to queue: at most ``max_model_len`` tokens in all, one
    sequence holding the prompt (the others are forked off it after its prefill).
    ``continued``: the prompt's last tokens are the request's own output of an earlier
    attempt (a moved stream; see :attr:`Sequence.prior_output`); ``bad_words``: the
    request's bad words as token ids (:func:`bad_word_ids`)."""
    if not 0 <= continued < len(prompt_ids):
        raise InvalidRequest(
            "continued", continued, f"must be in [0, {len(prompt_ids)}) (the prompt's length)"
        )
    max_new = min(params.max_tokens, max_model_len - len(prompt_ids))
    req = Request(request_id, prompt_ids, params, arrival, ctx, max_new)
    req.bad_words = bad_words
    if params.use_beam_search:
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        req.beam = BeamSearch(
            params.beam_width, params.length_penalty, params.early_stopping, max_new, stop_ids
        )
    generator = sample_generator(params.seed, 0)
    seq = Sequence(0, list(prompt_ids), len(prompt_ids), new_text(req), generator, continued)
    req.seqs.append(seq)
    return req
