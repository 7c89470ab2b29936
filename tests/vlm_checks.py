"""Tiny random vision-language checkpoints saved by transformers (their processors too), and the
pictures the tests send: for comparing the engine with transformers token for token."""

from __future__ import annotations

import io
import json
import os

import numpy as np

from .texts import LONG_TEXT

IMAGE_TOKEN = "<image>"
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] | upper }}: {% if message['content'] is string %}"
                 "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
                 "<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}\n"
                 "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")
"""LLaVA-1.5's shape of chat: `USER: <image>\n...` turns, then `ASSISTANT:`."""


def tokenizer_with_image_token(special: tuple[str, ...] = (IMAGE_TOKEN,), **kwargs):
    """A small Llama-2-style tokenizer whose special tokens include LLaVA's `<image>` (or `special`)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator([LONG_TEXT] * 3, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", "<pad>", *special]))
    spec = json.loads(tok.to_str())
    for byte in range(256):
        spec["model"]["vocab"].setdefault(f"<0x{byte:02X}>", len(spec["model"]["vocab"]))
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>", pad_token="<pad>", **kwargs)


def _clip_and_llama(tokenizer, context: int) -> tuple:
    """A 2-layer CLIP vision tower on 32x32 pictures (8x8 patches) and a 2-layer Llama of `context` tokens."""
    from transformers import CLIPVisionConfig, LlamaConfig

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context, bos_token_id=1,
                       eos_token_id=2, pad_token_id=3, initializer_range=0.3, tie_word_embeddings=False)
    return vision, text


def write_tiny_llava(directory: str | os.PathLike) -> str:
    """LlavaForConditionalGeneration: a 2-layer CLIP vision tower on 32x32 pictures (8x8 patches: 16
    image tokens after the class token is dropped), a 2-layer projector, a 2-layer Llama; saved with
    its LlavaProcessor (CLIPImageProcessor), float32."""
    import torch
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    tokenizer = tokenizer_with_image_token()
    vision, text = _clip_and_llama(tokenizer, context=512)
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), image_seq_length=16,
                         vision_feature_layer=-1, vision_feature_select_strategy="default", tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    processor = LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                                  crop_size={"height": 32, "width": 32}),
                               tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default",
                               num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return str(directory)


PINPOINTS = [[32, 32], [32, 64], [64, 32], [64, 64]]
"""The tiling grids (height, width) a tiny LLaVA-NeXT / OneVision picks from by a picture's shape."""


def _save_tiled(directory: str | os.PathLike, model_class, config) -> None:
    """A tiling model's random weights saved, its newline row random too (transformers starts it at
    zero, which no test could tell from a missing one)."""
    import torch

    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        model.model.image_newline.normal_(0, 1)
    model.save_pretrained(directory)


def write_tiny_llava_next(directory: str | os.PathLike) -> str:
    """LlavaNextForConditionalGeneration: the tiny LLaVA's CLIP tower and Llama, tiling each picture
    into 32x32 tiles on the grid its shape picks (PINPOINTS) beside the whole picture, with a learned
    newline row after each row of tiles (random here: transformers starts it at zero); saved with its
    LlavaNextProcessor, float32."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextImageProcessor, LlavaNextProcessor

    tokenizer = tokenizer_with_image_token()
    vision, text = _clip_and_llama(tokenizer, context=1024)
    config = LlavaNextConfig(vision_config=vision, text_config=text,
                             image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), image_grid_pinpoints=PINPOINTS,
                             vision_feature_layer=-1, vision_feature_select_strategy="default", tie_word_embeddings=False)
    _save_tiled(directory, LlavaNextForConditionalGeneration, config)
    LlavaNextProcessor(image_processor=LlavaNextImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                                               image_grid_pinpoints=PINPOINTS),
                       tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default",
                       num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE).save_pretrained(directory)
    return str(directory)


def write_tiny_llava_onevision(directory: str | os.PathLike) -> str:
    """LlavaOnevisionForConditionalGeneration: a 2-layer SigLIP tower on 32x32 tiles (PINPOINTS), a
    2-layer Qwen2, the newline row random; saved as a real checkpoint is (processor_class
    LlavaOnevisionProcessor: its video part needs torchvision, so the processor is written by parts),
    float32."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, Qwen2Config, SiglipVisionConfig
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil

    tokenizer = tokenizer_with_image_token((IMAGE_TOKEN, "<video>"))
    tokenizer.chat_template = CHAT_TEMPLATE
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=32, patch_size=8)
    text = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1,
                       eos_token_id=2, pad_token_id=3, initializer_range=0.3, tie_word_embeddings=False)
    config = LlavaOnevisionConfig(vision_config=vision, text_config=text,
                                  image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                                  video_token_index=tokenizer.convert_tokens_to_ids("<video>"), image_grid_pinpoints=PINPOINTS,
                                  vision_feature_layer=-1, vision_feature_select_strategy="full", tie_word_embeddings=False)
    _save_tiled(directory, LlavaOnevisionForConditionalGeneration, config)
    LlavaOnevisionImageProcessorPil(size={"height": 32, "width": 32}, image_grid_pinpoints=PINPOINTS).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    with open(os.path.join(directory, "processor_config.json"), "w") as f:
        json.dump({"processor_class": "LlavaOnevisionProcessor", "num_image_tokens": 16,
                   "vision_feature_select_strategy": "full"}, f)
    return str(directory)


QWEN_SPECIAL = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|im_start|>", "<|im_end|>")
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
                 "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
                 "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
                 "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_qwen25_vl(directory: str | os.PathLike) -> str:
    """Qwen2_5_VLForConditionalGeneration: a 2-layer vision transformer (4x4 patches, 2x2 merged, a
    window of 16 with its second block attending in full), a 2-layer Qwen2 language model with
    multimodal rotary positions (mrope_section 2, 3, 3); saved as a real checkpoint is
    (processor_class Qwen2_5_VLProcessor), float32."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    return _write_tiny_qwen_vl(directory, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, "Qwen2_5_VLProcessor", dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
        window_size=16, fullatt_block_indexes=[1], out_hidden_size=64))


def write_tiny_qwen2_vl(directory: str | os.PathLike) -> str:
    """Qwen2VLForConditionalGeneration (the 2.5 generation's predecessor: a vision transformer
    without windows), otherwise as write_tiny_qwen25_vl."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    return _write_tiny_qwen_vl(directory, Qwen2VLConfig, Qwen2VLForConditionalGeneration, "Qwen2VLProcessor", dict(
        depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=4, spatial_merge_size=2,
        temporal_patch_size=2))


def _write_tiny_qwen_vl(directory: str | os.PathLike, config_class, model_class, processor_class: str, vision: dict) -> str:
    import torch
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = tokenizer_with_image_token(QWEN_SPECIAL)
    tokenizer.chat_template = QWEN_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    config = config_class(
        vision_config=vision,
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                         eos_token_id=2, pad_token_id=3, initializer_range=0.3,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    model_class(config).eval().save_pretrained(directory)
    Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                             size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64}).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    with open(os.path.join(directory, "processor_config.json"), "w") as f:
        json.dump({"processor_class": processor_class}, f)
    return str(directory)


GEMMA_SPECIAL = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
GEMMA_IMAGE = "<start_of_image>"


def write_tiny_gemma3(directory: str | os.PathLike) -> str:
    """Gemma3ForConditionalGeneration: a 2-layer SigLIP tower on 32x32 pictures (16 patches pooled to 4
    image tokens), the projector, a 2-layer Gemma 3 (a sliding-window layer, window 64, and a global
    one); its image tokens attend to one another. Saved with its Gemma3Processor, float32."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor, Gemma3TextConfig, SiglipVisionConfig
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = tokenizer_with_image_token(GEMMA_SPECIAL, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    config = Gemma3Config(
        vision_config=SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                         image_size=32, patch_size=8),
        text_config=Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                                     sliding_window=64, layer_types=["sliding_attention", "full_attention"],
                                     max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                                     initializer_range=0.3),
        mm_tokens_per_image=4, boi_token_index=tokenizer.boi_token_id, eoi_token_index=tokenizer.eoi_token_id,
        image_token_index=tokenizer.image_token_id)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # transformers starts the projection at zero: every image token would be the same zero
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.3)  # row, which hides the mask
    model.save_pretrained(directory)
    Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}), tokenizer=tokenizer,
                    image_seq_length=4, chat_template=CHAT_TEMPLATE.replace("<image>", GEMMA_IMAGE)).save_pretrained(directory)
    return str(directory)


def pictures(count: int = 3, seed: int = 0) -> list:
    """Distinct random RGB pictures of different sizes (PIL)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    sizes = [(40, 60), (50, 30), (64, 64), (33, 47)]
    return [Image.fromarray(rng.integers(0, 255, (*sizes[i % len(sizes)], 3), dtype=np.uint8)) for i in range(count)]


def png_bytes(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def chat_text(model_dir: str, messages: list[dict]) -> str:
    """The checkpoint's processor's rendering of chat messages (image parts as {"type": "image"})."""
    from pagedserve.backend.multimodal.processor import load_processor

    return load_processor(model_dir).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


TOKENS = 12
"""Tokens each comparison with transformers generates."""


def greedy(engine, prompts: list, tokens: int = TOKENS) -> list[list[int]]:
    """The engine's greedy tokens for `prompts` (text, or prompt dicts with images), EOS ignored."""
    from pagedserve.backend import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    return [c.token_ids for c in engine.generate(prompts, params, use_tqdm=False)]


def assert_same(ours: list[list[int]], theirs: list[list[int]]) -> None:
    """Each of ours starts with transformers' tokens (transformers stops at EOS; ours ignores it)."""
    for mine, expected in zip(ours, theirs):
        assert len(expected) >= 4 and mine[: len(expected)] == expected


def transformers_greedy(model_dir: str, prompt: str, images: list, max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of `prompt` with `images`, through the checkpoint's processor."""
    import torch
    from transformers import AutoModelForImageTextToText

    from pagedserve.backend.multimodal.processor import load_processor  # AutoProcessor, or its image part

    processor = load_processor(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = processor(images=images or None, text=prompt, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def mixed_requests(texts: list[str], images: list) -> list:
    """One image (a PIL picture), two images (PNG file bytes) and text alone: texts[0] with one
    placeholder, texts[1] with two, texts[2] with none; images: pictures(3)."""
    return [{"prompt": texts[0], "multi_modal_data": {"image": images[0]}},
            {"prompt": texts[1], "multi_modal_data": {"image": [png_bytes(i) for i in images[1:3]]}}, texts[2]]


def assert_mixed_batch_equals_transformers(model_dir: str, texts: list[str], engine) -> None:
    """mixed_requests in one batch give transformers' greedy tokens, and again from prefix hits."""
    images = pictures(3)
    expected = [transformers_greedy(model_dir, texts[0], images[:1], TOKENS),
                transformers_greedy(model_dir, texts[1], images[1:3], TOKENS),
                transformers_greedy(model_dir, texts[2], [], TOKENS)]
    requests = mixed_requests(texts, images)
    assert_same(greedy(engine, requests), expected)
    assert_same(greedy(engine, requests), expected)  # prefix hits now


def assert_chat_equals_transformers(model_dir: str, engine) -> None:
    """A chat turn with an image part gives transformers' greedy tokens on the template's rendering."""
    picture = pictures(1)[0]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    expected = transformers_greedy(model_dir, chat_text(model_dir, messages), [picture], TOKENS)
    assert_same(greedy(engine, [{"messages": messages, "multi_modal_data": {"image": picture}}]), [expected])
