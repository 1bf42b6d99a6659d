"""shared.model.gguf_index against the gguf package's own GGUFReader: the same fields, the same tensors (dtype,
shape and bytes), on the default model and on a file with every kind of metadata value; bad files raise."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from shared.model.gguf_index import GGUFIndex, StringArray


def _same_as_reader(path: str) -> GGUFIndex:
    index, reader = GGUFIndex(path), gguf.GGUFReader(path)
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]          # the reader's header pseudo-fields
    assert list(index.fields) == keys
    for key in keys:
        ours, theirs = index.fields[key], reader.fields[key].contents()
        if isinstance(ours, StringArray):
            assert len(ours) == len(theirs)
            ours = ours.tolist()
        assert ours == theirs and type(ours) is type(theirs), key
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(index.tensors, reader.tensors):
        assert ours.tensor_type == theirs.tensor_type and ours.shape == tuple(theirs.shape.tolist())
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape, ours.name
        assert np.array_equal(ours.data, theirs.data), ours.name
    return index


def test_default_model_reads_as_the_gguf_reader_reads_it(model_path):
    index = _same_as_reader(model_path)
    tokens = index.fields["tokenizer.ggml.tokens"]
    last = gguf.GGUFReader(model_path).fields["tokenizer.ggml.tokens"].contents(-1)
    assert len(tokens) == 49152 and tokens[-1] == last
    assert index.get("llama.block_count") == 30 and index.get("no.such.key", 7) == 7


def test_every_value_type_and_tensor_type(tmp_path):
    path = str(tmp_path / "kinds.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1e-5)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_string("t.empty", "")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.strs", ["a", "", "ünï", "<|im_end|>"])
    w.add_array("t.bools", [True, False])
    w.add_array("t.none", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    index = _same_as_reader(path)
    assert index.get("t.strs")[2] == "ünï" and index.get("t.strs")[-1] == "<|im_end|>"
    assert index.get("t.u64") == 2**63 + 5 and index.get("t.str") == "héllo ✓"
    q8 = index.tensors[-1]
    assert np.array_equal(gguf.quants.dequantize(q8.data, q8.tensor_type),
                          gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0))


def test_bad_files_raise_value_errors(model_path, tmp_path):
    text = tmp_path / "not.gguf"
    text.write_text("definitely not a model file")
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFIndex(str(text))
    with open(model_path, "rb") as f:
        head = f.read(5_000_000)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(head)                                  # metadata whole, tensors cut off
    with pytest.raises(ValueError, match="past the end"):
        GGUFIndex(str(cut))
    cut.write_bytes(head[:100_000])                        # inside the tokenizer's strings
    with pytest.raises(ValueError, match="truncated or corrupt"):
        GGUFIndex(str(cut))


def test_kept_weights_are_the_same_tensors_and_the_rest_is_not_dequantised(model_path, monkeypatch):
    from gguf import quants

    from shared.model import loader

    cfg = loader.load_config(model_path)
    want = {"model.embed_tokens.weight", "model.norm.weight", "model.layers.3.mlp.down_proj.weight"}
    every = {name: w for name, w in loader.iter_weights(model_path, cfg, progress=False) if name in want}
    calls = []
    real = quants.dequantize
    monkeypatch.setattr(quants, "dequantize", lambda data, kind: calls.append(kind) or real(data, kind))
    kept = dict(loader.iter_weights(model_path, cfg, progress=False, keep=want.__contains__))
    assert kept.keys() == want == every.keys()
    assert all(torch.equal(kept[n], every[n]) for n in want)
    assert len(calls) == len(want)                      # 3 of the 272 tensors dequantised
