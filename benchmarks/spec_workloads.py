"""The sessions of the speculative decoding benchmarks (``benchmarks/spec_decode.py``,
``benchmarks/spec_routing.py``): each workload's user turns for session ``i``.

- ``edit``: rewrite a given function with one change (the answer repeats the prompt);
- ``json``: a tool call whose JSON arguments echo the fields of a record in the prompt;
- ``agentic``: three turns over one file, each asking to quote the previous answer again
  with a small change (the prompt carries the earlier answers; so does the suffix corpus);
- ``chat``: plain questions, little to copy.
"""

from __future__ import annotations

import json

FUNCTION = '''def {name}(values, window):
    """Mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''
NAMES = ("moving_average", "rolling_mean", "window_mean", "running_average")
PARAMS = ("size", "width", "span", "length")
CUSTOMERS = (
    ("C-10482", "Maria Rossi", "maria.rossi@example.com", "Rome", "premium"),
    ("C-20931", "Lars Nilsen", "lars.nilsen@example.com", "Oslo", "basic"),
    ("C-31177", "Ana Pereira", "ana.pereira@example.com", "Lisbon", "team"),
    ("C-47720", "Jonas Weber", "jonas.weber@example.com", "Vienna", "premium"),
)
MOVES = ("Milan", "Bergen", "Porto", "Graz")
TOPICS = ("tides", "volcanoes", "bread", "comets", "bees", "glaciers", "rust", "jazz")
WORKLOADS = ("edit", "json", "agentic", "chat")


def turns(workload: str, i: int) -> list[str]:
    """The user turns of session ``i`` of ``workload`` (one unless agentic)."""
    code = FUNCTION.format(name=NAMES[i % len(NAMES)])
    if workload == "edit":
        return [
            f"Rewrite this function, renaming the parameter `window` to "
            f"`{PARAMS[i % len(PARAMS)]}`; change nothing else and output only the code.\n\n"
            f"{code}\n"
        ]
    if workload == "json":
        return [tool_call_prompt(i)]
    if workload == "agentic":
        return [
            f"You are a coding agent. The file stats.py holds:\n\n{code}\n"
            "Step 1: print the function exactly as it is, nothing else.",
            "Step 2: quote your previous answer again, with a comment `# running sum` added "
            "above the loop.",
            "Step 3: print the final version once more, exactly as in step 2, and nothing else.",
        ]
    if workload == "chat":
        return [f"Explain in a few sentences how {TOPICS[i % len(TOPICS)]} work."]
    raise ValueError(f"workload {workload!r}: not one of {', '.join(WORKLOADS)}")


def tool_call_prompt(i: int) -> str:
    cid, name, email, city, plan = CUSTOMERS[i % len(CUSTOMERS)]
    record = {
        "customer_id": cid,
        "name": name,
        "email": email,
        "city": city,
        "plan": plan,
        "order_ids": [f"A-{5530 + i % 7}", f"A-{5610 + i % 5}"],
    }
    example = {"name": "update_customer", "arguments": {"customer_id": "...", "...": "..."}}
    return (
        "You can call the tool `update_customer(customer_id, name, email, city, plan, "
        "order_ids)`; it replaces the whole record. The customer's record is:\n"
        f"{json.dumps(record, indent=2)}\n"
        f"The customer moved to {MOVES[i % len(MOVES)]}. Reply with only the tool call as "
        f"JSON, every field of the record given, like {json.dumps(example)}."
    )


def play_turn(engine: object, histories: list[list[dict]], texts: list[str], params: object):
    """One turn of each session (``texts[j]`` to ``histories[j]``), all submitted together;
    each answer joins its history. Returns the completions, in order."""
    for history, text in zip(histories, texts, strict=True):
        history.append({"role": "user", "content": text})
    results = engine.generate([encode(engine, h) for h in histories], params)  # type: ignore[attr-defined]
    out = [r.completions[0] for r in results]
    for history, c in zip(histories, out, strict=True):
        history.append({"role": "assistant", "content": c.text})
    return out


def encode(engine: object, messages: list[dict]) -> list[int] | str:
    """The conversation as the model's chat template renders it (plain text without one)."""
    tok = engine.tokenizer  # type: ignore[attr-defined]
    if getattr(tok, "chat_template", None):
        return tok.encode(tok.render_chat(messages), add_special_tokens=False)
    return "\n".join(m["content"] for m in messages)
