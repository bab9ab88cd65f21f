"""Shared helpers for engine tests: build an LLM on a tiny checkpoint, check accounting."""

import random

import torch
from kvpager.engine import LLM
from transformers import AutoModelForCausalLM


def make_llm(path, **overrides) -> LLM:
    args = dict(dtype="float32", block_size=8, num_blocks=128, attention_backend="torch")
    args.update(overrides)
    if args["attention_backend"] == "cpu":
        args.setdefault("device", "cpu")  # the C kernels read host memory, also on a GPU host
    return LLM(str(path), **args)


def random_prompts(lengths: list[int], seed: int = 0, vocab_size: int = 384) -> list[list[int]]:
    rng = random.Random(seed)
    # ids 0-2 are special tokens; keep prompts to ordinary text tokens
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def hf_generate(path, prompts: list[list[int]], **generate_args) -> list[list[int]]:
    """New tokens from transformers' `generate`, one prompt at a time (no padding effects)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pad = model.generation_config.pad_token_id
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **generate_args)
        new = out[0, len(prompt) :].tolist()
        while generate_args.get("num_beams", 1) > 1 and len(new) > 1 and new[-1] == pad:
            new.pop()  # beams that ended early are padded to the longest
        outputs.append(new)
    return outputs


def assert_all_free(llm: LLM) -> None:
    """Block accounting holds and every device and CPU block is free again."""
    llm.check_invariants()
    stats = llm.stats()
    assert stats["num_used_blocks"] == 0, stats
    assert stats["num_free_blocks"] == stats["num_blocks"], stats
    assert stats["num_running"] == stats["num_waiting"] == 0, stats
    cpu = llm.scheduler.block_manager.cpu
    assert not cpu.owned, f"CPU blocks still owned: {cpu.owned}"
