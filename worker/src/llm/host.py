"""stoke's LLM engine host: drives vLLM's own engine (LLMEngine, its
add_request/step loop) for one stoke worker. Shipped inside the worker
binary and run with the engine venv's python (`[llm] python`).

Protocol: one JSON object per line. Requests on stdin, answers on the
stdout the process started with (fd 1 is then pointed at stderr, so
nothing vLLM prints can corrupt the stream). The host exits when stdin
closes: the worker is gone.

Startup config: a JSON object in the environment variable STOKE_LLM_CONFIG:
  {"model": path, "task": "generate"|"embed", "engine_args": {...}}
First answer: {"type": "ready", "vllm": version, "max_model_len": n,
  "engine_args": {...}} or {"type": "error", "message": ...} (then exit 3).

Requests:
  {"type": "generate", "rid": s, "prompt": text | "messages": [...],
   "max_tokens": n, "temperature": x, "seed": n}
  {"type": "embed", "rid": s, "prompt": text}
  {"type": "abort", "rids": [s, ...]}   (no answer; unknown rids ignored)
Answers, in completion order:
  {"type": "done", "rid": s, "text": ..., "prompt_tokens": n,
   "completion_tokens": n, "finish_reason": "stop"|"length",
   "cached_tokens": n (prompt tokens found in the prefix cache)}
  {"type": "done", "rid": s, "embedding": [...], "prompt_tokens": n}
  {"type": "rejected", "rid": s, "reason": ...}   (never seen by the engine)

Fault points for tests (environment): STOKE_LLM_FAULT_ABORT_ON=<text>:
the process aborts (SIGABRT) when a prompt containing <text> is handed to
the engine; STOKE_LLM_FAULT_HANG_ON=<text>: it stops answering instead;
STOKE_LLM_FAULT_STEP_MS=<ms>: each engine step takes that much longer (a
slow engine, so that tests find prompts in it).
"""

import json
import os
import select
import sys
import threading
import time
import traceback


def main():
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    lock = threading.Lock()
    # Answers of one engine step go out in one write (`flush`).
    outbox = []

    def send(msg):
        outbox.append(json.dumps(msg, separators=(",", ":")))
        flush()

    def post(msg):
        outbox.append(json.dumps(msg, separators=(",", ":")))

    def flush():
        if outbox:
            with lock:
                proto.write("\n".join(outbox) + "\n")
                proto.flush()
            outbox.clear()

    config = json.loads(os.environ["STOKE_LLM_CONFIG"])
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    abort_on = os.environ.get("STOKE_LLM_FAULT_ABORT_ON") or None
    hang_on = os.environ.get("STOKE_LLM_FAULT_HANG_ON") or None
    step_s = float(os.environ.get("STOKE_LLM_FAULT_STEP_MS") or 0) / 1000

    # Requests are read by the engine's own loop once it is up (`select`
    # between steps: no reader thread to contend with the engine's for the
    # GIL: about 8% of the tokens/s on a 2-core machine). While the engine
    # loads, a thread watches stdin, so that a closed stdin (the worker is
    # gone) ends the host even then; what it reads meanwhile waits in
    # `early`.
    stdin = sys.stdin.fileno()
    early = bytearray()
    loading = threading.Event()
    loading.set()

    def watch_stdin():
        while loading.is_set():
            ready, _, _ = select.select([stdin], [], [], 0.2)
            if not ready or not loading.is_set():
                continue
            with lock:
                if not loading.is_set():
                    return
                data = os.read(stdin, 1 << 20)
                if not data:
                    # The worker is gone (or stopped us): nothing more to do.
                    os._exit(0)
                early.extend(data)

    watcher = threading.Thread(target=watch_stdin, daemon=True)
    watcher.start()

    task = config.get("task", "generate")
    try:
        import vllm
        from vllm import EngineArgs, PoolingParams, SamplingParams
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.llm_engine import LLMEngine

        args = dict(config.get("engine_args") or {})
        args.setdefault("distributed_executor_backend", "uni")
        # As vLLM's own `LLM` class: no periodic stats logging, whose
        # per-step bookkeeping cost 5% of the tokens/s here. The prefix
        # cache's hits come with each output (`num_cached_tokens`).
        args.setdefault("disable_log_stats", True)
        if task == "embed":
            args.setdefault("runner", "pooling")
            args.setdefault("convert", "embed")
        # The offline defaults vLLM's `LLM` class gets (a batch lane is
        # offline work): its usage context sizes the scheduler's token
        # budget per step for throughput (max_num_batched_tokens 4096
        # against 2048 on a CPU, 8% of the tokens/s here).
        engine = LLMEngine.from_engine_args(
            EngineArgs(model=config["model"], **args),
            usage_context=UsageContext.LLM_CLASS,
        )
        tokenizer = engine.get_tokenizer()
        max_model_len = engine.vllm_config.model_config.max_model_len
    except BaseException as e:  # noqa: BLE001 - said to the worker, then exit
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        send({"type": "error", "message": last})
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(3)
    send(
        {
            "type": "ready",
            "vllm": vllm.__version__,
            "max_model_len": max_model_len,
            "engine_args": args,
        }
    )

    # Our request ids by the engine's (it may add a suffix to them), and
    # the engine's by ours.
    pending = {}
    internal_of = {}

    def handle(req):
        kind = req.get("type")
        rid = req.get("rid")
        if kind == "abort":
            known = [r for r in req.get("rids") or [] if r in internal_of]
            for r in known:
                pending.pop(internal_of.pop(r), None)
                pending.pop(r, None)
            if known:
                # By our (external) ids: vLLM maps them to its own.
                engine.abort_request(known, internal=False)
            return
        if kind not in ("generate", "embed"):
            post({"type": "rejected", "rid": rid, "reason": f"unknown request type {kind!r}"})
            return
        try:
            if req.get("messages") is not None:
                text = tokenizer.apply_chat_template(
                    req["messages"], tokenize=False, add_generation_prompt=True
                )
                ids = tokenizer.encode(text, add_special_tokens=False)
            else:
                text = req["prompt"]
                ids = tokenizer.encode(text)
        except Exception as e:  # noqa: BLE001 - a bad record, not a crash
            post({"type": "rejected", "rid": rid, "reason": f"cannot tokenize the prompt: {e}"})
            return
        # The engine would refuse it (or fail): a bad record, never a crash.
        room = max_model_len - (1 if kind == "generate" else 0)
        if len(ids) > room:
            post(
                {
                    "type": "rejected",
                    "rid": rid,
                    "reason": f"prompt has {len(ids)} tokens, more than the engine's max_model_len ({max_model_len}) allows",
                }
            )
            return
        if abort_on is not None and abort_on in text:
            sys.stderr.write(f"stoke fault point: aborting on a prompt containing {abort_on!r}\n")
            sys.stderr.flush()
            flush()
            os.abort()
        if hang_on is not None and hang_on in text:
            sys.stderr.write(f"stoke fault point: hanging on a prompt containing {hang_on!r}\n")
            sys.stderr.flush()
            flush()
            while True:
                time.sleep(3600)
        if kind == "generate":
            max_tokens = min(int(req.get("max_tokens", 16)), max_model_len - len(ids))
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=float(req.get("temperature", 0.0)),
                seed=req.get("seed"),
            )
        else:
            params = PoolingParams(task="embed")
        internal = engine.add_request(rid, {"prompt_token_ids": ids}, params)
        if not isinstance(internal, str):
            internal = rid
        # Outputs carry the engine's id or ours, depending on the version.
        pending[internal] = rid
        pending[rid] = rid
        internal_of[rid] = internal

    def answer(out):
        rid = pending.pop(out.request_id, None)
        if rid is None:
            return
        pending.pop(internal_of.pop(rid, None), None)
        pending.pop(rid, None)
        prompt_tokens = len(out.prompt_token_ids or [])
        # Prompt tokens vLLM's prefix cache already held.
        cached = int(getattr(out, "num_cached_tokens", 0) or 0)
        if task == "embed":
            # The engine's pooling output holds the vector as a tensor.
            data = getattr(out.outputs, "embedding", None)
            if data is None:
                data = out.outputs.data.tolist()
            post(
                {
                    "type": "done",
                    "rid": rid,
                    "embedding": [float(x) for x in data],
                    "prompt_tokens": prompt_tokens,
                }
            )
            return
        c = out.outputs[0]
        send(
            {
                "type": "done",
                "rid": rid,
                "text": c.text,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(c.token_ids),
                "finish_reason": "stop" if c.finish_reason == "stop" else "length",
                "cached_tokens": cached,
            }
        )

    with lock:
        loading.clear()
        pending_bytes = bytes(early)
    watcher.join()
    lines = Lines(pending_bytes)
    for req in lines.take():
        handle(req)
    while True:
        busy = engine.has_unfinished_requests()
        # Wait for requests while the engine is idle; between steps, take
        # whatever has arrived.
        ready, _, _ = select.select([stdin], [], [], 0 if busy else None)
        if ready:
            data = os.read(stdin, 1 << 20)
            if not data:
                # The worker is gone (or stopped us): nothing more to do.
                flush()
                os._exit(0)
            lines.feed(data)
            for req in lines.take():
                handle(req)
            flush()
        if engine.has_unfinished_requests():
            if step_s:
                time.sleep(step_s)
            for out in engine.step():
                if out.finished:
                    answer(out)
            flush()


class Lines:
    """JSON requests, one a line, from bytes as they arrive."""

    def __init__(self, data=b""):
        self.buf = bytearray(data)

    def feed(self, data):
        self.buf.extend(data)

    def take(self):
        end = self.buf.rfind(b"\n")
        if end < 0:
            return []
        whole = bytes(self.buf[: end + 1])
        del self.buf[: end + 1]
        return [json.loads(line) for line in whole.splitlines() if line.strip()]


if __name__ == "__main__":
    main()
