"""What `context.fetch(uri)` returns works as the book and the docstring
say: with torch.load (a state_dict, as Determined users load an eager
model), torch.jit.load, io-style readers and bytes operations alike."""

import hashlib
import io
import json

import numpy as np
import torch
from stoke._runtime import Fetched


def saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_torch_load_reads_a_state_dict():
    model = torch.nn.Linear(4, 2)
    fetched = Fetched(saved(model.state_dict()))
    state = torch.load(fetched)
    assert torch.equal(state["weight"], model.state_dict()["weight"])
    # Twice, and after a read: each load starts at the beginning.
    fetched.read(7)
    again = torch.load(fetched, weights_only=True)
    assert torch.equal(again["bias"], model.state_dict()["bias"])
    fresh = torch.nn.Linear(4, 2)
    fresh.load_state_dict(torch.load(Fetched(saved(model.state_dict()))))
    assert torch.equal(fresh.weight, model.weight)


def test_torch_jit_load_reads_a_scripted_module():
    scripted = torch.jit.script(torch.nn.Linear(3, 1))
    buf = io.BytesIO()
    torch.jit.save(scripted, buf)
    loaded = torch.jit.load(Fetched(buf.getvalue()))
    x = torch.ones(2, 3)
    assert torch.equal(loaded(x), scripted(x))


def test_io_style_reading():
    f = Fetched(b"alpha\nbeta\ngamma")
    assert f.readline() == b"alpha\n"
    assert f.tell() == 6
    assert f.read(4) == b"beta"
    f.seek(0)
    assert list(f) == [b"alpha\n", b"beta\n", b"gamma"]
    f.seek(-5, io.SEEK_END)
    assert f.read() == b"gamma"
    assert f.readable() and f.seekable()
    buf = bytearray(5)
    f.seek(0)
    assert f.readinto(buf) == 5 and bytes(buf) == b"alpha"
    with Fetched(b"x") as g:
        assert g.read() == b"x"
    assert io.TextIOWrapper(io.BufferedReader(io.BytesIO(f))).readline() == "alpha\n"


def test_bytes_operations():
    raw = json.dumps({"vocab": ["a", "b"]}).encode()
    f = Fetched(raw)
    assert isinstance(f, bytes)
    assert f == raw and bytes(f) == raw and len(f) == len(raw)
    assert json.loads(f) == {"vocab": ["a", "b"]}
    assert hashlib.sha256(f).hexdigest() == hashlib.sha256(raw).hexdigest()
    assert f[:1] == b"{" and f.startswith(b"{") and f.decode().endswith("}")
    assert np.frombuffer(Fetched(b"\x01\x02"), dtype=np.uint8).tolist() == [1, 2]
    assert b"vocab" in f
