"""Images in, text out, offline (backend/multimodal/): a tiny random LLaVA saved by transformers gives
transformers' greedy tokens with one and two images, beside a text-only request in one continuous
batch, with chunked prefill cutting through its images and with prefix-cache hits; the prefix cache
shares blocks between requests with the same image and never between two images; an image resent
is encoded once; bad images are refused by field."""

from __future__ import annotations

import pytest

from pagedserve.backend import LLMEngine, SamplingParams
from pagedserve.backend.errors import InvalidRequestError

from benchmarks.fuzz import png_claiming

from .vlm_checks import TOKENS, assert_same, chat_text, greedy, pictures, png_bytes, transformers_greedy, write_tiny_llava

pytestmark = pytest.mark.slow

PROMPTS = ["Describe the picture: <image> What is in it?",
           "Compare <image> with <image> and tell the difference between them.",
           "The quick brown fox jumps over the lazy dog"]


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> str:
    return write_tiny_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def expected(llava) -> list[list[int]]:
    images = pictures(3)
    return [transformers_greedy(llava, PROMPTS[0], images[:1], TOKENS),
            transformers_greedy(llava, PROMPTS[1], images[1:3], TOKENS),
            transformers_greedy(llava, PROMPTS[2], [], TOKENS)]


def requests(images: list) -> list:
    return [{"prompt": PROMPTS[0], "multi_modal_data": {"image": images[0]}},
            {"prompt": PROMPTS[1], "multi_modal_data": {"image": images[1:3]}},
            PROMPTS[2]]


@pytest.mark.parametrize("chunk", [None, 16], ids=["whole-prompts", "chunks-of-16"])
def test_greedy_equals_transformers_beside_text(llava, expected, chunk):
    """One image, two images and text alone in one batch; a budget of 16 tokens a step cuts the
    16-token images (which start a few tokens in) in two, and the next chunk starts inside them.
    Images as PIL pictures and as PNG file bytes give the same."""
    settings = {"max_num_batched_tokens": chunk} if chunk else {}
    engine = LLMEngine(model=llava, dtype="float32", **settings)
    images = pictures(3)
    assert_same(greedy(engine, requests(images)), expected)
    assert_same(greedy(engine, requests([png_bytes(i) for i in images])), expected)  # prefix hits now


def test_preempted_image_requests_resume_with_their_images(llava):
    """A KV cache too small for the batch to grow: the request with an image is preempted and recomputed
    (its image's embeddings from the encoder cache, or encoded again where it keeps nothing) and still
    gives transformers' tokens."""
    picture, tokens = pictures(1)[0], 40
    expected = [transformers_greedy(llava, PROMPTS[2], [], tokens), transformers_greedy(llava, PROMPTS[0], [picture], tokens)]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for cache_bytes in (256 * 2**20, 0):
        engine = LLMEngine(model=llava, dtype="float32", num_kv_blocks=5, block_size=16, encoder_cache_bytes=cache_bytes,
                           enable_prefix_caching=False)
        done = engine.generate([PROMPTS[2], {"prompt": PROMPTS[0], "multi_modal_data": {"image": picture}}], params,
                               use_tqdm=False)  # the newest, the image's, is the one preempted
        assert_same([c.token_ids for c in done], expected)
        assert engine.stats().num_preemptions > 0
        assert engine.images.embedder.num_encoded == 1 if cache_bytes else engine.images.embedder.num_encoded >= 2


@pytest.mark.parametrize("budget, most_per_step", [(16, 1), (0, 3)], ids=["one-image-a-step", "default-budget"])
def test_the_encoder_budget_spreads_images_over_steps(llava, expected, budget, most_per_step):
    """Three requests with an image each arrive beside a decoding text request: with an encoder
    budget of one image (max_num_encoder_input_tokens=16) each step encodes one, the chunks stopping
    before the next image, and the text request still gets a token every step; the tokens are
    transformers'. The default budget (max_num_batched_tokens) encodes all three in one step."""
    engine = LLMEngine(model=llava, dtype="float32", max_num_encoder_input_tokens=budget, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    engine.add_request(PROMPTS[2], params, request_id="text")
    tokens = {"text": list(engine.step()[0].new_token_ids)}
    for i, picture in enumerate(pictures(3)):
        engine.add_request({"prompt": PROMPTS[0], "multi_modal_data": {"image": picture}}, params, request_id=f"image{i}")
    encoded, text = [], engine.scheduler.requests["text"]
    while engine.has_unfinished_requests():
        before, text_before = engine.images.embedder.num_encoded, text.num_output_tokens
        outputs = engine.step()
        encoded.append(engine.images.embedder.num_encoded - before)
        assert text.is_finished or text.num_output_tokens == text_before + 1  # never stalled by the images
        for output in outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert max(encoded) == most_per_step and sum(encoded) == 3
    assert_same([tokens["image0"], tokens["text"]], [expected[0], expected[2]])


def test_chat_messages_take_their_images_through_the_chat_template(llava):
    """Image parts ({"type": "image"}) become the processor's chat template's placeholders, the images
    taken in order: transformers' greedy tokens on the same rendering."""
    first, second = pictures(2)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"},
                                             {"type": "text", "text": "with"}, {"type": "image"}]},
                {"role": "assistant", "content": "They differ."},
                {"role": "user", "content": "How?"}]
    expected = transformers_greedy(llava, chat_text(llava, messages), [first, second], TOKENS)
    engine = LLMEngine(model=llava, dtype="float32")
    assert_same(greedy(engine, [{"messages": messages, "multi_modal_data": {"image": [first, second]}}]), [expected])


def test_prefix_cache_shares_an_image_never_two(llava):
    engine = LLMEngine(model=llava, dtype="float32", block_size=8)
    first, other = pictures(2)
    prompt = "Describe the picture in every detail you can see: <image> What is in it?"
    params = SamplingParams(max_tokens=2, temperature=0)
    engine.generate([{"prompt": prompt, "multi_modal_data": {"image": first}}], params, use_tqdm=False)
    hits = engine.block_manager.prefix_hit_tokens
    engine.generate([{"prompt": prompt, "multi_modal_data": {"image": other}}], params, use_tqdm=False)
    ids, mm = engine.prompt_inputs({"prompt": prompt, "multi_modal_data": {"image": other}})
    text_before = mm.images[0].offset // 8 * 8  # the whole blocks before the image: text alone
    assert text_before > 0 and engine.block_manager.prefix_hit_tokens - hits == text_before
    hits = engine.block_manager.prefix_hit_tokens
    engine.generate([{"prompt": prompt, "multi_modal_data": {"image": first}}], params, use_tqdm=False)
    assert engine.block_manager.prefix_hit_tokens - hits == (len(ids) - 1) // 8 * 8  # all but the last block


def test_an_image_resent_is_encoded_once(llava):
    engine = LLMEngine(model=llava, dtype="float32", enable_prefix_caching=False)
    picture = pictures(1)[0]
    params = SamplingParams(max_tokens=2, temperature=0)
    for prompt in (PROMPTS[0], "Another question about <image> please"):
        engine.generate([{"prompt": prompt, "multi_modal_data": {"image": picture}}], params, use_tqdm=False)
    assert engine.images.embedder.num_encoded == 1


@pytest.mark.parametrize("image, field, message", [
    (b"not an image at all", "image", "is not an image Pillow can read"),
    ("a string", "image", "must be image file bytes or a PIL image"),
])
def test_bad_images_are_refused_by_field(llava, image, field, message):
    engine = LLMEngine(model=llava, dtype="float32")
    with pytest.raises(InvalidRequestError, match=message) as error:
        engine.add_request({"prompt": PROMPTS[0], "multi_modal_data": {"image": image}})
    assert error.value.field == field
    assert not engine.has_unfinished_requests()


def test_placeholders_must_match_the_images(llava):
    engine = LLMEngine(model=llava, dtype="float32")
    with pytest.raises(InvalidRequestError, match=r"has 2 image placeholders \(<image>\) for 1 images"):
        engine.add_request({"prompt": PROMPTS[1], "multi_modal_data": {"image": pictures(1)}})
    truncated = png_bytes(pictures(1)[0])[:200]
    with pytest.raises(InvalidRequestError, match="could not be decoded|is not an image"):
        engine.add_request({"prompt": PROMPTS[0], "multi_modal_data": {"image": truncated}})
    with pytest.raises(InvalidRequestError, match="the limit is 8"):
        engine.add_request({"prompt": "<image>" * 9, "multi_modal_data": {"image": pictures(9)}})


def test_the_image_caps_are_settings_named_in_their_errors(llava):
    engine = LLMEngine(model=llava, dtype="float32", limit_mm_per_prompt="image=1", max_image_pixels=3000)
    with pytest.raises(InvalidRequestError, match=r"2 images; the limit is 1 \(the engine's limit_mm_per_prompt\)"):
        engine.add_request({"prompt": PROMPTS[1], "multi_modal_data": {"image": pictures(2)}})
    with pytest.raises(InvalidRequestError, match=r"is 64x64 = 4096 pixels; the limit is 3000 \(the engine's max_image_pixels"):
        engine.add_request({"prompt": PROMPTS[0], "multi_modal_data": {"image": pictures(3)[2]}})
    with pytest.raises(InvalidRequestError, match="is 100x200 = 20000 pixels"):
        engine.add_request({"prompt": PROMPTS[0], "multi_modal_data": {"image": png_claiming(100, 200)}})
    bomb = png_claiming(100_000, 100_000)  # past Pillow's own guard too
    with pytest.raises(InvalidRequestError, match=r"is over the engine's max_image_pixels \(3000\)"):
        engine.add_request({"prompt": PROMPTS[0], "multi_modal_data": {"image": bomb}})
    assert not engine.has_unfinished_requests()


def test_a_text_model_refuses_images(small_llama):
    engine = LLMEngine(model=small_llama, dtype="float32")
    with pytest.raises(InvalidRequestError, match="this model takes no images") as error:
        engine.add_request({"prompt": "Look: <image>", "multi_modal_data": {"image": pictures(1)}})
    assert error.value.field == "image"
