"""The official SAGE prompt format: its system prompt and base-model chat template (saved with
the tokenizer), the warm start's target format and filters, and a whole run (SFT with the adapter
continued, RL) in that format on a tiny model."""

import json

from transformers import AutoTokenizer

from sage_train.config import build, resolve
from sage_train.inputs import run_settings
from sage_train.models.loading import build_char_tokenizer
from sage_train.sft import sft_examples
from sage_train.tasks import get_task
from sage_train.tasks.chat import OFFICIAL_CHAT_TEMPLATE, SYSTEM_PROMPTS, ChatPromptTask

SYSTEM = (
    "You are given a problem.\nThink about the problem and provide your working out.\n"
    "Place it between <start_working_out> and <end_working_out>.\n"
    "Then, provide your solution between <SOLUTION></SOLUTION>"
)
OMR_ROWS = [
    {"problem": "What is 3 * 4?", "expected_answer": "12", "generated_solution": "<think>\n3*4 = 12\n</think>\n"},
    {"problem": "Simplify x + x.", "expected_answer": "2x", "generated_solution": "x + x = 2x"},
    {"problem": "What is 1 / 4?", "expected_answer": "0.25", "generated_solution": "1/4 = 0.25 " * 40},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_official_template_renders_and_saves_with_the_tokenizer(tmp_path):
    tokenizer = build_char_tokenizer()
    task = get_task(f"jsonl:{write_jsonl(tmp_path / 'omr.jsonl', OMR_ROWS)}", template="plain")
    problem = task.problems("train", 1, 0)[0]
    eos = tokenizer.eos_token
    chat = ChatPromptTask(task, tokenizer, "official", "official")
    assert SYSTEM_PROMPTS["official"] == SYSTEM
    assert chat.prompt(problem) == SYSTEM + eos + "What is 3 * 4?" + "<start_working_out>"
    # without a system message the template puts the official one first
    assert ChatPromptTask(task, tokenizer, "", "official").prompt(problem) == chat.prompt(problem)
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "V"},
    ]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == f"S{eos}UA{eos}V"
    tokenizer.save_pretrained(tmp_path / "saved")
    assert AutoTokenizer.from_pretrained(tmp_path / "saved").chat_template == OFFICIAL_CHAT_TEMPLATE


def test_official_warm_start_examples(tmp_path):
    tokenizer = build_char_tokenizer()
    path = write_jsonl(tmp_path / "omr.jsonl", OMR_ROWS)
    task = ChatPromptTask(get_task(f"jsonl:{path}", template="plain"), tokenizer, "official", "official")
    problems = task.problems("train", None, 0)
    cfg = resolve(build({"sft_format": "official", "sft_max_example_tokens": 400, "sft_steps": 1}))
    examples = sft_examples(task, problems, tokenizer, run_settings(cfg).sft, cfg.sft_task or cfg.task)
    # "2x" is not numeric and the third example is longer than 400 tokens: one is left
    assert len(examples) == 1
    prompt, completion = examples[0]
    text = tokenizer.decode(prompt + completion)
    assert text == (
        SYSTEM + "<eos>What is 3 * 4?<start_working_out>3*4 = 12<end_working_out><SOLUTION>12</SOLUTION><eos>"
    )
    # the official SFT text: the conversation with the assistant's turn, through the same template
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is 3 * 4?"},
        {"role": "assistant", "content": "<start_working_out>3*4 = 12<end_working_out><SOLUTION>12</SOLUTION>"},
    ]
    assert text == tokenizer.apply_chat_template(messages, tokenize=False)
    raw_cfg = resolve(build({"sft_steps": 1}))
    raw = sft_examples(task, problems, tokenizer, run_settings(raw_cfg).sft, raw_cfg.sft_task or raw_cfg.task)
    assert len(raw) == 3 and tokenizer.decode(raw[1][1]) == "x + x = 2x<eos>"


def test_a_run_in_the_official_format(tiny_config, distributed, tmp_path):
    from sage_train.run import train

    path = write_jsonl(tmp_path / "omr.jsonl", OMR_ROWS * 2)
    cfg = tiny_config(
        name="official",
        task=f"jsonl:{path}",
        task_options={"template": "plain"},
        chat_template="official",
        system_prompt="official",
        sft_format="official",
        sft_epochs=1,
        sft_batch_size=1,
        sft_lr_schedule="linear",
        sft_warmup_steps=1,
        sft_weight_decay=0.01,
        sft_adapter="continue",
        lora_rank=2,
        steps=2,
        prompts_per_step=1,
        group_size=2,
        steps_per_generation=2,
        micro_batch_size=2,
        max_new_tokens=6,
        stop=["</SOLUTION>"],
        max_prompt_length=300,
        tiny_max_positions=512,
    )
    summary = train(cfg)
    assert summary["steps_done"] == 2
    saved = AutoTokenizer.from_pretrained(cfg.run_dir / "final")
    assert saved.chat_template == OFFICIAL_CHAT_TEMPLATE  # evaluation reads the template from here
