"""Time to first token of a request with an image (backend/multimodal/), and where it goes: the
processor (resize, placeholders), the vision encoder alone, and the prefill; then the same image
again (the prefix cache holds the whole prompt but its last block: no encoding), the same image with
a new question after it (the prefix cache up to the question), and the same image after new text
(the prefix cache misses from the text on; the encoder cache hits).

The model (--shape): random weights of Qwen2.5-VL-3B's shape (qwen2.5-vl-3b: a 32-layer vision
transformer with window attention, 14x14 patches merged 2x2, dynamic resolution; a 36-layer Qwen2.5
3B with multimodal rotary positions) or of llava-interleave-qwen-0.5b's (llava-0.5b: a SigLIP
so400m/14 tower at 384x384, 729 image tokens; Qwen2-0.5B), made and saved by transformers once into
the cache directory in bf16 (nothing is downloaded; the tokenizer is trained in-process, so the
prompt's words are not the model's). The picture is 640x480. Each row: the median of --repeats
runs, each with pictures never seen before (cold rows) or the run's own picture again (warm rows).

    python benchmarks/vision.py [--shape qwen2.5-vl-3b] [--dtype auto] [--repeats 3] [--model DIR]
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

QUESTION = "USER: {image}\nWhat is shown in this picture? Describe it in detail. ASSISTANT:"
OTHER_QUESTION = "USER: {image}\nWhich colours dominate this picture? ASSISTANT:"
OTHER_START = "USER: Here is another photo from the same trip, taken at noon. {image}\nWhat is shown? ASSISTANT:"


def build_checkpoint(directory: Path, shape: str, device: str = "cpu") -> Path:
    """A random checkpoint of `shape` (bf16 on disk), saved once; its weights drawn on `device` (a GPU
    draws a 3B model's in a moment, where a CPU takes minutes)."""
    if (directory / "config.json").exists():
        return directory
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    print(f">> building a random {shape}-shaped checkpoint in {directory}", flush=True)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: a 3B model's float32 copy would not fit beside it
    try:
        with torch.device(device):
            BUILDERS[shape](directory)
    finally:
        torch.set_default_dtype(previous)
    return directory


def _qwen25_vl_3b(directory: Path) -> None:
    import json

    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tests.vlm_checks import QWEN_SPECIAL, tokenizer_with_image_token

    tokenizer = tokenizer_with_image_token(QWEN_SPECIAL)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    config = Qwen2_5_VLConfig(
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
                           out_hidden_size=2048),
        text_config=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                         num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
                         bos_token_id=1, eos_token_id=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True)
    Qwen2_5_VLForConditionalGeneration(config).eval().save_pretrained(directory)
    Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (directory / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}))


def _llava_interleave_05b(directory: Path) -> None:
    from transformers import (LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor, Qwen2Config, SiglipImageProcessor,
                              SiglipVisionConfig)

    from tests.vlm_checks import tokenizer_with_image_token

    tokenizer = tokenizer_with_image_token()
    vision = SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                                image_size=384, patch_size=14)
    text = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True,
                       rope_theta=1000000.0, bos_token_id=1, eos_token_id=2)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                         image_seq_length=729, vision_feature_layer=-1, vision_feature_select_strategy="full",
                         tie_word_embeddings=True)
    LlavaForConditionalGeneration(config).eval().save_pretrained(directory)
    LlavaProcessor(image_processor=SiglipImageProcessor(size={"height": 384, "width": 384}), tokenizer=tokenizer,
                   patch_size=14, vision_feature_select_strategy="full", num_additional_image_tokens=0).save_pretrained(directory)


def _tiny(directory: Path) -> None:
    from tests.vlm_checks import write_tiny_qwen25_vl

    write_tiny_qwen25_vl(directory)


BUILDERS = {"qwen2.5-vl-3b": _qwen25_vl_3b, "llava-0.5b": _llava_interleave_05b, "tiny": _tiny}
PLACEHOLDERS = {"qwen2.5-vl-3b": "<|vision_start|><|image_pad|><|vision_end|>", "llava-0.5b": "<image>",
                "tiny": "<|vision_start|><|image_pad|><|vision_end|>"}
SHAPE_DIRS = {"qwen2.5-vl-3b": "qwen2.5-vl-3b-shape", "llava-0.5b": "llava-interleave-qwen-0.5b-shape",
              "tiny": "qwen2.5-vl-tiny"}
"""tiny: the tests' 2-layer Qwen2.5-VL (benchmarks/gpu.py's CPU dry run)."""


def picture(seed: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (480, 640, 3), dtype=np.uint8))


def ttft_ms(engine: LLMEngine, prompt: dict) -> float:
    started = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    return (time.perf_counter() - started) * 1e3


def rows(model: Path, shape: str, device: str = "auto", dtype: str = "auto", repeats: int = 3) -> dict:
    """The section's numbers (see the module's docstring): each row's median over `repeats` runs."""
    question, other_question, other_start = (text.format(image=PLACEHOLDERS[shape])
                                             for text in (QUESTION, OTHER_QUESTION, OTHER_START))
    engine = LLMEngine(model=str(model), dtype=dtype, device=device, kv_cache_bytes=1 << 30,
                       gpu_memory_utilization=0.5)
    images = engine.images
    assert images is not None
    engine.generate(["warm up the text path"], SamplingParams(max_tokens=2), use_tqdm=False)
    runs: dict[str, list[float]] = {name: [] for name in (
        "processor alone (resize, placeholders)", "vision encoder alone", "cold: new picture, whole request",
        "same picture and question again", "same picture, new question",
        "same picture after new text (encoder cache hit, prefix miss)")}
    tokens, image_tokens = 0, 0
    for run in range(repeats):
        fresh = picture(1000 + run)
        started = time.perf_counter()
        ids, mm = images.process({"prompt": question, "multi_modal_data": {"image": picture(2000 + run)}})
        runs["processor alone (resize, placeholders)"].append((time.perf_counter() - started) * 1e3)
        tokens, image_tokens = len(ids), mm.images[0].length
        started = time.perf_counter()
        images.embedder.encoder.encode(mm.images[0].pixels)
        sync(engine)
        runs["vision encoder alone"].append((time.perf_counter() - started) * 1e3)
        prompt = {"prompt": question, "multi_modal_data": {"image": fresh}}
        runs["cold: new picture, whole request"].append(ttft_ms(engine, prompt))
        runs["same picture and question again"].append(ttft_ms(engine, prompt))
        runs["same picture, new question"].append(ttft_ms(engine, {"prompt": other_question,
                                                                   "multi_modal_data": {"image": fresh}}))
        runs["same picture after new text (encoder cache hit, prefix miss)"].append(
            ttft_ms(engine, {"prompt": other_start, "multi_modal_data": {"image": fresh}}))
    return dict(model=model.name, shape=shape, device=str(engine.runner.device), dtype=str(engine.dtype).removeprefix("torch."),
                prompt_tokens=tokens, image_tokens=image_tokens, encoder_hits=images.embedder.cache.hits,
                encodes=images.embedder.num_encoded, repeats=repeats,
                rows=[{"what": name, "ms": round(statistics.median(values), 1)} for name, values in runs.items()])


def sync(engine: LLMEngine) -> None:
    if engine.runner.device.type == "cuda":
        import torch

        torch.cuda.synchronize(engine.runner.device)


def markdown(result: dict) -> str:
    note = "" if result["device"].startswith("cuda") else " (CPU)" if result["shape"] != "tiny" else \
        " (CPU dry run on a tiny model: the numbers mean nothing)"
    cold = next(row["ms"] for row in result["rows"] if row["what"].startswith("cold"))
    lines = [f"One image to the first token{note}: {result['model']} (random weights), engine dtype {result['dtype']}; "
             f"prompt {result['prompt_tokens']} tokens ({result['image_tokens']} of them the image's); encoder cache "
             f"hits {result['encoder_hits']}, encodes {result['encodes']}; median of {result['repeats']}.", "",
             "| what | ms | of cold TTFT |", "|---|---:|---:|"]
    lines += [f"| {row['what']} | {row['ms']:.0f} | {row['ms'] / cold:.2f} |" for row in result["rows"]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(PLACEHOLDERS), default="qwen2.5-vl-3b")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    cache = Path(os.environ.get("PAGEDSERVE_CACHE_DIR", Path.home() / ".cache" / "pagedserve"))
    parser.add_argument("--model", type=Path, default=None, help="(default: the shape's folder in the cache directory)")
    args = parser.parse_args()

    model = build_checkpoint(args.model or cache / "bench" / SHAPE_DIRS[args.shape], args.shape)
    result = rows(model, args.shape, args.device, args.dtype, args.repeats)
    print(machine())
    print(markdown(result))


if __name__ == "__main__":
    main()
