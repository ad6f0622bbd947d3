#include "tests/gated_act/gated_act_testing.h"

#include <algorithm>

namespace fusekit::testing {

const char* form_name(GatedForm f) {
  switch (f) {
    case GatedForm::halves: return "halves";
    case GatedForm::interleaved: return "interleaved";
    case GatedForm::separate: return "separate";
  }
  return "unknown";
}

std::string GatedCase::str() const {
  return std::string(activation_name(activation)) + " " + form_name(form) + " " + dtype_name(dtype) + " (" +
         std::to_string(rows) + ", " + std::to_string(cols) + ")" + (pad ? " pad " + std::to_string(pad) : "") +
         (shift ? " shift " + std::to_string(shift) : "") + (lead0 > 1 ? " lead " + std::to_string(lead0) : "") +
         (in_place ? " in place" : "");
}

GatedInputs random_gated_inputs(const GatedCase& c, std::mt19937_64& rng) {
  const std::int64_t n = c.rows * c.cols;
  GatedInputs in{std::vector<double>(n), std::vector<double>(n), std::vector<double>(n)};
  constexpr std::int64_t kChunk = std::int64_t(1) << 16;
  for (auto [values, stddev] : {std::pair{&in.gate, 1.5}, std::pair{&in.up, 1.0}, std::pair{&in.dy, 1.0}}) {
    std::vector<double>& v = *values;
    const double sd = stddev;
    parallel_fill((n + kChunk - 1) / kChunk, rng, [&](std::int64_t chunk, std::mt19937_64& chunk_rng) {
      std::normal_distribution<double> dist(0.0, sd);
      const std::int64_t end = std::min(n, (chunk + 1) * kChunk);
      for (std::int64_t i = chunk * kChunk; i < end; ++i) v[i] = dist(chunk_rng);
    });
  }
  return in;
}

GatedTensors::GatedTensors(const GatedCase& c, Device device)
    : c_(c),
      y_(c.dtype, device, c.rows, c.cols, c.shift, c.pad, c.lead0),
      dy_(c.dtype, device, c.rows, c.cols, c.shift, c.pad + 8, c.lead0) {
  if (c.form == GatedForm::separate) {
    gate_.emplace(c.dtype, device, c.rows, c.cols, c.shift, c.pad, c.lead0);
    up_.emplace(c.dtype, device, c.rows, c.cols, c.shift, c.pad + 8, c.lead0);
    if (!c.in_place) {
      dgate_.emplace(c.dtype, device, c.rows, c.cols, c.shift, c.pad + 16, c.lead0);
      dup_.emplace(c.dtype, device, c.rows, c.cols, c.shift, c.pad, c.lead0);
    }
  } else {
    gate_up_.emplace(c.dtype, device, c.rows, 2 * c.cols, c.shift, c.pad, c.lead0);
    if (!c.in_place) dgate_up_.emplace(c.dtype, device, c.rows, 2 * c.cols, c.shift, c.pad, c.lead0);
  }
}

GatedActConfig GatedTensors::config() const {
  GatedActConfig config;
  config.activation = c_.activation;
  config.layout = c_.form == GatedForm::interleaved ? GatedLayout::interleaved : GatedLayout::halves;
  config.in_place_backward = c_.in_place;
  return config;
}

void GatedTensors::set_inputs(const GatedInputs& in) {
  const std::int64_t F = c_.cols;
  if (c_.form == GatedForm::separate) {
    gate_->set_values(in.gate);
    up_->set_values(in.up);
  } else {
    std::vector<double> both(static_cast<std::size_t>(c_.rows * 2 * F));
    const bool interleaved = c_.form == GatedForm::interleaved;
    for (std::int64_t r = 0; r < c_.rows; ++r)
      for (std::int64_t j = 0; j < F; ++j) {
        both[r * 2 * F + (interleaved ? 2 * j : j)] = in.gate[r * F + j];
        both[r * 2 * F + (interleaved ? 2 * j + 1 : F + j)] = in.up[r * F + j];
      }
    gate_up_->set_values(both);
  }
  dy_.set_values(in.dy);
}

void GatedTensors::poison_outputs() {
  y_.poison();
  for (std::optional<Strided>* t : {&dgate_up_, &dgate_, &dup_})
    if (*t) (*t)->poison();
}

void GatedTensors::forward() {
  if (c_.form == GatedForm::separate) gated_act_forward_separate(gate_->view(), up_->view(), config(), y_.view());
  else gated_act_forward(gate_up_->view(), config(), y_.view());
}

void GatedTensors::backward() { backward_with(true, true); }

void GatedTensors::backward_with(bool want_dgate, bool want_dup) {
  if (c_.form != GatedForm::separate) {
    gated_act_backward(dy_.view(), gate_up_->view(), config(), grad_gate_up().view());
    return;
  }
  const OptionalTensor dgate = want_dgate ? OptionalTensor(grad_gate().view()) : std::nullopt;
  const OptionalTensor dup = want_dup ? OptionalTensor(grad_up().view()) : std::nullopt;
  gated_act_backward_separate(dy_.view(), gate_->view(), up_->view(), config(), dgate, dup);
}

Strided& GatedTensors::grad_gate_up() { return c_.in_place ? *gate_up_ : *dgate_up_; }
Strided& GatedTensors::grad_gate() { return c_.in_place ? *gate_ : *dgate_; }
Strided& GatedTensors::grad_up() { return c_.in_place ? *up_ : *dup_; }
const Strided& GatedTensors::grad_gate_up() const { return c_.in_place ? *gate_up_ : *dgate_up_; }
const Strided& GatedTensors::grad_gate() const { return c_.in_place ? *gate_ : *dgate_; }
const Strided& GatedTensors::grad_up() const { return c_.in_place ? *up_ : *dup_; }

std::vector<double> GatedTensors::dgate() const {
  if (c_.form == GatedForm::separate) return grad_gate().values();
  const std::vector<double> both = grad_gate_up().values();
  const std::int64_t F = c_.cols;
  std::vector<double> out(static_cast<std::size_t>(c_.rows * F));
  for (std::int64_t r = 0; r < c_.rows; ++r)
    for (std::int64_t j = 0; j < F; ++j)
      out[r * F + j] = both[r * 2 * F + (c_.form == GatedForm::interleaved ? 2 * j : j)];
  return out;
}

std::vector<double> GatedTensors::dup() const {
  if (c_.form == GatedForm::separate) return grad_up().values();
  const std::vector<double> both = grad_gate_up().values();
  const std::int64_t F = c_.cols;
  std::vector<double> out(static_cast<std::size_t>(c_.rows * F));
  for (std::int64_t r = 0; r < c_.rows; ++r)
    for (std::int64_t j = 0; j < F; ++j)
      out[r * F + j] = both[r * 2 * F + (c_.form == GatedForm::interleaved ? 2 * j + 1 : F + j)];
  return out;
}

std::vector<Strided*> GatedTensors::written() {
  if (c_.form == GatedForm::separate) return {&y_, &grad_gate(), &grad_up()};
  return {&y_, &grad_gate_up()};
}

}  // namespace fusekit::testing
