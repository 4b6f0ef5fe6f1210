"""Chat rendering of the torch-free tokenizer: the template, its stop token, bad messages."""

from __future__ import annotations

import pytest

from worker.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(model_dirs) -> Tokenizer:
    return Tokenizer.from_dir(model_dirs["llama"])


def test_render_chat_chatml_and_end_of_turn(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye?"},
    ]
    assert tok.render_chat(messages) == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.render_chat(messages[:2], add_generation_prompt=False).endswith("Hi!<|im_end|>\n")
    assert tok.end_of_turn_token == "<|im_end|>"
    assert tok.end_of_turn_token_id == tok.token_to_id("<|im_end|>")
    assert tok.end_of_turn_token_id in tok.eos_token_ids


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([], "messages is empty"),
        ("hello", "must be a list"),
        ([{"role": "robot", "content": "x"}], r"messages\[0\]\.role='robot' is not one of"),
        (
            [{"role": "user", "content": "ok"}, {"role": "user", "content": " "}],
            r"messages\[1\]\.content is empty",
        ),
        ([{"role": "user"}], r"messages\[0\]\.content is empty"),
        ([["user", "hi"]], r"messages\[0\] must be a mapping"),
    ],
)
def test_render_chat_rejects_bad_messages(tok, messages, error):
    with pytest.raises(ValueError, match=error):
        tok.render_chat(messages)


def test_render_chat_without_template(model_dirs):
    plain = Tokenizer.from_dir(model_dirs["llama"])
    plain.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        plain.render_chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("template", "error"),
    [
        # a model's template is untrusted code: no reach into Python objects...
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "chat template failed: .*unsafe"),
        ("{{ messages.__class__.__init__.__globals__ }}", "chat template failed: .*unsafe"),
        # ...no changing the request's messages...
        ("{% set _ = messages.append(1) %}{{ messages }}", "chat template failed: .*unsafe"),
        # ...and the template's own refusals read as such
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
        ("{% for %}", "chat template does not compile"),
    ],
)
def test_render_chat_runs_the_template_in_a_sandbox(model_dirs, template, error):
    hostile = Tokenizer.from_dir(model_dirs["llama"])
    hostile.chat_template = template
    with pytest.raises(ValueError, match=error):
        hostile.render_chat([{"role": "user", "content": "hi"}])
