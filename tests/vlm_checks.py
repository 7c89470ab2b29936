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


def write_tiny_llava(directory: str | os.PathLike) -> str:
    """LlavaForConditionalGeneration: a 2-layer CLIP vision tower on 32x32 pictures (8x8 patches: 16
    image tokens after the class token is dropped), a 2-layer projector, a 2-layer Llama; saved with
    its LlavaProcessor (CLIPImageProcessor), float32."""
    import torch
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    tokenizer = tokenizer_with_image_token()
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                       eos_token_id=2, pad_token_id=3, initializer_range=0.3, tie_word_embeddings=False)
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
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = tokenizer_with_image_token(QWEN_SPECIAL)
    tokenizer.chat_template = QWEN_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    config = Qwen2_5_VLConfig(
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                           temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1], out_hidden_size=64),
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                         eos_token_id=2, pad_token_id=3, initializer_range=0.3,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(config).eval().save_pretrained(directory)
    Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                             size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64}).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    with open(os.path.join(directory, "processor_config.json"), "w") as f:
        json.dump({"processor_class": "Qwen2_5_VLProcessor"}, f)
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
