"""The executor's side of recurrent state slots: it owns the state tensors
(engine/model/mamba2.py: RecurrentStates) and applies what a step says about them, by id
alone (engine/kv/state_slots.py decides; ScheduledStep carries the ids, StepCheck checked them).

Per step, around the forward pass: zero the slots new to a sequence and copy the state of each
fork applied before the pass (a beam chosen twice); run the mixers on each scheduled
sequence's slot; after the pass copy the state of each fork that samples (a parallel sample
forked as its parent's prompt completes: the state then holds the whole prompt).
"""

from kvpager.engine.model.mamba2 import RecurrentStates
from kvpager.schemas.executor import ScheduledStep


class StateCache:
    def __init__(self, states: RecurrentStates) -> None:
        self.states = states

    def before_forward(self, step: ScheduledStep) -> None:
        if step.state_resets:
            self.states.reset(step.state_resets)
        self._copy_forks(step, sample=False)

    def after_forward(self, step: ScheduledStep) -> None:
        self._copy_forks(step, sample=True)

    @staticmethod
    def slots(step: ScheduledStep) -> list[int]:
        """The scheduled sequences' slots, in the step's order (the batch's rows)."""
        return [step.state_slots[seq_id] for seq_id in step.num_scheduled_tokens]

    def _copy_forks(self, step: ScheduledStep, sample: bool) -> None:
        slots = step.state_slots
        pairs = [
            (slots[fork.parent_id], slots[fork.child_id])
            for fork in step.forks
            if fork.sample == sample and fork.parent_id in slots
        ]
        if pairs:
            self.states.copy(pairs)
