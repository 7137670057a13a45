"""Where the answer sits in a completion, for the synthetic tasks.

One rule, shared by every synthetic verifier so that a model learns one habit:

1. If the completion contains `\\boxed{...}`, the answer span is the content of the last one
   (braces balanced; an unclosed box gives an empty span).
2. Otherwise, if it contains "Answer:" (any case), the span is the text after the last one,
   up to the end of that line.
3. Otherwise the span is the first line of the completion, leading whitespace removed.

Each task then reads a well-formed answer from the *start* of the span and ignores what
follows it, so a decoded end-of-sequence marker or trailing chatter after the answer does
not change the grade ("579<|endoftext|>" reads as 579; "5790" does not).
"""

from __future__ import annotations

import re

_BOXED = "\\boxed{"
_ANSWER_MARK = re.compile(r"answer\s*:", re.IGNORECASE | re.ASCII)


def answer_span(completion: str) -> str:
    """The part of `completion` that holds the answer, by the rule in the module docstring."""
    start = completion.rfind(_BOXED)
    if start >= 0:
        return _brace_content(completion, start + len(_BOXED))
    marks = list(_ANSWER_MARK.finditer(completion))
    if marks:
        return completion[marks[-1].end() :].split("\n", 1)[0].strip()
    return completion.lstrip().split("\n", 1)[0]


def _brace_content(text: str, start: int) -> str:
    """Text from `start` up to the brace closing the one just before it ("" if unclosed)."""
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i].strip()
    return ""
