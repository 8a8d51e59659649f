"""The prompts `llmrun bench` runs: built-in kinds that bracket speculative decoding's best and worst cases, or a
user's own text, as token ids of an exact length.

- `open`: a short open-ended question. Little of the answer can be copied from the prompt (a drafter's worst
  case).
- `code-edit`: a ~330-token Python file and "rename this function, return the whole file". Copy heavy: most
  of the answer repeats the prompt (the best case for n-gram / prompt-lookup drafting).
- `summarize`: a ~390-token English passage and "summarize it": a long prefill, a partly copied answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmrun.errors import LlmrunError, read_text_file

_CODE = '''"""Read a CSV file of orders and print what each customer spent, largest first."""

import csv
import sys
from collections import defaultdict
from dataclasses import dataclass


@dataclass
class Order:
    customer: str
    item: str
    quantity: int
    unit_price: float

    @property
    def total(self) -> float:
        return self.quantity * self.unit_price


def parse_line(row: dict) -> Order:
    """Turn one CSV row into an Order; raise ValueError on a bad row."""
    quantity = int(row["quantity"])
    if quantity <= 0:
        raise ValueError(f"bad quantity {quantity} for {row['customer']}")
    return Order(row["customer"].strip(), row["item"].strip(), quantity, float(row["unit_price"]))


def read_orders(path: str) -> list[Order]:
    orders = []
    with open(path, newline="") as f:
        for number, row in enumerate(csv.DictReader(f), start=2):
            try:
                orders.append(parse_line(row))
            except (KeyError, ValueError) as e:
                print(f"{path}:{number}: skipped ({e})", file=sys.stderr)
    return orders


def totals_by_customer(orders: list[Order]) -> dict[str, float]:
    totals = defaultdict(float)
    for order in orders:
        totals[order.customer] += order.total
    return dict(totals)
'''

_PASSAGE = """For most of history, a ship approaching land at night had only its charts, its lead line and the \
experience of its crew to keep it off the rocks. The first lighthouses were simply fires kept burning on \
hilltops or towers near busy harbours; the most famous, the Pharos of Alexandria, stood for well over a \
thousand years and gave its name to the word for lighthouse in several languages. Such fires were expensive \
to feed, smoky, and hard to see in bad weather, which is exactly when sailors needed them most.

The eighteenth and nineteenth centuries changed lighthouses more than the previous two thousand years had. \
Oil lamps with hollow wicks burned brighter and cleaner than coal or wood, and polished metal reflectors \
gathered their light into a beam. The decisive step came in 1822, when the French physicist Augustin Fresnel \
designed a lens built from concentric rings of glass prisms. A Fresnel lens captured most of the light that \
a lamp threw in every direction and bent it into a narrow, intense beam that could be seen more than twenty \
miles out to sea, while weighing far less than a solid lens of the same power.

Because many lights might be visible from one stretch of coast, each was given a signature: a pattern of \
flashes, a colour, or a rhythm of light and darkness, printed in the lists that every navigator carried. A \
sailor who counted three flashes every fifteen seconds knew which headland lay ahead. Keepers and their \
families lived at the stations, trimming wicks, winding the clockwork that turned the lens, and cleaning soot \
from the glass through long nights and storms.

In the twentieth century electricity, automatic lamp changers and later radio beacons and satellite \
navigation made resident keepers unnecessary, and most lights were automated. Many towers still shine, \
however, both as a backup for ships whose electronics fail and as landmarks cherished by the towns that \
grew up around them."""

PROMPTS = {
    "open": "What are some good ways to spend a rainy afternoon at home? Give a few ideas and explain why each one is worth trying.",
    "code-edit": f"{_CODE}\nRename the function `parse_line` to `parse_order` everywhere in this file. Reply with the whole file and nothing else.",
    "summarize": f"{_PASSAGE}\n\nSummarize the passage above in three sentences.",
}
KINDS = tuple(PROMPTS)


@dataclass(frozen=True)
class Workload:
    kind: str  # one of KINDS, or "file" for --prompt-file
    prompt: tuple[int, ...]  # token ids, exactly as run
    new_tokens: int  # decoded per run, greedy, never stopping early
    repeat: int  # timed runs
    warmup: bool  # one untimed run first
    chat_template: bool  # whether the prompt was rendered with the model's chat template

    def describe(self) -> dict:
        return {"kind": self.kind, "prompt_tokens": len(self.prompt), "new_tokens": self.new_tokens,
                "repeat": self.repeat, "warmup": self.warmup, "batch": 1, "chat_template": self.chat_template}


def read_prompt_file(path: Path) -> str:
    text = read_text_file(path, f"--prompt-file {path}")
    if not text.strip():
        raise LlmrunError(f"--prompt-file {path} is empty; give it some text to prefill")
    return text


def exact_length(ids: list[int], n: int) -> list[int]:
    """`ids` cut (keeping the start) or repeated end to end to exactly n tokens."""
    return (ids * (n // len(ids) + 1))[:n]


def make_workload(tokenizer, *, kind: str = "open", text: str | None = None, prompt_tokens: int | None = None,
                  new_tokens: int = 128, repeat: int = 3, warmup: bool = True, vocab_size: int | None = None) -> Workload:
    """Token ids of the `kind` prompt (or of `text`, kind "file"), rendered with the chat template when the
    model has one. `vocab_size`: map ids into a smaller or unrelated vocabulary (random-weight models)."""
    if text is None and kind not in PROMPTS:
        raise LlmrunError(f"unknown prompt kind {kind!r}; choose one of {', '.join(KINDS)}")
    content = PROMPTS[kind] if text is None else text
    templated = tokenizer.chat_template is not None
    if templated:
        ids = tokenizer.encode_chat([{"role": "user", "content": content}])
    else:
        ids = tokenizer.encode(content)
    if not ids:
        raise LlmrunError("the prompt is empty once tokenized; give some text")
    if prompt_tokens is not None:
        ids = exact_length(ids, prompt_tokens)
    if vocab_size is not None:
        ids = [i % vocab_size for i in ids]
    return Workload("file" if text is not None else kind, tuple(ids), new_tokens, repeat, warmup, templated)
