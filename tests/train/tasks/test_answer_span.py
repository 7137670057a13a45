"""The answer-span rule shared by the synthetic verifiers."""

import pytest

from sage_train.tasks.answer import answer_span


@pytest.mark.parametrize(
    "completion, span",
    [
        ("579", "579"),
        ("  579<|endoftext|>\nmore text", "579<|endoftext|>"),
        ("\n\n42\n7", "42"),
        ("", ""),
        ("reasoning... Answer: 46\nignored", "46"),
        ("answer : first\nANSWER: last", "last"),
        ("an\u017fwer: 5\n6", "an\u017fwer: 5"),  # a long s is no "s"
        ("Answer: 1 then \\boxed{2} and \\boxed{ 3 }", "3"),
        ("\\boxed{\\frac{1}{2}} trailing", "\\frac{1}{2}"),
        ("\\boxed{A=knight,B=knave}", "A=knight,B=knave"),
        ("closed \\boxed{1} then unclosed \\boxed{2", ""),
    ],
)
def test_answer_span(completion, span):
    assert answer_span(completion) == span
