"""The state-slot protocol end to end below the decoder: the real scheduler plans steps for
a recurrent model (state slots, small prefill chunks, several requests of different lengths,
n > 1 forks, recompute preemption), the executor's StateCache applies each step's slot ids,
and a Mamba2 mixer runs every scheduled sequence in its slot. Every sequence's outputs, over
all the steps that computed it, equal transformers' GraniteMoeHybridMambaLayer run once over
the sequence's whole token list (fp32); every block and slot is free at the end."""

import pytest
import torch
from kvpager.engine.model.mamba2 import RecurrentStates
from kvpager.engine.request import RequestStatus
from kvpager.engine.worker.state_cache import StateCache
from kvpager.schemas.scheduler import StepOutput

from tests.engine.model.test_mamba2 import HIDDEN, hf_layer, ours
from tests.engine.sched.test_scheduler import add, make_scheduler

VOCAB = 50


def run(scheduler, mixer, cache: StateCache, embed, done, outputs) -> None:
    """One step as an executor with only this mixer would run it; tokens drawn per step."""
    step = scheduler.schedule()
    for seq_id, slot in step.state_slots.items():
        if slot in step.state_resets:  # new, or recomputed after a preemption: from zero
            done[seq_id], outputs[seq_id] = 0, []
    cache.before_forward(step)
    lens = list(step.num_scheduled_tokens.values())
    if lens:
        ids = []
        for seq_id, n in step.num_scheduled_tokens.items():
            start = done.get(seq_id, 0)
            ids += scheduler.seqs[seq_id].all_token_ids[start : start + n]
        out = mixer(embed[ids], lens, cache.slots(step), cache.states.conv[0], cache.states.ssm[0])
        for (seq_id, n), piece in zip(step.num_scheduled_tokens.items(), out.split(lens)):
            outputs.setdefault(seq_id, []).append(piece)
            done[seq_id] = done.get(seq_id, 0) + n
    cache.after_forward(step)
    for fork in step.forks:  # the child shares what its parent computed
        outputs[fork.child_id] = list(outputs[fork.parent_id])
        done[fork.child_id] = done[fork.parent_id]
    sampled = [
        seq_id
        for seq_id in step.num_scheduled_tokens
        if scheduler.seqs[seq_id].num_output_placeholders
    ] + [fork.child_id for fork in step.forks]
    tokens = [(step.step_id * 7 + i * 3) % VOCAB + 3 for i in range(len(sampled))]
    scheduler.update_from_output(step, StepOutput(step.step_id, sampled, tokens))
    scheduler.check_invariants()


@pytest.mark.parametrize("num_blocks", [30, 7])  # roomy; preempting (recompute)
def test_scheduled_state_slots_equal_transformers(num_blocks):
    torch.manual_seed(0)
    layer = hf_layer(3)
    mixer = ours(layer)
    embed = torch.randn(VOCAB + 3, HIDDEN)
    scheduler = make_scheduler(num_blocks=num_blocks, budget=5, num_state_slots=6)
    requests = [add(scheduler, "a", 9, max_tokens=6), add(scheduler, "b", 4, max_tokens=8)]
    requests.append(add(scheduler, "c", 6, max_tokens=4, n=2, seed=1))
    cache = StateCache(RecurrentStates.allocate(mixer.dims, 1, 6, torch.float32, "cpu"))
    done, outputs, seqs = {}, {}, {}
    while scheduler.has_unfinished:
        run(scheduler, mixer, cache, embed, done, outputs)
        seqs.update(scheduler.seqs)  # finished ones leave it
    finished = {seq_id: seq for seq_id, seq in seqs.items() if seq.is_finished}
    # 7 blocks of 4 do not hold them all; roomy, the forked child keeps its copied state
    assert (scheduler.stats.num_preemptions > 0) == (num_blocks == 7)
    assert set(finished) == {"a", "b", "c", "c#1"}
    for seq_id, seq in finished.items():
        with torch.no_grad():
            expected = layer(embed[seq.all_token_ids[: done[seq_id]]][None])[0]
        assert done[seq_id] == len(seq.all_token_ids) - 1  # all but the last sampled token
        torch.testing.assert_close(torch.cat(outputs[seq_id]), expected, rtol=1e-4, atol=1e-4)
    assert seqs["c"].all_token_ids != seqs["c#1"].all_token_ids  # the samples went their ways
    manager = scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert manager.slots.num_free == 6
    assert all(r.status is not RequestStatus.RUNNING for r in requests)
