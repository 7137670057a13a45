"""Prompts in a chat model's format: `ChatPromptTask` wraps any task so that its prompts go
through a chat template, after an optional system prompt (`SYSTEM_PROMPTS` by name, or literal
text). The same wrapping serves the warm start, RL and evaluation (the ``chat_template`` and
``system_prompt`` keys of a run, ``--chat-template`` / ``--system-prompt`` of sage-eval).

Templates (`CHAT_TEMPLATES`): "tokenizer" is the tokenizer's own (instruction-tuned models such
as R1-Distill); "official" is the official SAGE template for base models (Qwen2.5-Math-7B):
the system message and EOS, then each user message's raw text and each assistant message
followed by EOS, and the generation prompt is the literal ``<start_working_out>``; without a
system message the official system prompt is used. `use_chat_template` installs it on the
tokenizer, so ``save_pretrained`` saves it with the model and an evaluation reads it back.

The official answer format: working out between ``<start_working_out>`` and ``<end_working_out>``,
then the answer between ``<SOLUTION>`` and ``</SOLUTION>`` (the official runs stop generation at
``</SOLUTION>``); `official_sft_completion` writes a worked solution in it for the warm start.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Problem

REASONING_START, REASONING_END = "<start_working_out>", "<end_working_out>"
SOLUTION_START, SOLUTION_END = "<SOLUTION>", "</SOLUTION>"

#: system prompts by name: "sage" is this package's own reasoning prompt (a boxed final answer);
#: "official" the official SAGE code's (training and evaluation alike)
SYSTEM_PROMPTS = {
    "sage": (
        "You are a helpful assistant that solves math problems. Think through the problem step by "
        "step before answering, then give the final answer within \\boxed{}, e.g. \\boxed{42}."
    ),
    "official": (
        "You are given a problem.\nThink about the problem and provide your working out.\n"
        f"Place it between {REASONING_START} and {REASONING_END}.\n"
        f"Then, provide your solution between {SOLUTION_START}{SOLUTION_END}"
    ),
}

#: the official SAGE chat template for base models (module docstring), in Jinja as HF renders it
OFFICIAL_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{ messages[0]['content'] + eos_token }}{%- set turns = messages[1:] -%}"
    "{%- else -%}"
    "{{ " + repr(SYSTEM_PROMPTS["official"]) + " + eos_token }}{%- set turns = messages -%}"
    "{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if message['role'] == 'user' -%}{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}{{ message['content'] + eos_token }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}" + REASONING_START + "{%- endif -%}"
)

#: the names the ``chat_template`` key takes ("" is off)
CHAT_TEMPLATES = ("tokenizer", "official")


def use_chat_template(tokenizer, name: str):
    """`tokenizer` ready for chat template `name`: "official" installs `OFFICIAL_CHAT_TEMPLATE`
    on it (saved with it from then on); "tokenizer" requires its own. Returns `tokenizer`."""
    if name not in CHAT_TEMPLATES:
        raise ValueError(f"chat_template must be '' or one of {list(CHAT_TEMPLATES)}, got {name!r}")
    if name == "official":
        tokenizer.chat_template = OFFICIAL_CHAT_TEMPLATE
    elif getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("chat_template 'tokenizer': this tokenizer has no chat template of its own")
    return tokenizer


def system_prompt_text(name_or_text: str) -> str:
    """The system prompt called `name_or_text` in `SYSTEM_PROMPTS`, else the text itself."""
    return SYSTEM_PROMPTS.get(name_or_text, name_or_text)


def official_sft_completion(solution: str, answer: str) -> str:
    """A worked solution and its answer in the official format, as the completion after the
    official generation prompt (which already holds ``<start_working_out>``): the solution
    without ``<think>`` tags, stripped, then ``<end_working_out><SOLUTION>answer</SOLUTION>``."""
    thoughts = solution.replace("<think>", "").replace("</think>", "").strip()
    return thoughts + REASONING_END + SOLUTION_START + answer + SOLUTION_END


class ChatPromptTask:
    """`task` with each prompt put through a chat template (`CHAT_TEMPLATES`): an optional system
    message (`SYSTEM_PROMPTS` name or literal text; "" for none), then the task's prompt as the
    user message, then the assistant's generation prompt. Everything else is `task`'s."""

    def __init__(self, task, tokenizer, system_prompt: str = "", chat_template: str = "tokenizer") -> None:
        self.task, self.tokenizer = task, use_chat_template(tokenizer, chat_template)
        self.system = system_prompt_text(system_prompt)

    def __getattr__(self, name):
        return getattr(self.task, name)

    def prompt(self, problem: Problem) -> str:
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": self.task.prompt(problem)})
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@dataclass(frozen=True)
class ChatSettings:
    """A run's prompts through a chat template (``chat_template``: "" none, or one of `CHAT_TEMPLATES`)
    with a ``system_prompt`` ("" none, a name of `SYSTEM_PROMPTS`, or the text)."""

    chat_template: str
    system_prompt: str


def chat_prompted(chat: ChatSettings, task, tokenizer):
    """`task` with its prompts through a run's chat template, else `task` ("official" installs the
    template on `tokenizer`)."""
    if not chat.chat_template:
        return task
    return ChatPromptTask(task, tokenizer, chat.system_prompt, chat.chat_template)
