#!/usr/bin/env python3
"""vLLM's own answers for the LLM tests and benchmark, with its offline
API (`vllm.LLM`), nothing of stoke's in the way. Run with the engine venv's
python.

Usage: llm_reference.py MODEL_DIR PROMPTS_JSONL OUT_JSON TASK MAX_TOKENS ENGINE_ARGS_JSON

PROMPTS_JSONL: lines {"id": ..., "prompt": ...} ({"id", "messages"} for
TASK chat: LLM.chat, the model's chat template). Writes OUT_JSON:
  generate, chat: {id: {"text", "prompt_tokens", "completion_tokens", "finish_reason"}}
  embed:    {id: {"embedding": [...]}}
plus "_meta": {"seconds": time in generate/embed, "tokens": completion tokens}.
Greedy decoding (temperature 0).
"""

import json
import os
import sys
import time


def main():
    if len(sys.argv) != 7:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    model, prompts_path, out_path, task, max_tokens, engine_args = sys.argv[1:]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams

    rows = [json.loads(l) for l in open(prompts_path) if l.strip()]
    args = json.loads(engine_args)
    args.setdefault("distributed_executor_backend", "uni")
    if task == "embed":
        args.setdefault("runner", "pooling")
        args.setdefault("convert", "embed")
    llm = LLM(model=model, **args)
    prompts = [r.get("prompt") for r in rows]
    out = {}
    started = time.perf_counter()
    if task == "embed":
        results = llm.embed(prompts, use_tqdm=False)
        seconds = time.perf_counter() - started
        for r, res in zip(rows, results):
            out[r["id"]] = {"embedding": [float(x) for x in res.outputs.embedding]}
        tokens = 0
    else:
        params = SamplingParams(temperature=0.0, max_tokens=int(max_tokens))
        if task == "chat":
            results = llm.chat([r["messages"] for r in rows], params, use_tqdm=False)
        else:
            results = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        tokens = 0
        for r, res in zip(rows, results):
            c = res.outputs[0]
            tokens += len(c.token_ids)
            out[r["id"]] = {
                "text": c.text,
                "prompt_tokens": len(res.prompt_token_ids),
                "completion_tokens": len(c.token_ids),
                "finish_reason": "stop" if c.finish_reason == "stop" else "length",
            }
    out["_meta"] = {"seconds": seconds, "tokens": tokens, "prompts": len(rows)}
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, out_path)


if __name__ == "__main__":
    main()
