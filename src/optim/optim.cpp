// Public entry points of the optimizer family: argument checks over the tensor lists, then
// dispatch on where the tensors live (CPU reference or CUDA kernels).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/format.h"
#include "core/validate.h"
#include "fusekit/optim.h"
#include "fusekit/runtime.h"
#include "optim/optim_params.h"
#include "optim/optim_plan.h"

namespace fusekit {

using detail::ArgCheck;

namespace {

constexpr std::initializer_list<DType> kLowPrecisionDtypes = {DType::f32, DType::f16, DType::bf16};

// One tensor of the call, named as the messages name it ("grads[3]").
struct Named {
  std::string name;
  const TensorView* view;
  bool written;  // updated in place or written by the op
};

std::string element_name(const char* list, std::size_t i) {
  return std::string(list) + "[" + std::to_string(i) + "]";
}

// Every tensor well formed, on one device (the first one's), contiguous, non-null where non-empty
// and within the launches' size limit. Returns the device (CPU for an empty call).
Device check_tensors(const ArgCheck& check, const std::vector<Named>& all) {
  const Named* first = nullptr;
  for (const Named& t : all) {
    const char* name = t.name.c_str();
    check.well_formed(*t.view, name);
    check.has_data(*t.view, name);
    if (!t.view->is_contiguous())
      check.fail(name, "a contiguous tensor",
                 "shape " + t.view->shape_string() + " with strides " + t.view->strides_string());
    if (t.view->numel() > optim::kMaxTensorElements)
      check.fail(name, "at most 2^44 elements", std::to_string(t.view->numel()));
    if (!first) {
      first = &t;
    } else if (!(t.view->device == first->view->device)) {
      check.fail(name,
                 "a tensor on " + to_string(first->view->device) + " (where '" + first->name + "' is)",
                 "a tensor on " + to_string(t.view->device));
    }
  }
  return first ? first->view->device : Device::cpu();
}

// No written tensor shares a byte with any other tensor of the call (reads may share with
// reads). Contiguous views cover exactly [data, data + bytes), so one sweep over the spans
// sorted by start finds every overlapping pair that involves a written tensor.
void check_no_overlap(const ArgCheck& check, const std::vector<Named>& all) {
  struct Span {
    std::uintptr_t begin, end;
    const Named* t;
  };
  std::vector<Span> spans;
  for (const Named& t : all) {
    const std::int64_t n = t.view->numel();
    if (n == 0) continue;
    const auto begin = reinterpret_cast<std::uintptr_t>(t.view->data);
    spans.push_back({begin, begin + static_cast<std::uintptr_t>(n) * dtype_size(t.view->dtype), &t});
  }
  std::stable_sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  const Span* furthest_any = nullptr;      // the span seen so far reaching furthest
  const Span* furthest_written = nullptr;  // the same among written tensors
  for (const Span& s : spans) {
    const Span* clash = nullptr;
    if (s.t->written && furthest_any && s.begin < furthest_any->end) clash = furthest_any;
    else if (furthest_written && s.begin < furthest_written->end) clash = furthest_written;
    if (clash) {
      const Named& out = clash->t->written ? *clash->t : *s.t;
      const Named& other = clash->t->written ? *s.t : *clash->t;
      check.fail(out.name.c_str(), "memory that does not overlap '" + other.name + "'",
                 "a view sharing bytes with '" + other.name + "'");
    }
    if (!furthest_any || s.end > furthest_any->end) furthest_any = &s;
    if (s.t->written && (!furthest_written || s.end > furthest_written->end)) furthest_written = &s;
  }
}

void check_same_shape(const ArgCheck& check, const Named& t, const Named& ref) {
  bool same = t.view->ndim == ref.view->ndim;
  for (int d = 0; same && d < ref.view->ndim; ++d) same = t.view->shape[d] == ref.view->shape[d];
  if (!same)
    check.fail(t.name.c_str(), "shape " + ref.view->shape_string() + " (as '" + ref.name + "')",
               t.view->shape_string());
}

void check_dtype(const ArgCheck& check, const Named& t, std::initializer_list<DType> allowed) {
  check.dtype_in(*t.view, t.name.c_str(), allowed);
}

std::vector<Named> named_list(const char* list, TensorList views, bool written) {
  std::vector<Named> out;
  for (std::size_t i = 0; i < views.size(); ++i) out.push_back({element_name(list, i), &views[i], written});
  return out;
}

std::vector<std::int64_t> numels_of(TensorList tensors) {
  std::vector<std::int64_t> n;
  for (const TensorView& t : tensors) n.push_back(t.numel());
  return n;
}

void check_length(const ArgCheck& check, const char* list, std::size_t got, std::size_t expected) {
  if (got != expected)
    check.fail(list, std::to_string(expected) + " tensors (as 'params')", std::to_string(got) + " tensors");
}

// A float field of the config: finite and in [lo, hi) (hi_open) or [lo, hi], or > lo (lo_open).
void check_range(const ArgCheck& check, const char* field, float v, bool finite, bool lo_open,
                 double lo, const char* expected) {
  const bool ok = !std::isnan(v) && (!finite || std::isfinite(v)) && (lo_open ? v > lo : v >= lo);
  if (!ok) check.fail(field, expected, detail::format_float(v));
}

optim::AdamWScalars check_config(const ArgCheck& check, const AdamWConfig& c) {
  check_range(check, "lr", c.lr, true, false, 0.0, "a finite learning rate >= 0");
  for (auto [name, beta] : {std::pair{"beta1", c.beta1}, std::pair{"beta2", c.beta2}})
    if (!(beta >= 0.0f && beta < 1.0f)) check.fail(name, "a value in [0, 1)", detail::format_float(beta));
  check_range(check, "eps", c.eps, true, true, 0.0, "a finite eps > 0");
  check_range(check, "weight_decay", c.weight_decay, true, false, 0.0, "a finite weight decay >= 0");
  if (c.step < 1) check.fail("step", "a 1-based step count >= 1", std::to_string(c.step));
  check_range(check, "max_grad_norm", c.max_grad_norm, true, false, 0.0,
              "a finite max_grad_norm >= 0 (0: no clipping)");
  optim::AdamWScalars s;
  s.lr = c.lr;
  s.beta1 = c.beta1;
  s.beta2 = c.beta2;
  s.eps = c.eps;
  s.weight_decay = c.weight_decay;
  s.bias_correction1 = 1.0 - std::pow(static_cast<double>(c.beta1), static_cast<double>(c.step));
  s.bias_correction2 = 1.0 - std::pow(static_cast<double>(c.beta2), static_cast<double>(c.step));
  s.max_grad_norm = c.max_grad_norm;
  return s;
}

}  // namespace

std::size_t global_norm_workspace_size(TensorList tensors, Device device) {
  const ArgCheck check("global_norm_workspace_size");
  const std::vector<Named> all = named_list("tensors", tensors, false);
  for (const Named& t : all) {
    check.well_formed(*t.view, t.name.c_str());
    check_dtype(check, t, kLowPrecisionDtypes);
    if (t.view->numel() > optim::kMaxTensorElements)
      check.fail(t.name.c_str(), "at most 2^44 elements", std::to_string(t.view->numel()));
  }
  if (!device.is_cuda()) return 0;
  const std::vector<std::int64_t> numels = numels_of(tensors);
  return static_cast<std::size_t>(optim::norm_partial_count(numels)) * sizeof(float);
}

void global_norm(TensorList tensors, const TensorView& norm,
                 const OptionalTensor& workspace, Stream stream) {
  ArgCheck check("global_norm");
  std::vector<Named> all = named_list("tensors", tensors, false);
  all.push_back({"norm", &norm, true});
  if (workspace) all.push_back({"workspace", &*workspace, true});
  const Device device = check_tensors(check, all);
  for (std::size_t i = 0; i < tensors.size(); ++i) check_dtype(check, all[i], kLowPrecisionDtypes);
  check.dtype_is(norm, "norm", DType::f32, "the norm is one float32");
  check.contiguous_numel(norm, "norm", 1);
  check_no_overlap(check, all);

  optim::NormParams p;
  for (const TensorView& t : tensors) p.tensors.push_back({t.data, t.dtype, t.numel()});
  p.norm = static_cast<float*>(norm.data);
  if (device.is_cuda()) {
    require_supported_gpu(check.op(), device.index);
    const std::size_t need = global_norm_workspace_size(tensors, device);
    if (need > 0) {
      const detail::Workspace ws = check.workspace(workspace, need, "global_norm_workspace_size", 16);
      p.workspace = ws.data;
      p.workspace_bytes = ws.bytes;
    }
    optim::global_norm_cuda(p, device.index, stream);
  } else {
    optim::global_norm_cpu(p);
  }
}

void adamw_step(TensorList params, TensorList grads,
                TensorList exp_avg, TensorList exp_avg_sq,
                TensorList param_copies, const AdamWConfig& config,
                const OptionalTensor& grad_norm, Stream stream) {
  ArgCheck check("adamw_step");
  const std::size_t n = params.size();
  check_length(check, "grads", grads.size(), n);
  check_length(check, "exp_avg", exp_avg.size(), n);
  check_length(check, "exp_avg_sq", exp_avg_sq.size(), n);
  if (!param_copies.empty() && param_copies.size() != n)
    check.fail("param_copies", "none or " + std::to_string(n) + " tensors (as 'params')",
               std::to_string(param_copies.size()) + " tensors");

  const std::vector<Named> p_list = named_list("params", params, true);
  const std::vector<Named> g_list = named_list("grads", grads, false);
  const std::vector<Named> m_list = named_list("exp_avg", exp_avg, true);
  const std::vector<Named> v_list = named_list("exp_avg_sq", exp_avg_sq, true);
  const std::vector<Named> c_list = named_list("param_copies", param_copies, true);
  std::vector<Named> all;
  for (const auto* list : {&p_list, &g_list, &m_list, &v_list, &c_list})
    all.insert(all.end(), list->begin(), list->end());
  if (grad_norm) all.push_back({"grad_norm", &*grad_norm, false});
  const Device device = check_tensors(check, all);

  for (std::size_t i = 0; i < n; ++i) {
    check.dtype_is(params[i], p_list[i].name.c_str(), DType::f32, "the float32 master weights");
    check_dtype(check, g_list[i], kLowPrecisionDtypes);
    check.dtype_is(exp_avg[i], m_list[i].name.c_str(), DType::f32, "float32 optimizer state");
    check.dtype_is(exp_avg_sq[i], v_list[i].name.c_str(), DType::f32, "float32 optimizer state");
    check_same_shape(check, g_list[i], p_list[i]);
    check_same_shape(check, m_list[i], p_list[i]);
    check_same_shape(check, v_list[i], p_list[i]);
    if (!param_copies.empty()) {
      check_dtype(check, c_list[i], kLowPrecisionDtypes);
      check_same_shape(check, c_list[i], p_list[i]);
    }
  }
  optim::AdamWParams p;
  p.s = check_config(check, config);
  if (config.max_grad_norm > 0.0f) {
    if (!grad_norm)
      check.fail("grad_norm", "the gradients' norm (one float32) since max_grad_norm > 0", "none");
    check.dtype_is(*grad_norm, "grad_norm", DType::f32, "global_norm's output");
    check.contiguous_numel(*grad_norm, "grad_norm", 1);
    p.grad_norm = static_cast<const float*>(grad_norm->data);
  } else if (grad_norm) {
    check.fail("grad_norm", "none (max_grad_norm is 0: no clipping)", "a tensor");
  }
  check_no_overlap(check, all);

  for (std::size_t i = 0; i < n; ++i) {
    optim::AdamWTensor t;
    t.param = static_cast<float*>(params[i].data);
    t.grad = grads[i].data;
    t.grad_dtype = grads[i].dtype;
    t.exp_avg = static_cast<float*>(exp_avg[i].data);
    t.exp_avg_sq = static_cast<float*>(exp_avg_sq[i].data);
    if (!param_copies.empty()) {
      t.copy = param_copies[i].data;
      t.copy_dtype = param_copies[i].dtype;
    }
    t.numel = params[i].numel();
    if (t.numel > 0) p.tensors.push_back(t);
  }
  if (p.tensors.empty()) return;
  if (device.is_cuda()) {
    require_supported_gpu(check.op(), device.index);
    optim::adamw_step_cuda(p, device.index, stream);
  } else {
    optim::adamw_step_cpu(p);
  }
}

}  // namespace fusekit
