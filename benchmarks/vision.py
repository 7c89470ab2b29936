"""Time to first token of a request with an image (backend/multimodal/), and where it goes: the
processor (resize, placeholders), the vision encoder alone, and the prefill; then the same image
again (the prefix cache holds the whole prompt but its last block: no encoding), the same image with
a new question after it (the prefix cache up to the question), and the same image after new text
(the prefix cache misses from the text on; the encoder cache hits).

The model: random weights of llava-interleave-qwen-0.5b's shape (LlavaForConditionalGeneration: a
SigLIP so400m/14 tower at 384x384, 729 image tokens; a 2-layer projector; Qwen2-0.5B), made and
saved by transformers once into the cache directory (nothing is downloaded; its tokenizer is trained
in-process, so the prompt's words are not Qwen's). Each row: the median of --repeats runs, each with
pictures never seen before (cold rows) or the run's own picture again (warm rows).

    python benchmarks/vision.py [--dtype auto] [--repeats 3] [--model DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import machine  # noqa: E402

from pagedserve.backend import LLMEngine, SamplingParams  # noqa: E402

QUESTION = "USER: <image>\nWhat is shown in this picture? Describe it in detail. ASSISTANT:"
OTHER_QUESTION = "USER: <image>\nWhich colours dominate this picture? ASSISTANT:"
OTHER_START = "USER: Here is another photo from the same trip, taken at noon. <image>\nWhat is shown? ASSISTANT:"


def build_checkpoint(directory: Path) -> Path:
    """llava-interleave-qwen-0.5b's shape with random weights (bf16 on disk), saved once."""
    if (directory / "config.json").exists():
        return directory
    import torch
    from transformers import (LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor,
                              Qwen2Config, SiglipImageProcessor, SiglipVisionConfig)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.vlm_checks import tokenizer_with_image_token

    print(f">> building a random llava-interleave-qwen-0.5b-shaped checkpoint in {directory}", flush=True)
    tokenizer = tokenizer_with_image_token()
    vision = SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                                image_size=384, patch_size=14)
    text = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True,
                       rope_theta=1000000.0, bos_token_id=1, eos_token_id=2)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                         image_seq_length=729, vision_feature_layer=-1, vision_feature_select_strategy="full",
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).to(torch.bfloat16).eval()
    processor = LlavaProcessor(image_processor=SiglipImageProcessor(size={"height": 384, "width": 384}),
                               tokenizer=tokenizer, patch_size=14, vision_feature_select_strategy="full",
                               num_additional_image_tokens=0)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def picture(seed: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (480, 640, 3), dtype=np.uint8))


def ttft_ms(engine: LLMEngine, prompt: dict) -> float:
    started = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    return (time.perf_counter() - started) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    cache = Path(os.environ.get("PAGEDSERVE_CACHE_DIR", Path.home() / ".cache" / "pagedserve"))
    parser.add_argument("--model", type=Path, default=cache / "bench" / "llava-interleave-qwen-0.5b-shape")
    args = parser.parse_args()

    model = build_checkpoint(args.model)
    engine = LLMEngine(model=str(model), dtype=args.dtype)
    images = engine.images
    assert images is not None
    engine.generate(["warm up the text path"], SamplingParams(max_tokens=2), use_tqdm=False)
    rows: dict[str, list[float]] = {name: [] for name in (
        "processor alone (resize, placeholders)", "vision encoder alone", "cold: new picture, whole request",
        "same picture and question again", "same picture, new question",
        "same picture after new text (encoder cache hit, prefix miss)")}
    tokens = 0
    for run in range(args.repeats):
        fresh = picture(1000 + run)
        started = time.perf_counter()
        ids, mm = images.process(QUESTION, [picture(2000 + run)])
        rows["processor alone (resize, placeholders)"].append((time.perf_counter() - started) * 1e3)
        tokens = len(ids)
        started = time.perf_counter()
        images.embedder.encoder.encode(mm.images[0].pixels)
        rows["vision encoder alone"].append((time.perf_counter() - started) * 1e3)
        prompt = {"prompt": QUESTION, "multi_modal_data": {"image": fresh}}
        rows["cold: new picture, whole request"].append(ttft_ms(engine, prompt))
        rows["same picture and question again"].append(ttft_ms(engine, prompt))
        rows["same picture, new question"].append(ttft_ms(engine, {"prompt": OTHER_QUESTION,
                                                                   "multi_modal_data": {"image": fresh}}))
        rows["same picture after new text (encoder cache hit, prefix miss)"].append(
            ttft_ms(engine, {"prompt": OTHER_START, "multi_modal_data": {"image": fresh}}))
    print(machine())
    print(f"Model: {model.name} (random weights), engine dtype {engine.dtype}; prompt {tokens} tokens "
          f"({mm.images[0].length} of them the image's); encoder cache hits {images.embedder.cache.hits}, "
          f"encodes {images.embedder.num_encoded}; median of {args.repeats}.\n")
    cold = statistics.median(rows["cold: new picture, whole request"])
    print("| what | ms | of cold TTFT |")
    print("|---|---:|---:|")
    for name, values in rows.items():
        value = statistics.median(values)
        print(f"| {name} | {value:.0f} | {value / cold:.2f} |")


if __name__ == "__main__":
    main()
