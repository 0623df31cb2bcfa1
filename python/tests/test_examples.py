"""The seeds' guides as examples (examples/determined, examples/graphbook),
run as a user would: on two local worker processes (workers=2) and by
`stoke run --local 2`; every record exactly once, with the prediction the
model gives it."""

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch

from conftest import bin_path

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
IMAGES = 320


def copy_example(name, tmp_path):
    folder = tmp_path / name
    shutil.copytree(EXAMPLES / name, folder)
    return folder


def manifest_outputs(root):
    manifests = list(pathlib.Path(root).glob("jobs/*/manifest.json"))
    assert len(manifests) == 1, manifests
    return [o["uri"].removeprefix("file://") for o in json.loads(manifests[0].read_text())["outputs"]]


def run(cmd, cwd, **env):
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, **env))
    assert out.returncode == 0, f"{cmd}:\n{out.stdout}\n{out.stderr}"
    return out


@pytest.mark.parametrize("how", ["workers=2", "stoke run --local 2"])
def test_determined_guide(tmp_path, how):
    folder = copy_example("determined", tmp_path)
    root = tmp_path / "root"
    env = {"STOKE_EXAMPLE_IMAGES": str(IMAGES)}
    if how == "workers=2":
        run([sys.executable, "inference.py", "--workers", "2", "--root", str(root), "--job-id", "det"], folder, **env)
    else:
        spec = (folder / "job.toml").read_text().replace("count = 10000", f"count = {IMAGES}")
        (folder / "job.toml").write_text(spec + "\n[sharding]\nrecords = 128\n")
        run([str(bin_path("stoke")), "run", "--local", "2", "job.toml", "--root", str(root), "--device", "cpu"],
            folder, **env)
    sys.path.insert(0, str(folder))
    try:
        os.environ["STOKE_EXAMPLE_IMAGES"] = str(IMAGES)
        import inference
    finally:
        sys.path.remove(str(folder))
    dataset = inference.make_dataset()
    model = inference.get_model().eval()
    # Each image of the dataset by its bytes, to find which index a saved
    # input is.
    index_of = {hashlib.sha256(dataset[i][0].numpy().tobytes()).hexdigest(): i for i in range(IMAGES)}
    seen = []
    for path in manifest_outputs(root):
        assert "prediction_output_" in path, path
        for output in torch.load(path, weights_only=False):
            images, labels = output["input"][0], output["input"][1]
            with torch.no_grad():
                want = model(images)
            assert torch.allclose(output["predictions"], want, atol=1e-5)
            for image, label in zip(images, labels):
                i = index_of[hashlib.sha256(image.numpy().tobytes()).hexdigest()]
                assert int(label) == int(dataset[i][1])
                seen.append(i)
    assert sorted(seen) == list(range(IMAGES))
    sys.modules.pop("inference", None)


@pytest.mark.parametrize("how", ["workers=2", "stoke run --local 2"])
def test_graphbook_guide(tmp_path, how):
    folder = copy_example("graphbook", tmp_path)
    run([sys.executable, "make_images.py", "images", "200"], folder)
    spec = (folder / "job.toml").read_text().replace("records = 256", "records = 64")
    (folder / "job.toml").write_text(spec)
    root = tmp_path / "root"
    if how == "workers=2":
        script = ("import sys, stoke, steps; "
                  f"print(stoke.torch_batch_process(steps.MyMLModel, 'job.toml', workers=2, root={str(root)!r})['records'])")
        out = run([sys.executable, "-c", script], folder)
        assert out.stdout.strip().splitlines()[-1] == "200"
    else:
        run([str(bin_path("stoke")), "run", "--local", "2", "job.toml", "--root", str(root), "--device", "cpu"], folder)
    sys.path.insert(0, str(folder))
    try:
        import steps
    finally:
        sys.path.remove(str(folder))
    model = steps.get_model().eval()
    got = {}
    for path in manifest_outputs(root):
        t = pq.read_table(path).to_pydict()
        for uri, pred in zip(t["id"], t["prediction"]):
            assert uri not in got, f"{uri} twice"
            got[uri] = pred
    names = sorted(p.name for p in (folder / "images").iterdir())
    assert sorted(pathlib.Path(u).name for u in got) == names
    for uri, pred in got.items():
        item = {"uri": uri, "bytes": (folder / "images" / pathlib.Path(uri).name).read_bytes()}
        with torch.no_grad():
            want = model(steps.MyMLModel.load_fn(item).unsqueeze(0)).argmax(1).item()
        assert pred == want, uri
    sys.modules.pop("steps", None)
