"""Prompts in a chat model's format: `ChatPromptTask` wraps any task so that its prompts go
through the tokenizer's chat template, after an optional system prompt (`SYSTEM_PROMPTS` by
name, or literal text)."""

from __future__ import annotations

from .base import Problem

#: system prompts by name; "sage" is this package's own reasoning prompt (a boxed final answer)
SYSTEM_PROMPTS = {
    "sage": (
        "You are a helpful assistant that solves math problems. Think through the problem step by "
        "step before answering, then give the final answer within \\boxed{}, e.g. \\boxed{42}."
    ),
}


class ChatPromptTask:
    """`task` with each prompt put through the tokenizer's chat template: an optional system
    message (`SYSTEM_PROMPTS` name or literal text; "" for none), then the task's prompt as the
    user message, then the assistant's generation prompt. Everything else is `task`'s."""

    def __init__(self, task, tokenizer, system_prompt: str = "") -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("chat_template: this tokenizer has no chat template")
        self.task, self.tokenizer = task, tokenizer
        self.system = SYSTEM_PROMPTS.get(system_prompt, system_prompt)

    def __getattr__(self, name):
        return getattr(self.task, name)

    def prompt(self, problem: Problem) -> str:
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": self.task.prompt(problem)})
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
