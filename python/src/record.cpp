// The generic parts of a record (common.hpp): __repr__, __eq__ and as_dict over the names of a
// record type's fields, so that no report is a dict written out by hand.

#include <nanobind/stl/string.h>

#include "common.hpp"

namespace moebius::python {

namespace {

bool is_record(nb::handle value) { return nb::hasattr(value.type(), "__fields__"); }

nb::object plain(nb::handle value) {
  if (is_record(value)) return value.attr("as_dict")();
  if (nb::isinstance<nb::list>(value)) {
    nb::list out;
    for (nb::handle item : value) out.append(plain(item));
    return std::move(out);
  }
  return nb::borrow(value);
}

}  // namespace

std::string record_repr(nb::handle self, const std::vector<const char*>& fields) {
  std::string out = nb::cast<std::string>(nb::handle(self.type()).attr("__name__")) + "(";
  for (size_t i = 0; i < fields.size(); ++i) {
    if (i) out += ", ";
    out += fields[i];
    out += "=";
    out += nb::cast<std::string>(nb::repr(self.attr(fields[i])));
  }
  return out + ")";
}

nb::object record_eq(nb::handle self, nb::handle other, const std::vector<const char*>& fields) {
  if (!other.type().is(self.type())) return nb::borrow(Py_NotImplemented);
  for (const char* f : fields) {
    if (!self.attr(f).equal(other.attr(f))) return nb::borrow(Py_False);
  }
  return nb::borrow(Py_True);
}

nb::dict record_as_dict(nb::handle self, const std::vector<const char*>& fields) {
  nb::dict out;
  for (const char* f : fields) out[f] = plain(self.attr(f));
  return out;
}

}  // namespace moebius::python
