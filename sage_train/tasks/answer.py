"""Where the answer sits in a completion, for the synthetic tasks: two rules, chosen per task by
its ``grading`` option (`GRADINGS`), shared by every synthetic verifier so that a model learns
one habit.

"free" (the default): the answer as instruct models write it ("The answer is 116.",
"23 + 48 = 71", "**71**", "\\boxed{71}"). `free_span` finds where the answer is *said*:

1. the content of the last `\\boxed{...}` (braces balanced; an unclosed box gives an empty span);
2. else the text after the last "answer is", "answer:" or "answer =" (any case);
3. else the whole completion.

A task then reads the *first* answer in the span (each task's docstring says what an answer is
there): a small instruct model states its result first and rambles after it. On 112 completions
of SmolLM2-135M-Instruct (tests/train/tasks/data/smollm2_arithmetic.jsonl) reading the first
number of the completion agrees with the hand labels on 112, the last number on 109 (it misses
every correct one: "69 + 59 = 128. ... holds 10! bits").

"strict": the format a small model is trained to (`answer_span`):

1. If the completion contains `\\boxed{...}`, the answer span is the content of the last one.
2. Otherwise, if it contains "Answer:" (any case), the span is the text after the last one,
   up to the end of that line.
3. Otherwise the span is the first line of the completion, leading whitespace removed.

Each task then reads a well-formed answer from the *start* of the span and ignores what
follows it, so a decoded end-of-sequence marker or trailing chatter after the answer does
not change the grade ("579<|endoftext|>" reads as 579; "5790" does not).
"""

from __future__ import annotations

import re
from decimal import Decimal

GRADINGS = ("free", "strict")
_BOXED = "\\boxed{"
_ANSWER_MARK = re.compile(r"answer\s*:", re.IGNORECASE | re.ASCII)
_FREE_MARK = re.compile(r"answer\s*(?:is\b|:|=)", re.IGNORECASE | re.ASCII)
_NUMBER = re.compile(r"(?<![\w.,])(-\s*)?(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?!\w|[.,]\d)", re.ASCII)
_OPERATORS = "+-*/x×÷"


def check_grading(grading: str) -> None:
    if grading not in GRADINGS:
        raise ValueError(f"grading must be one of {GRADINGS}, got {grading!r}")


def answer_span(completion: str) -> str:
    """The part of `completion` that holds the answer, by the strict rule (module docstring)."""
    if _BOXED in completion:
        return (last_boxed(completion) or "").strip()
    marks = list(_ANSWER_MARK.finditer(completion))
    if marks:
        return completion[marks[-1].end() :].split("\n", 1)[0].strip()
    return completion.lstrip().split("\n", 1)[0]


def free_span(completion: str) -> tuple[str, bool]:
    """(the span, whether the answer was said explicitly: a box or a marker) by the free rule
    (module docstring); its first answer counts."""
    if _BOXED in completion:
        return (last_boxed(completion) or "").strip(), True
    marks = list(_FREE_MARK.finditer(completion))
    if marks:
        return completion[marks[-1].end() :], True
    return completion, False


def free_number(completion: str) -> Decimal | None:
    """The number `completion` answers by the free rule: the first number of its span that is no
    operand of an expression (an operator, spaces allowed, right before or after: "23 + 48 = 71"
    says 71, a restated question nothing); thousands commas allowed, a decimal part kept ("71.0").
    None if there is none."""
    return next(_answers(free_span(completion)[0]), None)


def _answers(text: str):
    """The values of the numbers in `text` that are no operand of an expression. The text around a
    number is read by position, never copied: linear in the length of `text`."""
    for match in _NUMBER.finditer(text):
        before, after = _char_before(text, match.start()), _char_after(text, match.end())
        sign, digits, decimals = match.groups()
        if sign and _ends_a_term(text, before):  # "7 - 5": the minus is binary, 5 an operand
            continue
        if not sign and before >= 0 and text[before] in _OPERATORS and _ends_a_term(text, _char_before(text, before)):
            continue
        if after < len(text) and text[after] in _OPERATORS:
            following = _char_after(text, after + 1)
            if following < len(text) and text[following] in "0123456789(":
                continue
        value = Decimal(digits.replace(",", "") + (decimals or ""))
        yield -value if sign else value


def _char_before(text: str, end: int) -> int:
    """The index of the last character of ``text[:end]`` that is not whitespace, or -1."""
    i = end - 1
    while i >= 0 and text[i].isspace():
        i -= 1
    return i


def _char_after(text: str, start: int) -> int:
    """The index of the first character of ``text[start:]`` that is not whitespace, or len(text)."""
    i = start
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _ends_a_term(text: str, last: int) -> bool:
    """Whether the character at `last` (-1: none) is a digit or a closing parenthesis."""
    return last >= 0 and (text[last].isdigit() or text[last] == ")")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` in `text` (braces balanced), or None (no box, or unclosed)."""
    box = text.rfind(_BOXED)
    if box < 0:
        return None
    start = box + len(_BOXED)
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None
