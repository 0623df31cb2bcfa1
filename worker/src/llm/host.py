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
from types import SimpleNamespace


def main():
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    lock = threading.Lock()
    outbox = Outbox(proto, lock)

    config = json.loads(os.environ["STOKE_LLM_CONFIG"])
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    abort_on = os.environ.get("STOKE_LLM_FAULT_ABORT_ON") or None
    hang_on = os.environ.get("STOKE_LLM_FAULT_HANG_ON") or None
    step_s = float(os.environ.get("STOKE_LLM_FAULT_STEP_MS") or 0) / 1000

    stdin = sys.stdin.fileno()
    watcher = StdinWatcher(stdin, lock)
    task = config.get("task", "generate")
    vllm = start_engine(config, task, outbox)
    outbox.send(
        {
            "type": "ready",
            "vllm": vllm.version,
            "max_model_len": vllm.max_model_len,
            "engine_args": vllm.args,
        }
    )
    requests = Requests(vllm, task, outbox, abort_on, hang_on)
    serve(stdin, watcher.stop(), vllm.engine, requests, outbox, step_s)


class Outbox:
    """Answers to the worker, on the stdout the process started with.
    Answers of one engine step go out in one write (`flush`)."""

    def __init__(self, proto, lock):
        self.proto = proto
        self.lock = lock
        self.lines = []

    def send(self, msg):
        self.lines.append(json.dumps(msg, separators=(",", ":")))
        self.flush()

    def post(self, msg):
        self.lines.append(json.dumps(msg, separators=(",", ":")))

    def flush(self):
        if self.lines:
            with self.lock:
                self.proto.write("\n".join(self.lines) + "\n")
                self.proto.flush()
            self.lines.clear()


class StdinWatcher:
    """Requests are read by the engine's own loop once it is up (`select`
    between steps: no reader thread to contend with the engine's for the
    GIL: about 8% of the tokens/s on a 2-core machine). While the engine
    loads, a thread watches stdin, so that a closed stdin (the worker is
    gone) ends the host even then; what it reads meanwhile waits in
    `early`, handed over by `stop`."""

    def __init__(self, stdin, lock):
        self.stdin = stdin
        self.lock = lock
        self.early = bytearray()
        self.loading = threading.Event()
        self.loading.set()
        self.thread = threading.Thread(target=self.watch, daemon=True)
        self.thread.start()

    def watch(self):
        while self.loading.is_set():
            ready, _, _ = select.select([self.stdin], [], [], 0.2)
            if not ready or not self.loading.is_set():
                continue
            with self.lock:
                if not self.loading.is_set():
                    return
                data = os.read(self.stdin, 1 << 20)
                if not data:
                    # The worker is gone (or stopped us): nothing more to do.
                    os._exit(0)
                self.early.extend(data)

    def stop(self):
        """Ends the watch (the engine is up): what it read meanwhile."""
        with self.lock:
            self.loading.clear()
            pending_bytes = bytes(self.early)
        self.thread.join()
        return pending_bytes


def start_engine(config, task, outbox):
    """vLLM's engine for `config`, with what the requests need of vLLM;
    a failure is said to the worker, and the host exits (3)."""
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
        return SimpleNamespace(
            version=vllm.__version__,
            engine=engine,
            args=args,
            tokenizer=engine.get_tokenizer(),
            max_model_len=engine.vllm_config.model_config.max_model_len,
            SamplingParams=SamplingParams,
            PoolingParams=PoolingParams,
        )
    except BaseException as e:  # noqa: BLE001 - said to the worker, then exit
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        outbox.send({"type": "error", "message": last})
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(3)


class Requests:
    """The worker's requests in the engine, and its answers."""

    def __init__(self, vllm, task, outbox, abort_on, hang_on):
        self.vllm = vllm
        self.engine = vllm.engine
        self.tokenizer = vllm.tokenizer
        self.max_model_len = vllm.max_model_len
        self.task = task
        self.outbox = outbox
        self.abort_on = abort_on
        self.hang_on = hang_on
        # Our request ids by the engine's (it may add a suffix to them),
        # and the engine's by ours.
        self.pending = {}
        self.internal_of = {}

    def handle(self, req):
        kind = req.get("type")
        rid = req.get("rid")
        if kind == "abort":
            known = [r for r in req.get("rids") or [] if r in self.internal_of]
            for r in known:
                self.pending.pop(self.internal_of.pop(r), None)
                self.pending.pop(r, None)
            if known:
                # By our (external) ids: vLLM maps them to its own.
                self.engine.abort_request(known, internal=False)
            return
        if kind not in ("generate", "embed"):
            self.outbox.post({"type": "rejected", "rid": rid, "reason": f"unknown request type {kind!r}"})
            return
        try:
            if req.get("messages") is not None:
                text = self.tokenizer.apply_chat_template(
                    req["messages"], tokenize=False, add_generation_prompt=True
                )
                ids = self.tokenizer.encode(text, add_special_tokens=False)
            else:
                text = req["prompt"]
                ids = self.tokenizer.encode(text)
        except Exception as e:  # noqa: BLE001 - a bad record, not a crash
            self.outbox.post({"type": "rejected", "rid": rid, "reason": f"cannot tokenize the prompt: {e}"})
            return
        # The engine would refuse it (or fail): a bad record, never a crash.
        room = self.max_model_len - (1 if kind == "generate" else 0)
        if len(ids) > room:
            self.outbox.post(
                {
                    "type": "rejected",
                    "rid": rid,
                    "reason": f"prompt has {len(ids)} tokens, more than the engine's max_model_len ({self.max_model_len}) allows",
                }
            )
            return
        if self.abort_on is not None and self.abort_on in text:
            sys.stderr.write(f"stoke fault point: aborting on a prompt containing {self.abort_on!r}\n")
            sys.stderr.flush()
            self.outbox.flush()
            os.abort()
        if self.hang_on is not None and self.hang_on in text:
            sys.stderr.write(f"stoke fault point: hanging on a prompt containing {self.hang_on!r}\n")
            sys.stderr.flush()
            self.outbox.flush()
            while True:
                time.sleep(3600)
        if kind == "generate":
            max_tokens = min(int(req.get("max_tokens", 16)), self.max_model_len - len(ids))
            params = self.vllm.SamplingParams(
                max_tokens=max_tokens,
                temperature=float(req.get("temperature", 0.0)),
                seed=req.get("seed"),
            )
        else:
            params = self.vllm.PoolingParams(task="embed")
        internal = self.engine.add_request(rid, {"prompt_token_ids": ids}, params)
        if not isinstance(internal, str):
            internal = rid
        # Outputs carry the engine's id or ours, depending on the version.
        self.pending[internal] = rid
        self.pending[rid] = rid
        self.internal_of[rid] = internal

    def answer(self, out):
        rid = self.pending.pop(out.request_id, None)
        if rid is None:
            return
        self.pending.pop(self.internal_of.pop(rid, None), None)
        self.pending.pop(rid, None)
        prompt_tokens = len(out.prompt_token_ids or [])
        # Prompt tokens vLLM's prefix cache already held.
        cached = int(getattr(out, "num_cached_tokens", 0) or 0)
        if self.task == "embed":
            # The engine's pooling output holds the vector as a tensor.
            data = getattr(out.outputs, "embedding", None)
            if data is None:
                data = out.outputs.data.tolist()
            self.outbox.post(
                {
                    "type": "done",
                    "rid": rid,
                    "embedding": [float(x) for x in data],
                    "prompt_tokens": prompt_tokens,
                }
            )
            return
        c = out.outputs[0]
        self.outbox.send(
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


def serve(stdin, pending_bytes, engine, requests, outbox, step_s):
    """Hands requests to the engine and its answers back, until stdin
    closes."""
    lines = Lines(pending_bytes)
    for req in lines.take():
        requests.handle(req)
    while True:
        busy = engine.has_unfinished_requests()
        # Wait for requests while the engine is idle; between steps, take
        # whatever has arrived.
        ready, _, _ = select.select([stdin], [], [], 0 if busy else None)
        if ready:
            data = os.read(stdin, 1 << 20)
            if not data:
                # The worker is gone (or stopped us): nothing more to do.
                outbox.flush()
                os._exit(0)
            lines.feed(data)
            for req in lines.take():
                requests.handle(req)
            outbox.flush()
        if engine.has_unfinished_requests():
            if step_s:
                time.sleep(step_s)
            for out in engine.step():
                if out.finished:
                    requests.answer(out)
            outbox.flush()


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
