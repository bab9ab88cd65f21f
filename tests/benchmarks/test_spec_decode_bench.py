"""benchmarks/engine/spec_decode.py's shared workloads and vLLM report (no model, no timing):
the agent loop's turns, its functions apart from the rewrites', and the report of vLLM's arms
from hand-made results."""

import pytest

from benchmarks.engine.spec_decode import parse_args
from benchmarks.engine.spec_decode_vllm import arms
from benchmarks.engine.spec_workloads import (
    FOLLOW_UP,
    FUNCTIONS,
    rewrite_messages,
    run_agent_loop,
)


def test_agent_loop_asks_rewrite_follow_up_and_retry_per_file():
    asked = []

    def ask(messages: list[dict]) -> tuple[str, list[int]]:
        asked.append(messages)
        return f"answer {len(asked)}", [len(asked)] * 3

    result = run_agent_loop(ask, 2)
    assert result["tokens"] == [[n] * 3 for n in range(1, 7)]
    first, follow_up, retry = asked[:3]
    assert retry == first and len(first) == 1
    assert follow_up[1] == {"role": "assistant", "content": "answer 1"}
    assert follow_up[2]["content"] == FOLLOW_UP
    # the last functions, never the rewrites' (vLLM's suffix cache spans its workloads)
    rewrites = {m[0]["content"] for m in rewrite_messages(FUNCTIONS[: len(FUNCTIONS) - 2])}
    assert not rewrites & {m[0]["content"] for m in asked}
    assert asked[0] == rewrite_messages(FUNCTIONS[-1:])[0]


def test_vllm_arms_report_ratio_acceptance_and_equality():
    plain = {"tok_s": 10.0, "tokens": [[1, 2, 3]]}
    counters = {"num_drafts": 4, "num_draft_tokens": 20, "num_accepted_tokens": 10}
    suffix = {"tok_s": 25.0, "tokens": [[1, 2, 3]], "counters": counters}
    report = arms(plain, suffix, {"tokens": [[1, 2, 4]]})
    assert report["ratio"] == 2.5 and report["same_tokens"]
    assert not report["same_tokens_as_kvpager"]
    assert report["acceptance_rate"] == 0.5 and report["mean_accepted_length"] == 3.5


def test_vllm_arms_need_disjoint_functions():
    with pytest.raises(SystemExit):
        parse_args(["--vllm-python", "python", "--rewrites", "6", "--agent-files", "3"])
    assert parse_args(["--vllm-python", "python", "--rewrites", "6"]).agent_files == 2
