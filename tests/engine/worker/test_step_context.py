"""A step runs on the executor's worker thread with the context of the task that submitted it,
so its log lines name the service (tests/services/conftest.py checks every line does)."""

import asyncio

import structlog
from kvpager.engine.worker.step_runner import InProcessExecutor
from kvpager.schemas.executor import ScheduledStep


class ContextRecorder:
    """Stands in for the Executor: the step thread's view of structlog's context variables."""

    def execute(self, step: ScheduledStep) -> dict:
        return structlog.contextvars.get_contextvars()

    def close(self) -> None:
        pass


def test_a_step_sees_the_submitting_tasks_context():
    runner = InProcessExecutor(ContextRecorder)

    async def submit_as(service: str, step_id: int) -> dict:
        structlog.contextvars.bind_contextvars(service=service)
        done = await runner.run(ScheduledStep(step_id=step_id))
        return done.output

    async def main() -> list[dict]:
        return await asyncio.gather(submit_as("executor", 1), submit_as("other", 2))

    try:
        seen = asyncio.run(main())
    finally:
        runner.close()
    assert seen == [{"service": "executor"}, {"service": "other"}]
