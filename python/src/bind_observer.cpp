// The switch observer (switch/switch_observer.hpp) from Python: one callable, installed by
// moebius/__init__.py at import, that receives every ended switch as a dict and forwards it to
// Python's `logging` and to the listeners an engine adds (moebius.add_switch_listener).

#include <memory>

#include "common.hpp"

namespace moebius::python {
namespace {

// Holds the Python callable inside a std::function. Switches end with the GIL released
// (switch_to, finish and abort release it), so a call takes it. The object is released under
// the GIL, or leaked when the interpreter is already gone (a static destroyed at exit).
struct py_observer {
  std::shared_ptr<nb::object> f;

  explicit py_observer(nb::object callable)
      : f(new nb::object(std::move(callable)), [](nb::object* o) {
          if (!Py_IsInitialized()) return;  // at exit: leak rather than touch a dead interpreter
          nb::gil_scoped_acquire gil;
          delete o;
        }) {}

  void operator()(const switch_event& e) const {
    if (!Py_IsInitialized()) return;
    nb::gil_scoped_acquire gil;
    try {
      nb::dict event;
      event["sequence"] = e.sequence;
      event["style"] = to_string(e.style);
      event["report"] = to_dict(e.report);
      event["metrics"] = metrics_dict(e.report);
      (*f)(event);
    } catch (nb::python_error& err) {
      // Reporting never fails a switch; the engine still sees what went wrong.
      err.discard_as_unraisable("moebius switch observer");
    }
  }
};

}  // namespace

void bind_observer(nb::module_& m) {
  m.def(
      "_set_switch_observer",
      [](nb::object callable) {
        if (callable.is_none()) {
          set_switch_observer({});
        } else {
          set_switch_observer(py_observer(std::move(callable)));
        }
      },
      nb::arg("callable").none(),
      "Installs callable(event: dict) as the process's switch observer (None removes it):\n"
      "event = {sequence, style ('whole'|'progressive'), report (as switch_to returns it),\n"
      "metrics (flat, Prometheus-style names)}. moebius/__init__.py installs its own at import;\n"
      "use moebius.add_switch_listener instead of replacing it.");
}

}  // namespace moebius::python
