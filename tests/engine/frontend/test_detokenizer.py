"""IncrementalDetokenizer against tokenizer.decode, on small tokenizers trained here."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvpager.engine.frontend.detokenizer import IncrementalDetokenizer
from kvpager.schemas.sampling import SamplingParams
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SENTENCES = [
    "Hello world, hello tokenizer. The world says hello.",
    "The naïve café serves crème brûlée, naïvely.",
    "日本語のテキストです。日本語は楽しい。",
    "Party time emoji 🎉🎉 and 👍! naïve café 日本語 emoji 🎉",
]
PROMPTS = ["", "Hello", "naïve café", "日本語", "emoji 🎉 and"]
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]
FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None)


def train(model: models.Model, trainer: trainers.Trainer, pre_tokenizer, decoder):
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoder
    tokenizer.train_from_iterator(SENTENCES, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=SPECIAL_TOKENS[0], pad_token=SPECIAL_TOKENS[1]
    )


def byte_level_bpe() -> PreTrainedTokenizerFast:
    """GPT-2 style: small enough that CJK characters and emoji span several tokens."""
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return train(models.BPE(), trainer, pre_tokenizer, decoders.ByteLevel())


def metaspace_bpe() -> PreTrainedTokenizerFast:
    """SentencePiece style: '▁' marks a space, which decode drops at the start of a text."""
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=[*SPECIAL_TOKENS, "<unk>"], show_progress=False
    )
    model = models.BPE(unk_token="<unk>")
    return train(model, trainer, pre_tokenizers.Metaspace(), decoders.Metaspace())


TOKENIZER = byte_level_bpe()
VOCAB_SIZE = len(TOKENIZER)


def stream(
    token_ids: list[int],
    params: SamplingParams,
    prompt: str = "",
    chunk_sizes: list[int] | None = None,
    tokenizer: PreTrainedTokenizerFast = TOKENIZER,
) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed ids in chunks (default one at a time) until a stop; the flush is the last delta."""
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), params)
    sizes = iter(chunk_sizes or [])
    deltas, start = [], 0
    while start < len(token_ids) and detok.stopped is None:
        size = next(sizes, 1)
        deltas.append(detok.add_tokens(token_ids[start : start + size]))
        start += size
    deltas.append(detok.flush())
    return deltas, detok


def decode(token_ids: list[int], skip_special_tokens: bool = True) -> str:
    return TOKENIZER.decode(
        token_ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def assert_never_retracted(deltas: list[str], final_text: str) -> None:
    """Every text shown so far is a prefix of the final text: nothing shown is later cut."""
    shown = ""
    for delta in deltas:
        shown += delta
        assert final_text.startswith(shown), (shown, final_text)
    assert shown == final_text


@FUZZ
@given(
    token_ids=st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=40),
    prompt=st.sampled_from(PROMPTS),
    skip_special_tokens=st.booleans(),
    chunk_sizes=st.lists(st.integers(1, 4), max_size=40),
)
def test_streamed_text_equals_decode(
    token_ids: list[int], prompt: str, skip_special_tokens: bool, chunk_sizes: list[int]
) -> None:
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    deltas, detok = stream(token_ids, params, prompt, chunk_sizes)
    expected = decode(token_ids, skip_special_tokens)
    assert_never_retracted(deltas, expected)
    assert detok.text == expected and detok.stopped is None


@pytest.mark.parametrize("text", ["🎉", "日本語 emoji 🎉🎉 👍", "naïve café 日本語のテキスト"])
def test_split_characters_are_held_back_not_replaced(text: str) -> None:
    token_ids = TOKENIZER.encode(text)
    assert any("\ufffd" in TOKENIZER.decode([t]) for t in token_ids), "no split character"
    deltas, _ = stream(token_ids, SamplingParams())
    assert not any("\ufffd" in delta for delta in deltas)
    assert "".join(deltas) == text
    for num_tokens in range(1, len(token_ids) + 1):
        shown, decoded = "".join(deltas[:num_tokens]), decode(token_ids[:num_tokens])
        # A token ending in a split character is held back whole; otherwise all is shown.
        assert decoded.startswith(shown)
        assert shown == decoded or decoded.endswith("\ufffd")


def test_incomplete_character_at_finish_is_flushed_as_replacement() -> None:
    token_ids = TOKENIZER.encode("ok 🎉")[:-1]
    deltas, detok = stream(token_ids, SamplingParams())
    assert "\ufffd" not in "".join(deltas[:-1])
    assert deltas[-1].endswith("\ufffd") and detok.text == decode(token_ids)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens(skip_special_tokens: bool) -> None:
    eos = TOKENIZER.eos_token_id
    token_ids = [*TOKENIZER.encode("Hello"), eos, *TOKENIZER.encode(" world"), eos]
    deltas, detok = stream(token_ids, SamplingParams(skip_special_tokens=skip_special_tokens))
    shown = "Hello world" if skip_special_tokens else "Hello<|endoftext|> world<|endoftext|>"
    assert "".join(deltas) == detok.text == shown


def test_prompt_context_keeps_the_first_space_with_metaspace() -> None:
    tokenizer = metaspace_bpe()
    prompt_ids = tokenizer.encode("Hello world,")
    full_ids = tokenizer.encode("Hello world, hello tokenizer.")
    assert full_ids[: len(prompt_ids)] == prompt_ids
    output_ids = full_ids[len(prompt_ids) :]
    deltas, _ = stream(output_ids, SamplingParams(), "Hello world,", tokenizer=tokenizer)
    assert "".join(deltas) == " hello tokenizer."
    alone, _ = stream(output_ids, SamplingParams(), tokenizer=tokenizer)
    assert "".join(alone) == tokenizer.decode(output_ids) == "hello tokenizer."


def test_decodes_a_small_window_per_token() -> None:
    class CountingTokenizer:
        decoded_ids = 0

        def decode(self, token_ids: list[int], **kwargs: bool) -> str:
            self.decoded_ids += len(token_ids)
            return TOKENIZER.decode(token_ids, **kwargs)

    token_ids = TOKENIZER.encode(" ".join(SENTENCES) * 8)
    counting = CountingTokenizer()
    detok = IncrementalDetokenizer(counting, [], SamplingParams())  # type: ignore[arg-type]
    for token_id in token_ids:
        detok.add_tokens([token_id])
    assert detok.text + detok.flush() == decode(token_ids)
    assert counting.decoded_ids < 16 * len(token_ids)  # not quadratic: O(window) per token


HELLO = "Hello world, hello tokenizer."


@pytest.mark.parametrize(
    ("stops", "include", "expected", "stopped"),
    [
        (["d, h"], False, "Hello worl", "d, h"),  # spans token boundaries
        (["d, h"], True, "Hello world, h", "d, h"),
        (["Hel"], False, "", "Hel"),  # at the very start
        (["Hel"], True, "Hel", "Hel"),
        ([HELLO], False, "", HELLO),  # the whole output
        (["ok", "ld,", "lo"], False, "Hel", "lo"),  # the earliest match wins
        (["tokenizer.", "xyz"], True, HELLO, "tokenizer."),  # at the very end
        (["absent", "q"], False, HELLO, None),
    ],
)
def test_stop_strings_cut_the_text(
    stops: list[str], include: bool, expected: str, stopped: str | None
) -> None:
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    deltas, detok = stream(TOKENIZER.encode(HELLO), params)
    assert_never_retracted(deltas, expected)
    assert detok.text == expected and detok.stopped == stopped


def test_earliest_match_wins_when_several_arrive_at_once() -> None:
    detok = IncrementalDetokenizer(TOKENIZER, [], SamplingParams(stop=["world", "llo"]))
    assert detok.add_tokens(TOKENIZER.encode(HELLO)) == "He"
    assert detok.stopped == "llo"


def test_only_a_possible_stop_start_is_held_back() -> None:
    detok = IncrementalDetokenizer(TOKENIZER, [], SamplingParams(stop=["world!"]))
    assert detok.add_tokens(TOKENIZER.encode("Hello wor")) == "Hello "
    assert detok.text == "Hello wor"
    assert detok.add_tokens(TOKENIZER.encode("ld")) == ""  # "world" could still become "world!"
    assert detok.add_tokens(TOKENIZER.encode(".")) == "world."
    assert detok.add_tokens(TOKENIZER.encode(" wo")) == " "
    assert detok.flush() == "wo" and detok.stopped is None


def test_no_tokens_after_a_stop() -> None:
    detok = IncrementalDetokenizer(TOKENIZER, [], SamplingParams(stop=["lo"]))
    assert detok.add_tokens(TOKENIZER.encode("Hello world")) == "Hel"
    assert detok.stopped == "lo" and detok.flush() == ""
    with pytest.raises(AssertionError):
        detok.add_tokens([5])


@FUZZ
@given(
    text=st.text(alphabet="ab cé日🎉", max_size=30),
    stop=st.text(alphabet="ab cé日🎉", min_size=1, max_size=4),
    include=st.booleans(),
    chunk_sizes=st.lists(st.integers(1, 3), max_size=30),
)
def test_one_stop_string_cuts_at_its_first_occurrence(
    text: str, stop: str, include: bool, chunk_sizes: list[int]
) -> None:
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    deltas, detok = stream(TOKENIZER.encode(text), params, chunk_sizes=chunk_sizes)
    idx = text.find(stop)
    expected = text if idx < 0 else text[: idx + len(stop) if include else idx]
    assert_never_retracted(deltas, expected)
    assert detok.text == expected and detok.stopped == (None if idx < 0 else stop)


@FUZZ
@given(
    text=st.text(alphabet="ab c", max_size=30),
    stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_several_stop_strings_never_retract_text(
    text: str, stops: list[str], include: bool
) -> None:
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    deltas, detok = stream(TOKENIZER.encode(text), params)
    assert_never_retracted(deltas, detok.text)
    assert text.startswith(detok.text)
    if detok.stopped is None:
        assert detok.text == text and not any(stop in text for stop in stops)
    else:
        assert detok.stopped in stops
        kept = detok.text[: len(detok.text) - len(detok.stopped)] if include else detok.text
        assert not any(stop in kept for stop in stops)  # nothing before the first match
        assert detok.text.endswith(detok.stopped) == include
