"""The gateway's token texts come from the events (the tokenizer service writes them): the
logprob entries, their alternatives, an echoed prompt. It loads no tokenizer."""

import subprocess
import sys

from kvpager.schemas.public import GenerateEvent, PromptLogprob, TokenLogprob
from kvpager.services.http.tokens import TokenTexts


def test_texts_are_learned_from_every_part_of_an_event():
    event = GenerateEvent(
        request_id="r",
        seq=0,
        logprobs=[TokenLogprob(7, -0.1, [7, 8], [-0.1, -2.0], "a", ["a", " b"])],
        prompt_token_ids=[1, 2],
        prompt_tokens=["<s>", "Hi"],
        prompt_logprobs=[None, PromptLogprob(2, -3.0, 4, [9], [-1.0], "Hi", ["\n"])],
    )
    texts = TokenTexts()
    assert texts.text(8) == "token_id:8"  # nothing learned yet: vLLM's token-id form
    texts.learn(event)
    assert [texts.text(t) for t in (1, 2, 7, 8, 9)] == ["<s>", "Hi", "a", " b", "\n"]


def test_entries_without_texts_fall_back_to_token_ids():
    """A tokenizer service older than the text fields: its events name ids only."""
    texts = TokenTexts()
    texts.learn(GenerateEvent(request_id="r", seq=0, logprobs=[TokenLogprob(5, -1.0, [], [])]))
    assert texts.text(5) == "token_id:5"


def test_the_gateway_imports_no_tokenizer():
    code = "import sys, kvpager.services.http.app; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
