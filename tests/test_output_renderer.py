"""OutputRenderer: stop strings across token boundaries, held-back text, exact id releases."""

from __future__ import annotations

import itertools

from pagedserve.backend.output_renderer import OutputRenderer
from pagedserve.backend.sampling_params import SamplingParams
from pagedserve.backend.sequence import FinishReason, Sequence
from pagedserve.backend.tokenizer import decode_delta


def run(tokenizer, text, stream_interval=1, **params):
    """Feed text's tokens one at a time; return the outputs and the stop token index."""
    prompt = tokenizer.encode("Story:")
    seq = Sequence("r", prompt, SamplingParams(**params))
    renderer = OutputRenderer(seq, tokenizer, stream_interval)
    outputs = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        seq.append_token(token)
        if renderer.on_token():
            seq.finish_reason = FinishReason.STOP
            outputs.append(renderer.collect(finished=True))
            return outputs
        output = renderer.collect(finished=False)
        if output is not None:
            outputs.append(output)
    seq.finish_reason = FinishReason.LENGTH
    outputs.append(renderer.collect(finished=True))
    return outputs


def rebuilt_from_ids(tokenizer, outputs):
    """What the stateless postprocessing model makes of the released ids."""
    text = ""
    for out in outputs:
        delta = decode_delta(tokenizer, out.context_token_ids, out.new_token_ids, allow_partial=True)
        text += delta[: len(delta) - out.trim_chars]
    return text


def test_stop_string_spanning_tokens_is_trimmed_and_never_streamed(tokenizer):
    text = "Once upon a time, the end came. Then more words follow here."
    outputs = run(tokenizer, text, stop=["e end c"])
    assert "".join(o.text for o in outputs) == "Once upon a time, th"
    assert outputs[-1].finished and outputs[-1].finish_reason == "stop"
    assert all("e end" not in o.text for o in outputs)
    assert rebuilt_from_ids(tokenizer, outputs) == "Once upon a time, th"
    assert outputs[-1].trim_chars > 0


def test_include_stop_str_in_output_keeps_it(tokenizer):
    outputs = run(tokenizer, "alpha beta STOP gamma", stop=["STOP"], include_stop_str_in_output=True)
    assert "".join(o.text for o in outputs) == "alpha beta STOP"
    assert rebuilt_from_ids(tokenizer, outputs) == "alpha beta STOP"


def test_without_stop_strings_every_clean_token_is_released_at_once(tokenizer):
    text = "Plain text 🎉 done"
    outputs = run(tokenizer, text)
    assert "".join(o.text for o in outputs) == text
    assert rebuilt_from_ids(tokenizer, outputs) == text
    ids = [t for o in outputs for t in o.new_token_ids]
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert all(o.text for o in outputs[:-1])  # emoji bytes wait for each other; nothing empty is sent
    assert outputs[-1].num_output_tokens == len(ids)


def test_text_that_might_start_a_stop_string_is_held_back_until_it_cannot(tokenizer):
    outputs = run(tokenizer, "We say ST and then STAR and STOP", stop=["STOP"])
    assert "".join(o.text for o in outputs) == "We say ST and then STAR and "
    assert rebuilt_from_ids(tokenizer, outputs) == "We say ST and then STAR and "


def test_a_stream_interval_gathers_tokens_but_never_delays_the_first_or_last(tokenizer):
    text = "one two three four five six seven eight nine ten eleven"
    every = run(tokenizer, text)
    gathered = run(tokenizer, text, stream_interval=4)
    sizes = [len(o.new_token_ids) for o in gathered]
    assert sizes[0] == 1 and all(size == 4 for size in sizes[1:-1]) and 0 <= sizes[-1] <= 4
    assert sum(sizes) == sum(len(o.new_token_ids) for o in every) == len(tokenizer.encode(text, add_special_tokens=False))
    assert "".join(o.text for o in gathered) == text == rebuilt_from_ids(tokenizer, gathered)
    assert [o.num_output_tokens for o in gathered] == list(itertools.accumulate(sizes))


def test_a_stop_string_still_ends_a_gathered_stream_at_once(tokenizer):
    outputs = run(tokenizer, "alpha beta gamma STOP delta epsilon", stream_interval=8, stop=["STOP"])
    assert "".join(o.text for o in outputs) == "alpha beta gamma "
    assert outputs[-1].finished and outputs[-1].finish_reason == "stop"
