// raydirect's optional compiled helper (see _native.py): what export and into=
// need to know of each of thousands of tensors, read in one loop. In Python each
// attribute is a C call through torch's argument parsing (~100-250 ns after a
// trainer's step has swept the caches); here it is a field read.
#include <torch/extension.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

constexpr char kCpu = 1;
constexpr char kRequiresGrad = 2;
constexpr char kContiguous = 4;

// (shapes, dtypes, nbytes, flags, addresses, versions) of the plain tensors of
// ``tensors``: shapes as tuples, dtypes as torch.dtype objects, flags one byte a
// tensor (kCpu | kRequiresGrad | kContiguous), addresses as int64 bytes.
py::tuple facts(const py::list& tensors) {
  const Py_ssize_t n = PyList_GET_SIZE(tensors.ptr());
  for (Py_ssize_t i = 0; i < n; i++) {
    if (!THPVariable_Check(PyList_GET_ITEM(tensors.ptr(), i))) {
      throw py::type_error("raydirect native facts: not a torch.Tensor");
    }
  }
  py::list shapes(n), dtypes(n), nbytes(n), versions(n);
  std::string flags(static_cast<size_t>(n), '\0');
  std::vector<int64_t> addresses(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; i++) {
    const at::Tensor& t = THPVariable_Unpack(PyList_GET_ITEM(tensors.ptr(), i));
    const auto sizes = t.sizes();
    PyObject* shape = PyTuple_New(static_cast<Py_ssize_t>(sizes.size()));
    if (shape == nullptr) throw py::error_already_set();
    for (size_t d = 0; d < sizes.size(); d++) {
      PyTuple_SET_ITEM(shape, d, PyLong_FromLongLong(sizes[d]));
    }
    PyList_SET_ITEM(shapes.ptr(), i, shape);
    PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));
    Py_INCREF(dtype);
    PyList_SET_ITEM(dtypes.ptr(), i, dtype);
    PyList_SET_ITEM(nbytes.ptr(), i, PyLong_FromSize_t(t.nbytes()));
    PyList_SET_ITEM(versions.ptr(), i, PyLong_FromUnsignedLongLong(t._version()));
    flags[i] = static_cast<char>((t.is_cpu() ? kCpu : 0) | (t.requires_grad() ? kRequiresGrad : 0) |
                                 (t.is_contiguous() ? kContiguous : 0));
    addresses[i] = reinterpret_cast<int64_t>(t.data_ptr());
  }
  py::bytes packed(reinterpret_cast<const char*>(addresses.data()), addresses.size() * sizeof(int64_t));
  return py::make_tuple(shapes, dtypes, nbytes, py::bytes(flags), packed, versions);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("facts", &facts, "shapes, dtypes, nbytes, flags, addresses, versions of many tensors");
}
