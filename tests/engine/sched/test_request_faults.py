"""One request's failure ends that request alone: a fault injected into one request's output
processing (its stop check, its beam search) fails it with a typed error, frees its blocks,
and the requests beside it finish equal to an undisturbed run."""

import pytest
from kvpager.engine import InvalidRequestError, SamplingParams
from kvpager.engine.request import Request
from kvpager.engine.sched.beam_search import BeamSearchGroup

from tests.engine.helpers import assert_all_free, make_llm, random_prompts

MARK = 7  # a faulty request's prompt starts with this token
PROMPTS = random_prompts([12, 30, 9, 21], seed=3)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PARALLEL = SamplingParams(temperature=0.0, max_tokens=12, n=2, ignore_eos=True)
BEAMS = SamplingParams(temperature=0.0, max_tokens=6, beam_width=2, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    engine = make_llm(tiny_llama, num_blocks=64, max_num_seqs=8)
    yield engine
    engine.close()


def _faulty(prompts: list[list[int]], index: int) -> list[list[int]]:
    marked = [list(p) for p in prompts]
    marked[index][0] = MARK
    return marked


def _tokens(outputs) -> list[list[list[int]]]:
    return [[o.token_ids for o in out.outputs] for out in outputs]


def test_a_fault_in_one_request_fails_it_alone(llm, monkeypatch):
    prompts = _faulty(PROMPTS, 1)
    params = [GREEDY, GREEDY, PARALLEL, GREEDY]
    undisturbed = _tokens(llm.generate(prompts, params))
    check_stop = Request.check_stop

    def faulty_check_stop(self):
        if self.prompt_token_ids[0] == MARK and self.num_output_tokens == 4:
            raise RuntimeError("injected fault")
        return check_stop(self)

    monkeypatch.setattr(Request, "check_stop", faulty_check_stop)
    outputs = llm.generate(prompts, params)
    failed = outputs[1].outputs[0]
    assert failed.finish_reason == "error" and "injected fault" in failed.error.message
    assert failed.error.type == "internal_error"
    for i in (0, 2, 3):
        assert _tokens([outputs[i]])[0] == undisturbed[i]
        assert all(o.finish_reason == "length" for o in outputs[i].outputs)
    assert_all_free(llm)


def test_a_fault_in_one_beam_search_fails_it_alone(llm, monkeypatch):
    prompts = _faulty(PROMPTS[:3], 0)
    params = [BEAMS, GREEDY, BEAMS]
    undisturbed = _tokens(llm.generate(prompts, params))
    select = BeamSearchGroup.select

    def faulty_select(self, beams):
        if beams[0].prompt_token_ids[0] == MARK:
            raise OverflowError("injected fault")
        return select(self, beams)

    monkeypatch.setattr(BeamSearchGroup, "select", faulty_select)
    outputs = llm.generate(prompts, params)
    assert {o.finish_reason for o in outputs[0].outputs} == {"error"}
    assert _tokens(outputs[1:]) == undisturbed[1:]
    assert_all_free(llm)


def test_length_penalty_is_bounded(llm):
    with pytest.raises(InvalidRequestError) as error:
        llm.generate([[5, 6]], {"beam_width": 2, "temperature": 0.0, "length_penalty": 2000})
    assert error.value.param == "length_penalty"
    bounded = {"beam_width": 2, "temperature": 0.0, "length_penalty": 10.0, "max_tokens": 4}
    outputs = llm.generate([PROMPTS[0]], bounded)
    assert outputs[0].outputs[0].finish_reason in ("length", "stop")
    assert_all_free(llm)
