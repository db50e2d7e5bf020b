"""The record's weight storage: float16 on disk where it holds, float32 computed, and back."""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from embedsvc.model import runtime
from embedsvc.model.export import HALF_FROM, half_weights
from embedsvc.model.lean import float_weights
from embedsvc.model.record import compare

RNG = np.random.default_rng(0)
WEIGHTS = {
    "w": RNG.normal(0, 0.3, (40, 50)),  # as a transformer's: float16 holds it
    "b": RNG.normal(0, 0.3, (50,)),  # small: stays float32
    "huge": RNG.normal(0, 1, (50, 30)) * 1e5,  # past float16's 65,504
    "tiny": RNG.normal(0, 1e-6, (30, 40)),  # subnormal in float16: rounded by a tenth
}


def _graph(path):
    """y = ((x @ w + b) @ huge) @ tiny, with the weights as initializers."""
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in WEIGHTS.items()]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Add", ["h", "b"], ["a"]),
             helper.make_node("MatMul", ["a", "huge"], ["g"]),
             helper.make_node("MatMul", ["g", "tiny"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                         ["n", 40])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 40])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return model


def _run(path, x):
    return runtime.session(path, 1).run(["y"], {"x": x})[0]


def test_large_weights_are_stored_as_float16_and_computed_in_float32(tmp_path):
    exported = _graph(tmp_path / "float32.onnx")
    half, count = half_weights(exported)
    onnx.save(half, str(tmp_path / "half.onnx"))
    stored = {t.name: t.data_type for t in half.graph.initializer}
    assert count == 1 and stored == {"w.float16": TensorProto.FLOAT16, "b": TensorProto.FLOAT,
                                     "huge": TensorProto.FLOAT, "tiny": TensorProto.FLOAT}
    assert WEIGHTS["b"].size <= HALF_FROM < WEIGHTS["w"].size
    assert [(n.op_type, list(n.output)) for n in half.graph.node][0] == ("Cast", ["w"])
    assert len(exported.graph.node) == 4  # the exported model is left as it was
    assert (tmp_path / "half.onnx").stat().st_size < (tmp_path / "float32.onnx").stat().st_size
    x = RNG.normal(size=(5, 40)).astype(np.float32)
    got, want = _run(tmp_path / "half.onnx", x), _run(tmp_path / "float32.onnx", x)
    assert got.dtype == np.float32 and not np.array_equal(got, want)  # rounded weights
    compare(got, want, "y")  # within the record's TOLERANCE and PARITY


def test_int8_quantization_reads_the_stored_weights_back_as_float32_initializers(tmp_path):
    half, _ = half_weights(_graph(tmp_path / "float32.onnx"))
    onnx.save(half, str(tmp_path / "half.onnx"))
    restored = float_weights(tmp_path / "half.onnx")
    inits = {t.name: numpy_helper.to_array(t) for t in restored.graph.initializer}
    assert sorted(inits) == sorted(WEIGHTS) and {v.dtype for v in inits.values()} == {
        np.dtype(np.float32)}
    np.testing.assert_array_equal(inits["w"], WEIGHTS["w"].astype(np.float16).astype(np.float32))
    assert [n.op_type for n in restored.graph.node] == ["MatMul", "Add", "MatMul", "MatMul"]
    onnx.save(restored, str(tmp_path / "restored.onnx"))
    x = RNG.normal(size=(5, 40)).astype(np.float32)
    np.testing.assert_array_equal(_run(tmp_path / "restored.onnx", x),
                                  _run(tmp_path / "half.onnx", x))
