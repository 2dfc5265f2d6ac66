// WeightSource: the shared lookup that names the source in its error.
#include "formats/weight_source.h"

#include "core/error.h"

namespace bg {

TensorView WeightSource::get(const std::string& name) const {
  auto v = find(name);
  BG_CHECK(v.has_value(), "{}: missing tensor '{}'", describe(), name);
  return *v;
}

}  // namespace bg
