"""Incremental detokenization: exact concatenation, no split characters, leading spaces kept."""

from __future__ import annotations

import pytest

from pagedserve.backend.detokenizer import IncrementalDetokenizer
from pagedserve.backend.tokenizer import decode_delta

TEXTS = [
    "Party time 🎉🎉 with friends 👩‍👩‍👧!",
    "日本語のテキストと中文字符混合。",
    " leading space,  double  spaces and\ttabs\n new line",
    "Ünïcödé façade — naïve café ✓",
]


def stream(tokenizer, prompt_ids, output_ids):
    token_ids = list(prompt_ids)
    detok = IncrementalDetokenizer(tokenizer, token_ids, len(prompt_ids))
    deltas = []
    for token in output_ids:
        token_ids.append(token)
        deltas.append(detok.update())
    deltas.append(detok.update(final=True))
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_deltas_concatenate_exactly_without_split_characters(tokenizer, text):
    prompt = tokenizer.encode("Say something:")
    output = tokenizer.encode(text, add_special_tokens=False)
    deltas = stream(tokenizer, prompt, output)
    assert "".join(deltas) == tokenizer.decode(output) == text
    assert not any("\ufffd" in d for d in deltas)


def test_multibyte_characters_split_over_tokens_wait_for_completion(tokenizer):
    output = tokenizer.encode("🎉", add_special_tokens=False)
    assert len(output) > 1, "the emoji should span several byte-level tokens"
    deltas = stream(tokenizer, tokenizer.encode("Hi"), output)
    assert deltas[:-2] == [""] * (len(output) - 1) and "".join(deltas) == "🎉"


@pytest.mark.parametrize("text", ["The history of printing began", "the press 日本 ✓ and more"])
def test_sentencepiece_leading_spaces_are_kept(sentencepiece_tokenizer, text):
    tok = sentencepiece_tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(ids)
    split = next(i for i in range(1, len(ids)) if pieces[i].startswith("\u2581") and len(pieces[i]) > 1)
    prompt, output = ids[:split], ids[split:]
    assert not tok.decode(output).startswith(" ")  # decoding alone drops the space
    deltas = stream(tok, prompt, output)
    assert "".join(deltas) == text[len(tok.decode(prompt)) :]
    assert "".join(deltas).startswith(" ")
    assert not any("\ufffd" in d for d in deltas)


def test_stateless_delta_of_any_clean_grouping_matches(tokenizer):
    """The postprocessing model decodes released groups with a little context: same text."""
    ids = tokenizer.encode("Pre 日本語 and 🎉 emoji", add_special_tokens=False)
    text, start = "", 0
    for end in range(1, len(ids) + 1):
        delta = decode_delta(tokenizer, ids[max(0, start - 4) : start], ids[start:end])
        if delta is not None:
            text += delta
            start = end
    assert text == tokenizer.decode(ids)
    assert decode_delta(tokenizer, [], tokenizer.encode("🎉", add_special_tokens=False)[:1]) is None


def test_random_byte_tokens_render_without_failing(sentencepiece_tokenizer):
    """A random model emits byte-fallback tokens that form no valid UTF-8; the fast stream
    refuses some such sequences mid-way ("Invalid prefix encountered"), and rendering goes
    on with the two-decode deltas instead of failing the request. (Where bytes form no
    character, how many U+FFFD stand for them differs between decoders; valid text is
    exact, above.)"""
    import random

    rng = random.Random(0)
    tok = sentencepiece_tokenizer
    for _ in range(30):
        prompt = [rng.randrange(3, len(tok)) for _ in range(5)]
        output = [rng.randrange(3, len(tok)) for _ in range(40)]
        deltas = stream(tok, prompt, output)
        assert len(deltas) == len(output) + 1 and "".join(deltas).strip()


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_byte_level_table_gives_the_decode_streams_deltas(tokenizer, skip_special_tokens):
    """Byte-level tokenizers (the bundled model's) render from a table of each token's bytes,
    no decoder call: token for token the same deltas as the tokenizers package's DecodeStream
    on valid text, special tokens and emoji split over tokens included. Random tokens (bytes
    that form no character) render as a full decode does; there the stream, which waits on
    such bytes, may differ in where a U+FFFD appears."""
    import random

    from tokenizers.decoders import DecodeStream

    from pagedserve.backend.detokenizer import ByteLevelTable

    table = ByteLevelTable.of(tokenizer)
    assert table is not None and table.special
    rng = random.Random(1)
    texts = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    prompt = tokenizer.encode("Say something:")
    options = dict(skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
    for trial in range(30):
        output = list(rng.choice(texts))
        whole = [i for i in range(len(output) + 1) if "\ufffd" not in tokenizer.decode(output[:i])]  # between characters
        output.insert(rng.choice(whole), rng.choice(sorted(table.special)))
        fast = IncrementalDetokenizer(tokenizer, list(prompt), len(prompt), skip_special_tokens)
        reference = IncrementalDetokenizer(tokenizer, list(prompt), len(prompt), skip_special_tokens)
        reference.table, reference.backend = None, tokenizer._tokenizer  # the DecodeStream path
        reference.stream = DecodeStream(ids=reference.context(len(prompt)), skip_special_tokens=skip_special_tokens)
        for token in output:
            fast.token_ids.append(token)
            reference.token_ids.append(token)
            assert fast.update() == reference.update()
            assert fast.rendered >= reference.rendered  # a skipped special token is a clean boundary at once
        assert fast.update(final=True) == reference.update(final=True) == ""
    for _ in range(30):
        output = [rng.randrange(len(tokenizer)) for _ in range(30)]
        deltas = stream(tokenizer, prompt, output)
        assert "".join(deltas) == tokenizer.decode(output, **{**options, "skip_special_tokens": True})


def test_no_table_where_decoding_is_not_bytes_end_to_end(sentencepiece_tokenizer):
    from pagedserve.backend.detokenizer import ByteLevelTable

    assert ByteLevelTable.of(sentencepiece_tokenizer) is None


@pytest.mark.parametrize("text", TEXTS)
def test_the_whole_output_rendered_at_once_is_the_decode(tokenizer, text):
    """Offline generate renders a request's text once, at its end (final_only): characters split
    over tokens in the middle are whole there too."""
    prompt = tokenizer.encode("Say something:")
    output = tokenizer.encode(text, add_special_tokens=False)
    token_ids = list(prompt) + output
    detok = IncrementalDetokenizer(tokenizer, token_ids, len(prompt))
    assert detok.update(final=True) == text
