"""Evaluation through the engine interface: a rank's whole share in one generate call, inside one
awake session, each problem drawn with its own seed (so batching does not change its samples)."""

import contextlib

import pytest
import torch
from tiny_models import step_context, tiny_model

from sage_train.build import derived_max_model_len
from sage_train.config import ConfigError
from sage_train.eval.evaluate import evaluate_engine
from sage_train.inputs import evaluation_sets, held_out_problems, run_prompts, run_settings
from sage_train.models.loading import build_char_tokenizer
from sage_train.rollout import SamplingParams
from sage_train.rollout.base import derive_seed
from sage_train.rollout.hf import HFEngine
from sage_train.run import evaluate_once
from sage_train.step import collect_groups
from sage_train.tasks import get_task


class CountingEngine(HFEngine):
    """The hf engine, recording what a caller asks of it through the interface."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls, self.syncs, self.sessions, self.awake_calls = [], 0, 0, []
        self._depth = 0

    def generate(self, prompts, params):
        self.calls.append(len(prompts))
        self.awake_calls.append(self._depth > 0)
        return super().generate(prompts, params)

    def sync_weights(self, model):
        self.syncs += 1
        super().sync_weights(model)

    @contextlib.contextmanager
    def awake(self):
        self.sessions += self._depth == 0  # outermost sessions: those that would wake the engine
        self._depth += 1
        try:
            yield self
        finally:
            self._depth -= 1


def engine_and_task(**options):
    tokenizer = build_char_tokenizer()
    return (
        CountingEngine(tiny_model(tokenizer, seed=3), tokenizer, **options),
        tokenizer,
        get_task("arithmetic", digits=2),
    )


def texts_by_problem(engine, task, problems, **options):
    seen = {}
    evaluate_engine(
        engine,
        task,
        problems,
        n=3,
        ks=[1, 3],
        sampling=SamplingParams(max_new_tokens=6, min_p=0.05),
        seeds=[7],
        on_record=lambda record, texts, scores: seen.setdefault(record["problem_id"], texts),
        **options,
    )
    return seen


def test_one_generate_call_per_seed_in_one_session_and_samples_independent_of_batching():
    engine, _, task = engine_and_task()
    problems = list(task.problems("test", 6, 0))
    together = texts_by_problem(engine, task, problems)
    assert engine.calls == [6] and engine.sessions == 1 and engine.awake_calls == [True]
    assert engine.syncs == 0  # evaluation pushes nothing: the engine was synced before

    alone = texts_by_problem(engine, task, problems[2:3])
    in_pairs = texts_by_problem(engine, task, problems, problems_per_call=2)
    assert engine.calls[1:] == [1, 2, 2, 2]
    assert alone[problems[2].id] == together[problems[2].id]
    assert in_pairs == together
    assert len({tuple(t) for t in together.values()}) > 1  # problems do not share one draw


def test_row_cap_splits_a_call_without_changing_its_samples():
    tokenizer = build_char_tokenizer()
    model = tiny_model(tokenizer, seed=4)
    params = SamplingParams(n=3, max_new_tokens=8, top_k=20, seed=11)
    prompts = ["1+2=", "31+40=", "7=", "99+1="]
    whole = HFEngine(model, tokenizer).generate(prompts, params)
    pieces = HFEngine(model, tokenizer, max_rows=4).generate(prompts, params)  # 1 prompt x 3 rows per piece
    assert [[c.completion_ids for c in g] for g in pieces] == [[c.completion_ids for c in g] for g in whole]
    assert [c.prompt_index for g in pieces for c in g] == [i for i in range(4) for _ in range(3)]
    for a, b in zip(sum(whole, []), sum(pieces, [])):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    twice = HFEngine(model, tokenizer).generate(["12+3=", "12+3="], params)  # prompts never share noise
    assert [c.completion_ids for c in twice[0]] != [c.completion_ids for c in twice[1]]
    # the call's seed gives prompt i the seed derive_seed(seed, i): the same as passing it explicitly
    explicit = SamplingParams(n=3, max_new_tokens=8, top_k=20, prompt_seeds=tuple(derive_seed(11, i) for i in range(4)))
    again = HFEngine(model, tokenizer).generate(prompts, explicit)
    assert [[c.completion_ids for c in g] for g in again] == [[c.completion_ids for c in g] for g in whole]


def test_evaluate_once_one_call_per_split_inside_one_session(tiny_config, tmp_path, distributed):
    engine, tokenizer, task = engine_and_task()
    cfg = tiny_config(eval_problems=5, eval_samples=2, eval_splits=["train", "test"], task_options={"digits": 2})
    train_problems = list(task.problems("train", None, cfg.seed))
    evaluation = run_settings(cfg).evaluation
    held_out = held_out_problems(evaluation, cfg.seed, cfg.task, task, train_problems)
    evaluations = evaluation_sets(evaluation, task, task, train_problems, held_out)
    ctx = step_context(cfg, rollout=engine, tokenizer=tokenizer, task=task, problems=train_problems)
    ctx.evaluations = evaluations
    results = evaluate_once(ctx, tmp_path / "eval.json")
    assert engine.calls == [5, 5] and engine.sessions == 1 and engine.awake_calls == [True, True]
    assert engine.syncs == 0
    assert results["train"]["problems"] == results["test"]["problems"] == 5
    assert (tmp_path / "eval.json").is_file()
    evaluate_once(ctx, tmp_path / "eval.json")  # done: read back, nothing sampled
    assert engine.calls == [5, 5]


def test_dynamic_sampling_rounds_of_a_step_share_one_awake_session(tiny_config, distributed):
    """DAPO's extra rounds are generate calls of the same step: one session, so an engine that
    sleeps between sessions (vllm) wakes, and receives the weights, once per step."""
    engine, tokenizer, task = engine_and_task()
    cfg = tiny_config(dynamic_sampling=True, dynamic_sampling_max_rounds=3, prompts_per_step=4, group_size=2)
    train_problems = list(task.problems("train", None, cfg.seed))
    ctx = step_context(cfg, rollout=engine, tokenizer=tokenizer, task=task, problems=train_problems)
    groups, rewards, rounds = collect_groups(ctx, step=1)
    informative = sum(len(set(r)) > 1 for r in rewards.tolist())
    assert rounds == len(engine.calls) and (rounds == 3 or informative == 4)
    assert rounds > 1  # the untrained model's groups are mostly all-wrong: more rounds were drawn
    assert engine.sessions == 1 and all(engine.awake_calls) and len(groups) == 4


def test_vllm_context_length_is_the_longest_prompt_plus_the_longest_completion(tiny_config):
    cfg = tiny_config(max_new_tokens=4, eval_max_new_tokens=9, eval_problems=3, eval_splits=["train", "test"])
    tokenizer = build_char_tokenizer()
    task = get_task("arithmetic", digits=3)
    train_problems = list(task.problems("train", None, cfg.seed))[:10]
    s = run_settings(cfg)
    held_out = held_out_problems(s.evaluation, cfg.seed, cfg.task, task, train_problems)
    prompts = list(
        run_prompts(task, train_problems, evaluation_sets(s.evaluation, task, task, train_problems, held_out))
    )
    assert len(prompts) == 10 + 3 + 3  # the RL pool, then each evaluation split
    assert prompts[-3:] == [task.prompt(p) for p in task.problems("test", 3, cfg.seed)]
    longest = max(map(len, prompts))  # one token per character
    assert derived_max_model_len(s.rollout, tokenizer, prompts) == longest + 9
    longer = run_settings(tiny_config(max_new_tokens=12)).rollout
    assert derived_max_model_len(longer, tokenizer, prompts) == longest + 12
    with pytest.raises(ConfigError, match="'vllm_max_model_len' is 0"):
        derived_max_model_len(s.rollout, tokenizer, [])
