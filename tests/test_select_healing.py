"""select_prompts on the default tokenizer: healing only where the prompt's last token merges
into a choice, every choice then on the same context, and never through part of a character."""

from __future__ import annotations

import pytest

from radixlm.select_healing import chosen_prompt, select_prompts
from radixlm.tokens import TokenCodec


@pytest.fixture(scope="module")
def codec(engine) -> TokenCodec:
    return TokenCodec(engine.tokenizer)


def test_no_merge_scores_from_the_prefix_end(codec: TokenCodec) -> None:
    prefix = codec.encode("Answer:")
    start, prompts = select_prompts(codec, prefix, [" yes", " no"])
    assert start == len(prefix)
    assert prompts == [prefix + codec.encode(" yes"), prefix + codec.encode(" no")]


def test_a_trailing_space_heals_every_choice(codec: TokenCodec) -> None:
    prefix = codec.encode("The answer is ")
    choices = ["yes", "\nno"]  # the second would not merge alone: both still share one context
    start, prompts = select_prompts(codec, prefix, choices)
    assert start == len(prefix) - 1
    for prompt, c in zip(prompts, choices, strict=True):
        assert prompt[:start] == prefix[:-1] and codec.decode(prompt) == "The answer is " + c
    assert chosen_prompt(codec, prefix, choices, "yes") == prompts[0]


def test_part_of_a_character_is_never_healed(codec: TokenCodec) -> None:
    prefix = codec.encode("Hi🙂")  # the emoji's bytes span two tokens here
    cut = prefix[:-1]
    assert "\ufffd" in codec.decode(cut[-1:])
    start, prompts = select_prompts(codec, cut, ["x", "y"])
    assert start == len(cut) and prompts[0][: len(cut)] == cut
