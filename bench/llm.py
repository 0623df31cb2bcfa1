#!/usr/bin/env python3
"""The LLM lane's benchmark (issue #46): stoke `run --local 1` against vLLM's
offline `LLM.generate` alone, over the same 5,000 prompts, with the same
engine settings, on the tiny random-weight Llama of scripts/llm_fixture.py.

Usage (the stoke venv's python; bench/llm.sh sets everything up):
  bench/llm.py --llm-python PY --model DIR --stoke BIN --work DIR [--prompts N] [--runs R]

Reports completion tokens per second:
  - vLLM alone: over `LLM.generate` itself (engine start-up left out);
  - stoke, job phase: from the worker's `llm engine for the job` line (the
    engine is up) to its last `shard finished`;
  - stoke, whole command: `stoke run` from start to exit, the engine's
    start-up named beside it.
Greedy, max_tokens fixed, so both do the same work; the outputs are checked
equal. Nothing asserts a time: the ratio is printed with the target (>= 0.9x).

`--scenario prefix`: the shared-prefix workload instead. 8 system prompts
of 200 words (the tiny model takes 512 positions, so not the issue's 500
tokens) stand in front of 90% of the prompts, shuffled; stoke
runs it with `group_by_prefix = true` and `false`, interleaved, and prints
completion tokens/s in the job phase and vLLM's prefix-cache hit rate (from
the job's report.json) for each (target: true >= 1.3x false). The engine's
KV cache is kept small (PREFIX_KV_BYTES), as on a GPU whose cache is full
of running sequences, so what is cached competes for room.
"""

import argparse
import datetime
import glob
import json
import os
import re
import subprocess
import sys
import time

ENGINE_ARGS = {
    "max_model_len": 256,
    "dtype": "float32",
    "gpu_memory_utilization": 0.05,
    "kv_cache_memory_bytes": 268435456,
    "seed": 0,
}
MAX_TOKENS = 32
WORDS = (
    "the water of time people write review product answer question little round year show "
    "every good under name very through summarise classify extract translate system user long thing see"
).split()


def prompts(n):
    out = []
    for i in range(n):
        k = 8 + (i * 7) % 40
        words = [WORDS[(i * 13 + j * j * 5 + j) % len(WORDS)] for j in range(k)]
        out.append({"id": f"q-{i:05d}", "prompt": " ".join(words)})
    return out


PREFIX_ENGINE_ARGS = dict(ENGINE_ARGS, max_model_len=512)
# About 4,000 tokens of KV cache (2 layers x 128 x K and V x 4 bytes a token).
PREFIX_KV_BYTES = 8 * 1024 * 1024


def prefix_prompts(n):
    import random

    rng = random.Random(7)
    systems = []
    for s in range(8):
        words = [WORDS[(s * 31 + j * 7 + j * j) % len(WORDS)] for j in range(200)]
        systems.append(f"system {s}: " + " ".join(words))
    out = []
    for i in range(n):
        k = 8 + (i * 7) % 40
        words = " ".join(WORDS[(i * 13 + j * j * 5 + j) % len(WORDS)] for j in range(k))
        if rng.random() < 0.9:
            words = systems[rng.randrange(8)] + "\nuser: " + words
        out.append({"id": f"q-{i:05d}", "prompt": words})
    rng.shuffle(out)
    return out


def stamp(line):
    m = re.match(r"(?:\[[^\]]*\] )?(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)Z", line)
    return datetime.datetime.fromisoformat(m.group(1)) if m else None


def run_stoke(args, data, run, engine=ENGINE_ARGS, group=False):
    root = os.path.join(args.work, f"root-{run}")
    subprocess.run(["rm", "-rf", root], check=True)
    spec = os.path.join(args.work, "job.toml")
    engine_args = ", ".join(f"{k} = {json.dumps(v)}" for k, v in engine.items())
    with open(spec, "w") as f:
        f.write(
            f'name = "llmbench"\n[dataset]\nformat = "jsonl"\nuri = "{data}"\nid_column = "id"\n'
            f'[processor]\nname = "llm"\n[processor.params]\nmodel = "{args.model}"\n'
            f'prompt_column = "prompt"\nmax_tokens = {MAX_TOKENS}\ntemperature = 0.0\n'
            f'[llm]\npython = "{args.llm_python}"\nengine_args = {{ {engine_args} }}\nin_flight = 1024\n'
            f"group_by_prefix = {'true' if group else 'false'}\n"
            f"[batching]\nbatch_size = 1024\n[checkpoint]\ninterval = 1\n"
            f'[sharding]\nbytes = "64MiB"\n'
        )
    env = dict(os.environ, RUST_LOG="stoke_worker=info")
    started = time.perf_counter()
    p = subprocess.run(
        [args.stoke, "run", spec, "--local", "1", "--device", "cpu", "--root", root, "--job-id", "llmbench"],
        env=env,
        capture_output=True,
        text=True,
    )
    whole = time.perf_counter() - started
    if p.returncode != 0:
        print(p.stderr[-3000:], file=sys.stderr)
        sys.exit(f"stoke run failed ({p.returncode})")
    ready = [stamp(l) for l in p.stderr.splitlines() if "llm engine for the job" in l]
    starting = [stamp(l) for l in p.stderr.splitlines() if "engine starting" in l]
    finished = [stamp(l) for l in p.stderr.splitlines() if "shard finished" in l]
    ready = [s for s in ready if s]
    finished = [s for s in finished if s]
    job_s = (max(finished) - min(ready)).total_seconds() if ready and finished else None
    startup_s = (min(ready) - min(s for s in starting if s)).total_seconds() if ready and starting else None
    import pyarrow.parquet as pq

    texts, tokens = {}, 0
    for path in glob.glob(os.path.join(root, "jobs", "llmbench", "outputs", "**", "*.parquet"), recursive=True):
        t = pq.read_table(path)
        for i, text, ct in zip(t["id"].to_pylist(), t["text"].to_pylist(), t["completion_tokens"].to_pylist()):
            texts[i] = text
            tokens += ct
    report = {}
    report_path = os.path.join(root, "jobs", "llmbench", "report.json")
    if os.path.exists(report_path):
        with open(report_path) as f:
            report = json.load(f)
    return {
        "whole_s": whole,
        "job_s": job_s,
        "startup_s": startup_s,
        "tokens": tokens,
        "texts": texts,
        "hit_rate": (report.get("llm") or {}).get("prefix_cache_hit_rate"),
    }


def run_vllm(args, data, run):
    out = os.path.join(args.work, f"vllm-{run}.json")
    started = time.perf_counter()
    subprocess.run(
        [args.llm_python, args.reference, args.model, data, out, "generate", str(MAX_TOKENS), json.dumps(ENGINE_ARGS)],
        check=True,
        capture_output=True,
    )
    whole = time.perf_counter() - started
    with open(out) as f:
        r = json.load(f)
    meta = r.pop("_meta")
    return {"whole_s": whole, "job_s": meta["seconds"], "tokens": meta["tokens"], "texts": {k: v["text"] for k, v in r.items()}}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--llm-python", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--stoke", required=True)
    p.add_argument("--reference", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--prompts", type=int, default=5000)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--scenario", choices=["plain", "prefix"], default="plain")
    args = p.parse_args()
    os.makedirs(args.work, exist_ok=True)
    if args.scenario == "prefix":
        return prefix_scenario(args)
    data = os.path.join(args.work, f"prompts-{args.prompts}.jsonl")
    with open(data, "w") as f:
        for row in prompts(args.prompts):
            f.write(json.dumps(row) + "\n")
    rows = []
    for run in range(args.runs):
        v = run_vllm(args, data, run)
        s = run_stoke(args, data, run)
        same = sum(1 for k, t in v["texts"].items() if s["texts"].get(k) == t)
        rows.append((v, s, same))
        print(
            f"run {run}: vLLM alone {v['tokens']} tokens in {v['job_s']:.2f} s ({v['tokens'] / v['job_s']:.0f} tok/s; "
            f"whole script {v['whole_s']:.1f} s); stoke job phase {s['tokens']} tokens in {s['job_s']:.2f} s "
            f"({s['tokens'] / s['job_s']:.0f} tok/s), whole command {s['whole_s']:.1f} s of which engine start-up "
            f"{s['startup_s']:.1f} s; identical completions {same}/{len(v['texts'])}",
            flush=True,
        )
    ratios = sorted((s["tokens"] / s["job_s"]) / (v["tokens"] / v["job_s"]) for v, s, _ in rows)
    print(f"stoke / vLLM alone, tokens/s in the job phase: median {ratios[len(ratios) // 2]:.2f}x (target >= 0.9x); runs {', '.join(f'{r:.2f}' for r in ratios)}")


def prefix_scenario(args):
    data = os.path.join(args.work, f"prefix-prompts-{args.prompts}.jsonl")
    with open(data, "w") as f:
        for row in prefix_prompts(args.prompts):
            f.write(json.dumps(row) + "\n")
    engine = dict(PREFIX_ENGINE_ARGS, kv_cache_memory_bytes=PREFIX_KV_BYTES)
    ratios = []
    for run in range(args.runs):
        got = {}
        for group in (False, True):
            s = run_stoke(args, data, f"prefix-{run}-{group}", engine, group)
            got[group] = s
            print(
                f"run {run}: group_by_prefix = {str(group).lower()}: {s['tokens']} tokens in {s['job_s']:.2f} s "
                f"({s['tokens'] / s['job_s']:.0f} tok/s), prefix-cache hit rate {s['hit_rate']}, "
                f"whole command {s['whole_s']:.1f} s",
                flush=True,
            )
        same = sum(1 for k, t in got[False]["texts"].items() if got[True]["texts"].get(k) == t)
        ratio = (got[True]["tokens"] / got[True]["job_s"]) / (got[False]["tokens"] / got[False]["job_s"])
        ratios.append(ratio)
        print(f"run {run}: true / false {ratio:.2f}x; identical completions {same}/{len(got[False]['texts'])}", flush=True)
    ratios.sort()
    print(f"group_by_prefix true / false, tokens/s in the job phase: median {ratios[len(ratios) // 2]:.2f}x (target >= 1.3x); runs {', '.join(f'{r:.2f}' for r in ratios)}")


if __name__ == "__main__":
    main()
