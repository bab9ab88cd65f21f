"""benchmarks/compiled_decoder.py compares like with like: the plain-torch DecoderGraph it
compiles, run eagerly around the engine's paged attention (custom op and all), generates the
tokens the engine's own decoder does, and the decoder class is left as it was."""

from kvpager.engine import SamplingParams
from kvpager.engine.model.decoder import Decoder

from benchmarks.engine.compiled_decoder import TimedForward, plain_layer_weights, use_graph
from tests.engine.helpers import assert_all_free, make_llm, random_prompts


def test_the_decoder_graph_generates_what_the_engines_decoder_does(tiny_llama):
    prompts = random_prompts([5, 17, 33, 2])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    original_build = Decoder.build_matmuls
    with plain_layer_weights():
        graph_llm = make_llm(tiny_llama, attention_backend="cpu")
    assert Decoder.build_matmuls is original_build
    use_graph(graph_llm, compiled=False)
    assert isinstance(graph_llm.executor.model, TimedForward)
    engine_llm = make_llm(tiny_llama, attention_backend="cpu")
    theirs = [o.outputs[0].token_ids for o in graph_llm.generate(prompts, params, use_tqdm=False)]
    ours = [o.outputs[0].token_ids for o in engine_llm.generate(prompts, params, use_tqdm=False)]
    assert theirs == ours and all(len(ids) == 12 for ids in ours)
    for llm in (graph_llm, engine_llm):
        assert_all_free(llm)
        llm.close()
