// The extension module moebius._moebius: one registration per area (see common.hpp), and the
// one exception type every C++ failure arrives as.

#include <nanobind/stl/string.h>

#include "common.hpp"

namespace moebius::python {

namespace {

// moebius.Error, created once at import; the translator fills .code/.file/.line.
nb::handle error_type;

}  // namespace

void bind_errors(nb::module_& m) {
  // One exception type for every moebius::error. It derives from RuntimeError so callers that
  // catch RuntimeError keep working; `.code` says which errc (a string: "capacity", ...).
  nb::object type = nb::steal(PyErr_NewExceptionWithDoc(
      "moebius.Error",
      "A failure inside Moebius (moebius::error in C++).\n\n"
      "Attributes:\n"
      "  code: the C++ errc as a string: 'invalid_argument', 'overflow', 'out_of_range',\n"
      "        'capacity', 'cuda', 'nccl', 'timeout', 'injected_fault' or 'internal'.\n"
      "  message: the message naming the broken constraint and its values.\n"
      "  file, line: where in the C++ source it was raised.",
      PyExc_RuntimeError, nullptr));
  if (!type.is_valid()) throw nb::python_error();
  m.attr("Error") = type;
  error_type = type.release();  // lives as long as the interpreter (module attribute)

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const error& e) {
      nb::object exc = nb::handle(error_type)(nb::str(e.what()));
      exc.attr("code") = nb::str(to_string(e.code()));
      exc.attr("message") = nb::str(e.what());
      exc.attr("file") = nb::str(e.file() ? e.file() : "");
      exc.attr("line") = e.line();
      PyErr_SetObject(error_type.ptr(), exc.ptr());
    }
  });

  m.attr("error_codes") =
      nb::make_tuple("invalid_argument", "overflow", "out_of_range", "capacity", "cuda", "nccl",
                     "timeout", "injected_fault", "internal");

  // Raises moebius.Error with `code` from C++, so tests can check the translation of codes no
  // CPU path reaches (cuda, nccl, timeout, internal).
  m.def(
      "_raise_error",
      [](const std::string& code, const std::string& message) {
        for (int c = static_cast<int>(errc::invalid_argument);
             c <= static_cast<int>(errc::internal); ++c) {
          if (code == to_string(static_cast<errc>(c))) {
            MOEBIUS_FAIL(static_cast<errc>(c), message);
          }
        }
        MOEBIUS_FAIL(errc::invalid_argument, "unknown error code '", code, "'");
      },
      nb::arg("code"), nb::arg("message"), "Test hook: raise moebius.Error with `code`.");
}

}  // namespace moebius::python

NB_MODULE(_moebius, m) {
  using namespace moebius::python;
  m.doc() =
      "Moebius: live TP<->EP switching of MoE expert weights and paged KV cache.\n\n"
      "The C++ API, bound with nanobind. Memory comes in as DLPack tensors (numpy, torch, any\n"
      "object with __dlpack__) or (pointer, bytes, device) tuples; views come out as DLPack\n"
      "tensors at fixed addresses; streams are integers (cudaStream_t values).";
  m.attr("with_cuda") = bool(MOEBIUS_WITH_CUDA);
  m.attr("with_nccl") = bool(MOEBIUS_WITH_NCCL);
  bind_errors(m);
  bind_layout(m);
  bind_plan(m);
  bind_kv(m);
  bind_memory(m);
  bind_transport(m);
  bind_cuda(m);
  bind_switch(m);
  bind_policy(m);
  bind_kv_csr(m);
  bind_observer(m);
  bind_nccl(m);
}
