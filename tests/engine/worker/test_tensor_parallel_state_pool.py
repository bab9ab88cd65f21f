"""The one-pool split (engine/kv/state_pool.py) over two gloo ranks on a Granite 4 hybrid:
each rank carves its heads' state rows out of its own budget, both come to the same counts
(a rank's state and KV heads both halve), and a budget of 2 slots with max_num_seqs 8 serves
every request greedy-equal to transformers; every block and slot free after."""

from kvpager.engine import SamplingParams
from kvpager.engine.kv.state_pool import STATE_SHARE

from tests.engine.helpers import random_prompts
from tests.engine.model.hybrid_checks import assert_slots_free
from tests.engine.worker.test_tensor_parallel import (  # noqa: F401 (an autouse fixture)
    greedy,
    hf_greedy,
    one_thread_per_rank,
    tp_llm,
)
from tests.model_families import build_granite_hybrid


def test_each_rank_carves_the_same_slots_from_its_budget(tmp_path):
    path = build_granite_hybrid(tmp_path, seed=35)
    prompts = random_prompts([2, 7, 4, 11, 5, 3], seed=36)
    with tp_llm(path, num_blocks=4, max_num_seqs=1) as probe:
        slot_bytes = probe.executor.pool.slot_bytes  # one rank's heads
    budget = int(2.9 * slot_bytes / STATE_SHARE)
    with tp_llm(path, num_blocks=None, kv_cache_memory=budget, max_num_seqs=8) as llm:
        pool = llm.executor.pool
        assert pool.num_slots == 2 and pool.total_bytes <= budget
        params = SamplingParams(temperature=0.0, max_tokens=6)
        assert greedy(llm, prompts, params) == hf_greedy(path, prompts, 6)
        assert llm.stats()["peak_running"] <= 2
        assert_slots_free(llm)
