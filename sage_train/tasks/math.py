"""Math word problems with LaTeX gold answers, graded by math-verify (`grading.math_reward`).

`MathTask(source)` reads one of:
  - a benchmark name: math500, aime24, aime25, amc23, minerva, or aime (AIME 2024 and 2025 pooled
    into one 60-problem set, as the official SAGE evaluation reports it). It resolves to
    `<root>/<file>.jsonl`, where root is `$SAGE_MATH_DATA` when set, else the copies shipped
    with the package (`sage_train/tasks/data/math`); a file missing there is loaded from its
    Hugging Face hub dataset (needs the `datasets` package and a network connection);
  - a path to a `.jsonl` file;
  - "hub:<owner>/<dataset>[:<split>]" for any hub dataset with the same fields;
  - a training set (`TRAIN_SETS`): "dapo-math" (open-r1/DAPO-Math-17k-Processed) or
    "openmathreasoning-mini" (unsloth/OpenMathReasoning-mini), from the hub;
  - "jsonl:<path>": a jsonl file in any of the formats below, whatever its extension.

Row formats (detected per row):
  - MATH style: the problem in `problem` (or `question`), the gold in `answer`, or else as the
    last `\\boxed{}` of `solution`;
  - DAPO-Math-17k-Processed: `prompt` (the problem) and `solution` (the bare gold answer);
  - OpenMathReasoning: `problem`, `expected_answer`, and `generated_solution`, a worked
    solution kept as ``meta["sft_completion"]``: the trainer's warm start (``sft_steps``)
    fine-tunes base models on it.

Prompts. ``template`` builds the user message; with the trainer's ``chat_template`` key the
message goes through the tokenizer's chat template (`sage_train.tasks.chat.ChatPromptTask`),
after the system prompt ``system_prompt``. Grading (`MathTask.score`) takes the last \\boxed{} of the
completion and, if there is none, the content of its last ``<answer>...</answer>`` tags, so
either convention the prompt may ask for is accepted; without either, the answer as instruct
models state it ("The answer is 116.", "94 + 22 = 116": `answer_for_grading`), never a number of
a restated question. A source is one fixed list: `problems(split, n, seed)`
returns its first `n` rows in file order whatever the split and seed, so a smaller `n` is a
prefix of a larger one and an evaluation subset is the same on every run.

Options:
    template: "sage" (default: the question, then the instruction to reason step by step and
              put the final answer in \\boxed{}), "plain" (the question alone), "official" (the
              official SAGE evaluation's user message), or a custom string containing "{question}".
    gold_parsing: "boxed" (default: the gold is wrapped in \\boxed{} before math-verify parses it,
              so the whole answer counts) or "bare" (parsed as it is, as the official evaluation
              does, which reproduces its numbers; `sage_train.tasks.grading.math_rewards`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

from .answer import free_number, free_span, last_boxed
from .base import Problem
from .grading import math_rewards

#: a number in scientific notation, not part of a word or of a longer number ("2e3", "1.5E-2"; not "x2e3")
_SCIENTIFIC = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)[eE]([+-]?)(\d+)(?!\w|\.\d)", re.ASCII)
#: the longest number written out in digits ("1.5e-300" takes 302); a longer one becomes "$m\times10^{k}$"
_MAX_WRITTEN_OUT = 400
#: the most characters written out in one completion: what it adds is bounded whatever it holds
_WRITTEN_OUT_BUDGET = 100_000
#: the most characters of a completion handed to math-verify (its end): 0.1-0.4 s to parse on one core
MAX_GRADED_CHARS = 100_000

TEMPLATES = {
    "sage": "{question}\nPlease reason step by step, and put your final answer within \\boxed{}.",
    "plain": "{question}",
    "official": "Problem: {question}\n\nSolve this step by step and provide your final numerical answer.",
}

# name -> (hub dataset, hub config or None, hub split); rows in the formats of the module docstring
TRAIN_SETS = {
    "dapo-math": ("open-r1/DAPO-Math-17k-Processed", "en", "train"),  # the English subset
    "openmathreasoning-mini": ("unsloth/OpenMathReasoning-mini", None, "cot"),
}

# name -> (shipped file, hub dataset, hub split)
BENCHMARKS = {
    "math500": ("math500.jsonl", "HuggingFaceH4/MATH-500", "test"),
    "aime24": ("aime24.jsonl", "HuggingFaceH4/aime_2024", "train"),
    "aime25": ("aime25.jsonl", "math-ai/aime25", "test"),
    "amc23": ("amc23.jsonl", "math-ai/amc23", "test"),
    "minerva": ("minerva_math.jsonl", "math-ai/minervamath", "test"),
}
#: name -> the benchmarks pooled into it (problem ids <name>/<index> over the concatenation)
POOLED = {"aime": ("aime24", "aime25")}
DATA_ENV = "SAGE_MATH_DATA"


def data_root() -> Path:
    """Where the benchmark files are read from: $SAGE_MATH_DATA, else the package's own copies."""
    env = os.environ.get(DATA_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parent / "data" / "math"


def _gold(row: dict, where: str) -> str:
    answer = row.get("answer", row.get("expected_answer"))
    if answer is None and "problem" not in row and "question" not in row and "prompt" in row:
        answer = row.get("solution")  # DAPO-Math-17k-Processed: the solution is the bare answer
    if answer is None and isinstance(row.get("solution"), str):
        answer = last_boxed(row["solution"])
    if answer is None:
        raise ValueError(f"{where}: no 'answer' field and no \\boxed{{}} in 'solution'")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"{where}: the answer must be a string or a number, got {type(answer).__name__} {answer!r}")
    if isinstance(answer, float) and answer.is_integer():
        answer = int(answer)  # AMC golds are JSON floats ("27.0"); models write 27
    return str(answer).strip()


def rows_to_problems(rows, name: str, where: str, places: list[str] | None = None) -> list[Problem]:
    """Problems from dict rows; ids are `<name>/<row index>`. Errors name `places[i]` (a file and
    line), else "`where` row i"."""
    problems = []
    for i, row in enumerate(rows):
        place = places[i] if places else f"{where} row {i}"
        question = row.get("problem", row.get("question", row.get("prompt")))
        if not isinstance(question, str):
            raise ValueError(f"{place}: no 'problem' (or 'question', or 'prompt') text")
        meta = {k: v for k, v in row.items() if k in ("subject", "level", "type", "url", "unique_id")}
        if isinstance(row.get("generated_solution"), str) and row["generated_solution"].strip():
            meta["sft_completion"] = row["generated_solution"]
        problems.append(Problem(id=f"{name}/{i}", question=question, answer=_gold(row, place), meta=meta))
    return problems


def jsonl_problems(path: Path, name: str) -> list[Problem]:
    rows, lines = read_jsonl(path)
    return rows_to_problems(rows, name, str(path), [f"{path}:{line}" for line in lines])


def read_jsonl(path: Path) -> tuple[list[dict], list[int]]:
    """(the rows of a jsonl file, each a JSON object; their line numbers). A line that is not one
    (or not UTF-8 text) raises ValueError naming the file and line; blank lines are skipped."""
    rows, lines = [], []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
                row = json.loads(line) if line.strip() else None
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}:{number}: not UTF-8 text (byte {error.start} of the line)") from None
            except ValueError as error:
                raise ValueError(f"{path}:{number}: not valid JSON ({error})") from None
            if not line.strip():
                continue
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object per line, got {type(row).__name__}")
            rows.append(row)
            lines.append(number)
    return rows, lines


def load_hub(dataset: str, split: str, config: str | None = None) -> list[dict]:
    """Rows of a Hugging Face hub dataset split (needs the optional `datasets` package)."""
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            f"loading {dataset!r} from the Hugging Face hub needs the 'datasets' package "
            f"(pip install datasets), or set ${DATA_ENV} to a folder with the jsonl "
            "files"
        ) from e
    return list(datasets.load_dataset(dataset, config, split=split))


def load_source(source: str) -> tuple[str, list[Problem]]:
    """(task name, problems) for a benchmark name, a jsonl path or "hub:owner/name[:split]"."""
    if source in POOLED:
        problems = [p for part in POOLED[source] for p in load_source(part)[1]]
        return source, [dataclasses.replace(p, id=f"{source}/{i}") for i, p in enumerate(problems)]
    if source in BENCHMARKS:
        file, hub, split = BENCHMARKS[source]
        local = data_root() / file
        if local.is_file():
            return source, jsonl_problems(local, source)
        return source, rows_to_problems(load_hub(hub, split), source, hub)
    if source in TRAIN_SETS:
        dataset, config, split = TRAIN_SETS[source]
        return source, rows_to_problems(load_hub(dataset, split, config), source, dataset)
    if source.startswith("jsonl:"):
        path = Path(source[len("jsonl:") :])
        if not path.is_file():
            raise FileNotFoundError(f"task {source!r}: no file {str(path)!r}")
        return path.stem, jsonl_problems(path, path.stem)
    if source.startswith("hub:"):
        dataset, _, split = source[len("hub:") :].partition(":")
        return source, rows_to_problems(load_hub(dataset, split or "test"), source, dataset)
    path = Path(source)
    if path.suffix == ".jsonl" and path.is_file():
        return path.stem, jsonl_problems(path, path.stem)
    raise ValueError(
        f"source must be one of {sorted(BENCHMARKS) + sorted(POOLED) + sorted(TRAIN_SETS)}, a path to an "
        f"existing .jsonl file, 'jsonl:<path>' or 'hub:<owner>/<dataset>[:<split>]'; "
        f"got {source!r}"
    )


def answer_for_grading(completion: str) -> str:
    """The completion as graded: unchanged when it has a \\boxed{}; else, when it has
    ``<answer>...</answer>`` tags, their last content boxed; else the line after the last "answer
    is" / "answer:" (`answer.free_span`); else the completion's last number that is no operand of an
    expression, boxed (`answer.free_number`); else "" (no answer: math-verify would otherwise pick a
    number of a restated question, "Let me compute 94+22.").

    Numbers in scientific notation are written out first (`scientific_written_out`): math-verify
    reads "2e3" as 2*e*3 in a box and as 2 in text, "1e100" as 1. Of a text longer than
    `MAX_GRADED_CHARS`, its end (where the last box is) is graded: math-verify's time grows with it."""
    completion = scientific_written_out(completion)
    if "\\boxed" in completion:
        return completion[-MAX_GRADED_CHARS:]
    tagged = last_answer_tags(completion)
    if tagged is not None and tagged.strip():
        return ("\\boxed{" + tagged.strip() + "}")[-MAX_GRADED_CHARS:]
    span, explicit = free_span(completion)
    if explicit:
        return span.strip().split("\n", 1)[0][-MAX_GRADED_CHARS:]
    number = free_number(completion)
    return "" if number is None else ("\\boxed{" + str(number) + "}")[-MAX_GRADED_CHARS:]


def scientific_written_out(text: str) -> str:
    """`text` with each number in scientific notation written as the number it is, in digits ("2e3"
    -> "2000", "1.5E-2" -> "0.015", "1e100" -> 1 and 100 zeros, exact), or, past `_MAX_WRITTEN_OUT`
    digits (or once `_WRITTEN_OUT_BUDGET` is spent), as "$m\\times10^{k}$" ("1e1000" ->
    "$1\\times10^{1000}$", the dollars left out inside $...$; exact too, no longer than what it replaces
    but for 12 characters).
    Linear in the length of `text`, whatever its numbers."""
    budget, dollars, read_to = _WRITTEN_OUT_BUDGET, 0, 0

    def replace(match: re.Match) -> str:
        nonlocal budget, dollars, read_to
        dollars += text.count("$", read_to, match.start())  # counted once over the text: linear
        read_to = match.start()
        mantissa, sign, exponent = match.groups()
        digits = exponent.lstrip("0") or "0"
        # the written-out length, from the exponent's length first: int() of 5000 digits raises
        if len(digits) <= len(str(_MAX_WRITTEN_OUT)) and int(digits) + len(mantissa) + 2 <= min(
            _MAX_WRITTEN_OUT, budget
        ):
            written = format(Decimal(match.group(0)), "f")
            budget -= len(written)
            return written
        latex = f"{mantissa}\\times10^{{{sign.replace('+', '')}{digits}}}"
        return latex if dollars % 2 else f"${latex}$"  # in $: math-verify reads it in text too, not in "$x = $"

    return _SCIENTIFIC.sub(replace, text)


def last_answer_tags(completion: str) -> str | None:
    """The content of the last ``<answer>...</answer>`` pair, each opening tag closed by the first
    closing tag after it (what ``re.findall(r"<answer>(.*?)</answer>", ..., re.DOTALL)[-1]`` gives),
    found in one pass: the pattern itself rescans the rest of the text from every unclosed tag
    (25 s on 160 KB of them). None without a pair."""
    content, start = None, completion.find("<answer>")
    while start >= 0:
        end = completion.find("</answer>", start + len("<answer>"))
        if end < 0:
            break
        content = completion[start + len("<answer>") : end]
        start = completion.find("<answer>", end + len("</answer>"))
    return content


@dataclass
class MathTask:
    """A math benchmark as a Task: the SAGE prompt and math-verify grading."""

    source: str
    template: str = "sage"
    gold_parsing: str = "boxed"
    name: str = field(init=False)
    _problems: list[Problem] = field(init=False, repr=False)

    def __post_init__(self):
        if self.template not in TEMPLATES and "{question}" not in self.template:
            raise ValueError(
                f"template must be one of {sorted(TEMPLATES)} or contain '{{question}}', got {self.template!r}"
            )
        if self.gold_parsing not in ("boxed", "bare"):
            raise ValueError(f"gold_parsing must be 'boxed' or 'bare', got {self.gold_parsing!r}")
        self.name, self._problems = load_source(self.source)

    def problems(self, split: str = "test", n: int | None = None, seed: int = 0) -> list[Problem]:
        """The first `n` problems (all for None); see the module docstring for split and seed."""
        if n is not None and n < 0:
            raise ValueError(f"n must be >= 0 or None, got {n}")
        return list(self._problems if n is None else self._problems[:n])

    def prompt(self, problem: Problem) -> str:
        template = TEMPLATES.get(self.template, self.template)
        return template.replace("{question}", problem.question)

    def score(self, completion: str, problem: Problem) -> float:
        return self.score_batch([completion], [problem])[0]

    def score_batch(self, completions: list[str], problems: list[Problem]) -> list[float]:
        """`score` of many (completion, problem) pairs, graded in parallel."""
        # a gold in scientific notation is read as the same number ("1e100"; math-verify: 1*e*100)
        golds = (scientific_written_out(p.answer) if self.gold_parsing == "boxed" else p.answer for p in problems)
        pairs = zip(map(answer_for_grading, completions), golds)
        return math_rewards(pairs, box_gold=self.gold_parsing == "boxed")
