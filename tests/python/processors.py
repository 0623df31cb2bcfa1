"""Python processors the process tests run (tests/tests/python.rs)."""

import os
import signal

import torch
from stoke import BadRecord, TorchBatchProcessor


class Runner(TorchBatchProcessor):
    """What the built-in runner does for `outputs = ["argmax", "scores"]`:
    the TorchScript model on the `features` column, rows keyed by id."""

    def __init__(self, context):
        self.context = context
        # fetch's bytes read as a file, as torch.jit.load wants.
        model = torch.jit.load(context.fetch(context.params["model"]))
        self.model = context.prepare_model_for_inference(model)
        self.fail = context.params.get("fail_batch")
        self.bad = set(context.params.get("bad", []))

    def process_batch(self, batch, batch_idx):
        if self.fail is not None and self.context.shard == self.fail[0] and batch_idx == self.fail[1]:
            raise ValueError(f"boom on purpose in {self.context.shard}/{batch_idx}")
        for record_id in batch.ids:
            if record_id in self.bad:
                raise BadRecord(record_id, "listed as bad by the test")
        x = self.context.to_device(batch["features"])
        with torch.no_grad():
            scores = self.model(x)
        self.context.write_rows({"id": batch.ids, "prediction": scores.argmax(1), "scores": scores})

    def on_finish(self):
        # A side channel for the tests: one line per instance that finished.
        log = self.context.params.get("finish_log")
        if log:
            with open(log, "a") as f:
                f.write(f"{os.getpid()} {self.context.device}\n")


class ZeroCopy(TorchBatchProcessor):
    """Reports, per record, the data pointer of the batch's tensor as Rust
    made it and as Python sees it, and how many libtorch_cpu.so files are
    mapped into the process."""

    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        t = batch["features"]
        with open("/proc/self/maps") as maps:
            libs = {line.split()[-1] for line in maps if line.rstrip().endswith("/libtorch_cpu.so")}
        n = len(batch)
        self.context.write_rows({
            "id": batch.ids,
            "rust_ptr": [batch._native_ptrs["features"]] * n,
            "python_ptr": [t.data_ptr()] * n,
            "libtorch_cpu": [len({os.path.realpath(p) for p in libs})] * n,
            "is_tensor": [isinstance(t, torch.Tensor)] * n,
            "group_is_tensor": [isinstance(batch["group"], torch.Tensor)] * n,
            "device": [str(self.context.device)] * n,
            "grad": [torch.is_grad_enabled()] * n,
        })


class Slow(Runner):
    """The runner, a little slower per batch, so a test can interrupt it."""

    def process_batch(self, batch, batch_idx):
        import time

        time.sleep(0.02)
        super().process_batch(batch, batch_idx)


class Sleepy(Runner):
    """The runner at a second per batch: a shard of 8 batches takes 8 s,
    its first checkpoint (3 batches) lands at 3 s."""

    def process_batch(self, batch, batch_idx):
        import time

        time.sleep(1.0)
        super().process_batch(batch, batch_idx)


class NotAProcessor:
    def __init__(self, context):
        pass


class InitRaises(TorchBatchProcessor):
    def __init__(self, context):
        raise RuntimeError("cannot load the model on purpose")

    def process_batch(self, batch, batch_idx):
        pass


class Poison(TorchBatchProcessor):
    """Writes one row per record (its id and this worker's pid). Its native
    code "crashes" on the records listed in `poison`: `os.abort()`, as a
    segfault in a decoder or a CUDA illegal address would end the process.
    It hangs (a native call that never returns) on those in `hang`, and
    raises CUDA's sticky "illegal memory access" on those in `sticky`; it
    takes `seconds_per_record` for every record (a slow model)."""

    def __init__(self, context):
        self.context = context
        self.poison = set(context.params.get("poison", []))
        self.hang = set(context.params.get("hang", []))
        self.sticky = set(context.params.get("sticky", []))
        # A slow model: this long per record (healthy ones too).
        self.seconds_per_record = float(context.params.get("seconds_per_record", 0))

    def process_batch(self, batch, batch_idx):
        if self.seconds_per_record:
            import time

            time.sleep(self.seconds_per_record * len(batch))
        for record_id in batch.ids:
            if record_id in self.poison:
                os.abort()
            if record_id in self.sticky:
                # What torch raises after a kernel read a bad address: every
                # later CUDA call in this process fails the same way.
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            if record_id in self.hang:
                import time

                time.sleep(3600)
        self.context.write_rows({"id": batch.ids, "pid": [os.getpid()] * len(batch)})


class Uploads(Runner):
    """The runner, leaving a file in `upload_path()` at every checkpoint."""

    def on_checkpoint_start(self):
        with self.context.upload_path() as path:
            (path / f"seen-{self.context.shard}.txt").write_text("a checkpoint's note\n")


class Features(TorchBatchProcessor):
    """A pipeline's first stage (tests/tests/pipelines.rs): the records'
    `features` as they are, keyed by id, for the model in the next stage."""

    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        self.context.write_rows({"id": batch.ids, "features": batch["features"]})
