"""models/gguf_file.py against gguf's own GGUFReader: the same fields, the same tensors (type, shape, bytes)."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmill.models.gguf_file import read_gguf
from tokenmill.models.loader import ModelLoadError, open_checkpoint
from tokenmill.models.paths import default_model_path


def assert_reads_as_gguf_does(path):
    from gguf import GGUFReader

    ours, theirs = read_gguf(path), GGUFReader(str(path))
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(expected)
    for key, value in expected.items():
        assert ours.fields[key] == value and type(ours.fields[key]) is type(value), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, truth in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == truth.tensor_type and mine.shape == tuple(int(d) for d in truth.shape)
        assert mine.n_elements == truth.n_elements
        assert mine.data.dtype == truth.data.dtype and mine.data.shape == truth.data.shape
        assert np.array_equal(mine.data, truth.data, equal_nan=True), mine.name


def test_the_default_model_reads_as_gguf_reads_it():
    assert_reads_as_gguf_does(default_model_path())


def write_every_kind(path, alignment: int | None):
    """A file with every metadata value type, arrays of each, and tensors plain and quantized, by gguf's writer."""
    from gguf import GGMLQuantizationType, GGUFWriter, quantize

    writer = GGUFWriter(str(path), "llama")
    if alignment:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo, wörld ✓")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.strs", ["a", "", "ünïcode", "x" * 300])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((8, 64)).astype(np.float32)
    writer.add_tensor("plain.f32", rng.standard_normal((3, 5, 7)).astype(np.float32))
    writer.add_tensor("plain.f16", rng.standard_normal((4, 6)).astype(np.float16))
    writer.add_tensor("plain.i32", np.arange(10, dtype=np.int32))
    for kind in ("Q8_0", "Q4_1", "Q4_0"):
        qtype = GGMLQuantizationType[kind]
        writer.add_tensor(f"quant.{kind}", quantize(weight, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [None, 64, 256])
def test_every_value_type_and_tensor_kind_reads_as_gguf_reads_it(tmp_path, alignment):
    path = tmp_path / "every.gguf"
    write_every_kind(path, alignment)
    assert_reads_as_gguf_does(path)
    assert read_gguf(path).fields["t.u64"] == 2**63 + 5


def test_broken_files_are_refused_with_a_reason(tmp_path):
    path = tmp_path / "every.gguf"
    write_every_kind(path, None)
    whole = path.read_bytes()
    cases = {"bad magic": b"GGUX" + whole[4:], "version": whole[:4] + (1).to_bytes(4, "little") + whole[8:],
             "cut short": whole[:200], "past the end": whole[:-16]}
    for expected, content in cases.items():
        broken = tmp_path / f"{expected.replace(' ', '-')}.gguf"
        broken.write_bytes(content)
        with pytest.raises(ValueError, match=expected.split()[-1]):
            read_gguf(broken)
        with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
            open_checkpoint(str(broken))
