// The switch observer (switch/switch_observer.hpp) from Python: one callable, installed by
// moebius/__init__.py at import, that receives every ended switch as a SwitchEvent and forwards
// it to Python's `logging` and to the listeners an engine adds (moebius.add_switch_listener).

#include <memory>

#include "common.hpp"

namespace moebius::python {
namespace {

// switch_event with its report copied: switch_event holds a reference valid during the call
// only, and a listener may keep the event.
struct py_switch_event {
  int64_t sequence = 0;
  switch_style style = switch_style::whole;
  switch_report report;
};

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
      (*f)(py_switch_event{e.sequence, e.style, e.report});
    } catch (nb::python_error& err) {
      // Reporting never fails a switch; the engine still sees what went wrong.
      err.discard_as_unraisable("moebius switch observer");
    }
  }
};

}  // namespace

void bind_observer(nb::module_& m) {
  record<py_switch_event> event(
      m, "SwitchEvent",
      "One ended switch, as the observer hands it to moebius.add_switch_listener callbacks.");
  event.field("sequence", &py_switch_event::sequence,
              "1, 2, ... per process in the order switches ended: a log's switch id")
      .field("style", &py_switch_event::style, "a SwitchStyle: whole or progressive")
      .field("report", &py_switch_event::report,
             "the SwitchReport (switch_to's); report.metrics are the flat metrics")
      .done();

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
      "Installs callable(event: SwitchEvent) as the process's switch observer (None removes\n"
      "it). moebius/__init__.py installs its own at import; use moebius.add_switch_listener\n"
      "instead of replacing it.");
}

}  // namespace moebius::python
