"""The offline LLM's logprobs in vLLM's shape, so code written for vLLM reads them unchanged:
`outputs[i].logprobs` one {token id: Logprob} per generated token (the sampled token first,
then the top alternatives by rank), `prompt_logprobs` None then one such dict per token."""

import torch
from kvpager.engine.frontend.outputs import Logprob
from kvpager.schemas.sampling import SamplingParams
from transformers import AutoModelForCausalLM

from tests.engine.helpers import assert_all_free, make_llm


def test_sample_logprobs_are_vllms_dicts(tiny_llama):
    llm = make_llm(tiny_llama)
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=2)
    prompt = [5, 17, 42, 9, 33]
    output = llm.generate([prompt], params, use_tqdm=False)[0]
    completion = output.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 4
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion.token_ids])).logits[0]
    rows = logits.log_softmax(dim=-1)[len(prompt) - 1 : -1]
    for token_id, entry, row in zip(completion.token_ids, completion.logprobs, rows):
        assert isinstance(entry, dict) and next(iter(entry)) == token_id  # the sampled first
        assert all(isinstance(lp, Logprob) for lp in entry.values())
        top_values, top_ids = row.topk(3)
        ranked = [tid for tid, lp in entry.items() if lp.rank is not None]
        assert ranked == top_ids.tolist()  # greedy: the sampled token is rank 1
        for rank, (tid, value) in enumerate(zip(top_ids.tolist(), top_values.tolist()), 1):
            assert entry[tid].rank == rank and abs(entry[tid].logprob - value) < 1e-3
            assert entry[tid].decoded_token == llm.tokenizer.decode([tid])
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
    for token_id, entry in zip(prompt[1:], output.prompt_logprobs[1:]):
        assert next(iter(entry)) == token_id and isinstance(entry[token_id].rank, int)
    assert_all_free(llm)
