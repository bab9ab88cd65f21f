"""A structured request whose grammar fails in the executor ends alone with a typed error: a
matcher that errs mid-generation (its request never goes on unconstrained), a compile past
its time budget. The requests beside it finish equal to an undisturbed run, and every block
is free after."""

import threading

import pytest
from kvpager.engine import SamplingParams, StructuredOutputsParams
from kvpager.engine.structured.grammar import GrammarCompiler
from kvpager.engine.worker.grammar_rows import GrammarRows
from kvpager.schemas.scheduler import StepOutput

from tests.engine.helpers import assert_all_free, make_llm, random_prompts

PROMPTS = random_prompts([12, 20, 9], seed=5)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
CHOICE = SamplingParams(
    temperature=1.0,
    seed=3,
    max_tokens=40,
    structured_outputs=StructuredOutputsParams(choice=["alpha beta gamma", "delta epsilon"]),
)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    engine = make_llm(tiny_llama, num_blocks=64, max_num_seqs=8)
    yield engine
    engine.close()


def _refused_token(matcher, vocab_size: int) -> int:
    """A token the matcher's mask forbids now."""
    mask = matcher.compute_bitmask()
    for token in range(vocab_size):
        if not mask[token // 8] >> (token % 8) & 1:
            return token
    raise AssertionError("the grammar allows every token")


def _tokens(outputs) -> list[list[list[int]]]:
    return [[o.token_ids for o in out.outputs] for out in outputs]


def test_a_matcher_in_error_ends_its_request_with_a_typed_error(llm, monkeypatch):
    params = [GREEDY, CHOICE, GREEDY]
    undisturbed = llm.generate(PROMPTS, params, use_tqdm=False)
    assert undisturbed[1].outputs[0].text in CHOICE.structured_outputs.choice
    accept = GrammarRows.accept
    vocab_size = llm.model_config.vocab_size

    def erring_accept(self, state, token_ids):
        accept(self, state, token_ids)
        matcher = self.matchers.get(state.seq_id)
        if matcher is not None and len(state.output_token_ids) == 2:  # mid-generation
            matcher.consume_token(_refused_token(matcher, vocab_size))
            assert matcher.is_error()

    monkeypatch.setattr(GrammarRows, "accept", erring_accept)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    failed = outputs[1].outputs[0]
    assert failed.finish_reason == "error", failed
    assert failed.error.type == "invalid_request" and "mid-generation" in failed.error.message
    assert len(failed.token_ids) <= 2  # nothing sampled after the error is kept
    for i in (0, 2):
        assert _tokens([outputs[i]]) == _tokens([undisturbed[i]])
    assert_all_free(llm)


def test_a_compile_past_its_budget_fails_its_request_alone(llm, monkeypatch):
    params = [GREEDY, CHOICE, GREEDY]
    undisturbed = llm.generate(PROMPTS, params, use_tqdm=False)
    grammars = llm.executor.grammars
    monkeypatch.setattr(grammars, "_compiler", None)  # a compile from scratch: slower
    real = GrammarCompiler.from_tokenizer_json
    release = threading.Event()

    def held(*args):  # the compile cannot finish before the step has given up on it
        release.wait(timeout=60)
        return real(*args)

    monkeypatch.setattr(GrammarCompiler, "from_tokenizer_json", held)
    monkeypatch.setattr(grammars._thread, "timeout_s", 1e-9)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    release.set()
    failed = outputs[1].outputs[0]
    assert failed.finish_reason == "error" and failed.error.type == "invalid_request"
    assert "to compile" in failed.error.message and not failed.token_ids
    for i in (0, 2):
        assert _tokens([outputs[i]]) == _tokens([undisturbed[i]])
    assert_all_free(llm)
    monkeypatch.undo()
    again = llm.generate(PROMPTS, params, use_tqdm=False)  # the next compile works
    assert again[1].outputs[0].text in CHOICE.structured_outputs.choice


def test_the_scheduler_fails_a_row_the_executor_reports():
    """Hand-made outputs: a `failed` row ends its request (every sample) with invalid_request
    and frees its blocks; the request beside it keeps its token and runs on."""
    from tests.engine.sched.test_scheduler import add, make_scheduler, run_step

    scheduler = make_scheduler(num_blocks=16)
    victim = add(scheduler, "victim", 6, max_tokens=4, n=2, temperature=1.0)
    other = add(scheduler, "other", 5, max_tokens=4)
    step = scheduler.schedule()
    rows = [s for s in step.num_scheduled_tokens if scheduler.seqs[s].num_output_placeholders]
    output = StepOutput(step.step_id, rows, [7] * len(rows), failed={victim.seq_id: "no mask"})
    scheduler.update_from_output(step, output)
    scheduler.check_invariants()
    failed = scheduler.take_failed()
    assert list(failed) == ["victim"] and failed["victim"].type == "invalid_request"
    assert failed["victim"].message == "no mask"
    assert victim.is_finished and "victim" not in scheduler.groups
    assert other.output_token_ids == [7] and not other.is_finished
    while scheduler.has_unfinished:
        run_step(scheduler)
    assert other.output_token_ids == [7] * 4
    assert scheduler.block_manager.num_free_blocks == 16
