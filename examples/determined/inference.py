"""Determined's "Torch Batch Processing API" guide, its three steps as
written, with the import line changed to stoke's.

Only two things differ from the guide, both outside its code: CIFAR10's
download needs the internet, so step 2 uses torchvision's FakeData with
the guide's transform (CIFAR10's shape and classes), and the guide leaves
``get_model()`` to the reader, so a small CNN is defined here. The guide
names its dataset ``inference_data`` in step 2 and ``dataset`` in step 3;
``dataset = inference_data`` joins them.

    python inference.py                       # in this process
    python inference.py --workers 2           # two local worker processes
    python inference.py --coordinator HOST:PORT --root ROOT   # a fleet
    stoke run --local 2 job.toml              # the same, from a job spec
"""

import argparse
import os
import pathlib

import filelock
import torch
import torchvision as tv
from torchvision import transforms

from stoke import TorchBatchProcessor, torch_batch_process   # was: from determined.pytorch.experimental import TorchBatchProcessor, torch_batch_process

# How many images FakeData makes (the tests use a few hundred).
IMAGES = int(os.environ.get("STOKE_EXAMPLE_IMAGES", "10000"))


def get_model():
    # The same weights in every process: the tests recompute predictions.
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(16, 10),
    )


"""
Define custom processor class
"""
class InferenceProcessor(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        self.model = context.prepare_model_for_inference(get_model())
        self.output = []
        self.last_index = 0

    def process_batch(self, batch, batch_idx) -> None:
        model_input = batch[0]
        model_input = self.context.to_device(model_input)

        with torch.no_grad():
            with self.profiler as p:
                pred = self.model(model_input)
                p.step()
                output = {"predictions": pred, "input": batch}
                self.output.append(output)

        self.last_index = batch_idx

    def on_checkpoint_start(self):
        # During checkpoint, we persist prediction result
        if len(self.output) == 0:
            return
        file_name = f"prediction_output_{self.last_index}"
        with self.context.upload_path() as path:
            file_path = pathlib.Path(path, file_name)
            torch.save(self.output, file_path)

        self.output = []


def make_dataset():
    """Step 2, as a factory a job spec can name (job.toml)."""
    """
    Initialize dataset
    """
    transform = transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))]
    )
    with filelock.FileLock(os.path.join("/tmp", "inference.lock")):
        inference_data = tv.datasets.FakeData(
            size=IMAGES, image_size=(3, 32, 32), num_classes=10, transform=transform
        )
    return inference_data


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--coordinator")
    parser.add_argument("--root")
    parser.add_argument("--job-id")
    args = parser.parse_args()
    # stoke's additions, keyword-only after Determined's arguments.
    stoke_options = {"workers": args.workers, "coordinator": args.coordinator, "root": args.root, "job_id": args.job_id}

    inference_data = make_dataset()
    dataset = inference_data

    """
    Pass processor class and dataset to torch_batch_process
    """
    report = torch_batch_process(
            InferenceProcessor,
            dataset,
            batch_size=64,
            checkpoint_interval=10,
            **stoke_options,
        )
    print(report["job_id"], report["records"], report["manifest_uri"])


if __name__ == "__main__":
    main()
