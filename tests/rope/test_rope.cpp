// Rotary embeddings: the CPU reference against the documented definition (a complex product per
// pair, the float32 angle), its algebra (the backward is the transpose, the three angle sources
// agree, positions given, implicit and packed agree, layouts and in-place calls change nothing),
// the argument errors, and the CUDA kernel against the CPU reference over random problems (both
// styles, partial rotary, positions, permuted and padded layouts, misaligned views, GQA, in
// place, every dtype and access width, poisoned outputs).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <complex>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/convert.h"
#include "core/overrides.h"
#include "fusekit/error.h"
#include "fusekit/rope.h"
#include "tests/harness/gtest_helpers.h"

namespace fusekit {
namespace {

using testing::Buffer;
using testing::close_to_reference;
using testing::error_of;

// ---- test tensors with any layout -------------------------------------------------------------

// Where a q/k-like operand lives: (B, S, H, D) storage, or (B, H, S, D) storage seen through the
// permuted view; each head row padded to D + pad elements, the view starting `shift` elements into
// it (a shift that is not a multiple of 16 bytes misaligns the pointer).
struct Layout {
  bool bhsd = false;
  std::int64_t pad = 0, shift = 0;
  std::string str() const {
    return std::string(bhsd ? "bhsd" : "bshd") + (pad ? " pad " + std::to_string(pad) : "") +
           (shift ? " shift " + std::to_string(shift) : "");
  }
};

// A (B, S, H, D) operand (3-D (S, H, D) when `packed`, with B = 1) over a contiguous storage
// buffer of the layout; the elements outside the view are never written by the op.
class Operand {
 public:
  Operand(DType dtype, Device device, std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t d, bool packed,
          const Layout& layout)
      : b_(b), s_(s), h_(h), d_(d), packed_(packed), layout_(layout),
        storage_(dtype, device, layout.bhsd ? std::vector<std::int64_t>{b, h, s, d + layout.pad}
                                            : std::vector<std::int64_t>{b, s, h, d + layout.pad}) {}

  TensorView view() const {
    const TensorView whole = storage_.view();
    const std::int64_t row = d_ + layout_.pad;
    const std::int64_t bs = s_ * h_ * row;
    const std::int64_t ss = layout_.bhsd ? row : h_ * row, hs = layout_.bhsd ? s_ * row : row;
    void* data = static_cast<unsigned char*>(whole.data) + layout_.shift * static_cast<std::int64_t>(dtype_size(whole.dtype));
    if (packed_) return TensorView(data, whole.dtype, whole.device, {s_, h_, d_}, {ss, hs, 1});
    return TensorView(data, whole.dtype, whole.device, {b_, s_, h_, d_}, {bs, ss, hs, 1});
  }
  // Logical (B, S, H, D) elements, row-major.
  std::vector<double> values() const {
    const std::vector<double> all = storage_.values();
    std::vector<double> v(static_cast<std::size_t>(b_ * s_ * h_ * d_));
    for_each([&](std::int64_t logical, std::int64_t stored) { v[logical] = all[stored]; });
    return v;
  }
  void set_values(const std::vector<double>& v) {
    std::vector<double> all = storage_.values();
    for_each([&](std::int64_t logical, std::int64_t stored) { all[stored] = v[logical]; });
    storage_.set_values(all);
  }
  void poison() { storage_.poison(); }
  // Elements of the storage outside the view that still hold the poison (NaN).
  std::int64_t poisoned_outside() const {
    const std::vector<double> all = storage_.values();
    std::vector<bool> inside(all.size(), false);
    for_each([&](std::int64_t, std::int64_t stored) { inside[stored] = true; });
    std::int64_t n = 0;
    for (std::size_t i = 0; i < all.size(); ++i) n += !inside[i] && std::isnan(all[i]);
    return n;
  }
  std::int64_t outside() const { return storage_.numel() - b_ * s_ * h_ * d_; }

 private:
  template <typename F>
  void for_each(F&& f) const {
    const std::int64_t row = d_ + layout_.pad;
    for (std::int64_t b = 0; b < b_; ++b)
      for (std::int64_t s = 0; s < s_; ++s)
        for (std::int64_t h = 0; h < h_; ++h) {
          const std::int64_t stored_row = layout_.bhsd ? (b * h_ + h) * s_ + s : (b * s_ + s) * h_ + h;
          for (std::int64_t j = 0; j < d_; ++j)
            f(((b * s_ + s) * h_ + h) * d_ + j, stored_row * row + layout_.shift + j);
        }
  }

  std::int64_t b_, s_, h_, d_;
  bool packed_;
  Layout layout_;
  Buffer storage_;
};

// ---- one problem ------------------------------------------------------------------------------

enum class Positions { implicit, ids, shared_ids, packed };  // shared: (1, S); packed: (T) restarting
enum class Source { theta, inv_freq, cos_sin };

const char* positions_name(Positions p) {
  switch (p) {
    case Positions::implicit: return "implicit";
    case Positions::ids: return "ids (B, S)";
    case Positions::shared_ids: return "ids (1, S)";
    case Positions::packed: return "packed ids (T)";
  }
  return "?";
}
const char* source_name(Source s) {
  return s == Source::theta ? "theta" : s == Source::inv_freq ? "inv_freq" : "cos/sin";
}

struct Case {
  DType dtype = DType::bf16;
  std::int64_t b = 2, s = 5, hq = 4, hk = 2, d = 64;
  bool with_k = true;
  Positions positions = Positions::implicit;
  DType position_dtype = DType::i64;
  std::int64_t max_position = 0;  // ids drawn in [0, max_position] (0: the sequence length)
  Source source = Source::theta;
  RopeConfig config;
  Layout q_layout, k_layout, q_out_layout, k_out_layout;
  bool in_place = false;
  std::string str() const {
    return std::string(dtype_name(dtype)) + " " + rope_style_name(config.style) + " B=" + std::to_string(b) +
           " S=" + std::to_string(s) + " Hq=" + std::to_string(hq) + " Hk=" + (with_k ? std::to_string(hk) : "-") +
           " D=" + std::to_string(d) + " r=" + std::to_string(config.rotary_dim) + " " + positions_name(positions) +
           " " + dtype_name(position_dtype) + " " + source_name(source) + " m=" +
           std::to_string(config.attention_scaling) + " q " + q_layout.str() + " / out " + q_out_layout.str() +
           " k " + k_layout.str() + " / out " + k_out_layout.str() + (in_place ? " in place" : "");
  }
  bool packed() const { return positions == Positions::packed; }
  std::int64_t half() const { return (config.rotary_dim ? config.rotary_dim : d) / 2; }
};

// Every tensor of one case on one device.
struct Problem {
  Case c;
  Operand q, q_out;
  std::optional<Operand> k, k_out;
  std::optional<Buffer> ids, inv_freq, cos, sin;

  Problem(const Case& c_, Device dev)
      : c(c_), q(c.dtype, dev, c.b, c.s, c.hq, c.d, c.packed(), c.q_layout),
        q_out(c.dtype, dev, c.b, c.s, c.hq, c.d, c.packed(), c.in_place ? c.q_layout : c.q_out_layout) {
    if (c.with_k) {
      k.emplace(c.dtype, dev, c.b, c.s, c.hk, c.d, c.packed(), c.k_layout);
      k_out.emplace(c.dtype, dev, c.b, c.s, c.hk, c.d, c.packed(), c.in_place ? c.k_layout : c.k_out_layout);
    }
    switch (c.positions) {
      case Positions::implicit: break;
      case Positions::ids: ids.emplace(c.position_dtype, dev, std::vector<std::int64_t>{c.b, c.s}); break;
      case Positions::shared_ids: ids.emplace(c.position_dtype, dev, std::vector<std::int64_t>{1, c.s}); break;
      case Positions::packed: ids.emplace(c.position_dtype, dev, std::vector<std::int64_t>{c.s}); break;
    }
    if (c.source == Source::inv_freq) inv_freq.emplace(DType::f32, dev, std::vector<std::int64_t>{c.half()});
    if (c.source == Source::cos_sin) {
      const std::int64_t rows = table_rows();
      cos.emplace(DType::f32, dev, std::vector<std::int64_t>{rows, c.half()});
      sin.emplace(DType::f32, dev, std::vector<std::int64_t>{rows, c.half()});
    }
  }
  std::int64_t max_position() const { return c.max_position > 0 ? c.max_position : c.s; }
  // Rows for every position: the ids' range and, for implicit positions, the sequence.
  std::int64_t table_rows() const { return std::max(max_position(), c.s) + 1; }

  RopeTables tables() const {
    RopeTables t;
    if (inv_freq) t.inv_freq = inv_freq->view();
    if (cos) t.cos = cos->view(), t.sin = sin->view();
    return t;
  }
  OptionalTensor ids_view() const { return ids ? OptionalTensor(ids->view()) : std::nullopt; }
  OptionalTensor k_view() const { return k ? OptionalTensor(k->view()) : std::nullopt; }
  // In place: the outputs are the inputs' own views.
  TensorView q_out_view() const { return c.in_place ? q.view() : q_out.view(); }
  OptionalTensor k_out_view() const {
    if (!k) return std::nullopt;
    return c.in_place ? k->view() : k_out->view();
  }
  void forward() { rope_forward(q.view(), k_view(), ids_view(), c.config, q_out_view(), k_out_view(), tables()); }
  void backward() { rope_backward(q.view(), k_view(), ids_view(), c.config, q_out_view(), k_out_view(), tables()); }
  void poison_outputs() {
    if (c.in_place) return;
    q_out.poison();
    if (k_out) k_out->poison();
  }
  // The results (the inputs' storage when in place).
  std::vector<double> q_result() const { return c.in_place ? q.values() : q_out.values(); }
  std::vector<double> k_result() const { return c.in_place ? k->values() : k_out->values(); }
};

// Fresh inputs: q, k ~ N(0, 1); ids (packed: positions restarting at random sequence starts);
// inv_freq a NTK-like table; cos / sin of random angles.
void fill_inputs(Problem& p, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  auto normals = [&](std::int64_t n) {
    std::vector<double> v(static_cast<std::size_t>(n));
    for (auto& x : v) x = normal(rng);
    return v;
  };
  p.q.set_values(normals(p.c.b * p.c.s * p.c.hq * p.c.d));
  if (p.k) p.k->set_values(normals(p.c.b * p.c.s * p.c.hk * p.c.d));
  if (p.ids) {
    std::vector<double> v(static_cast<std::size_t>(p.ids->numel()));
    if (p.c.positions == Positions::packed) {
      std::int64_t position = 0;
      for (auto& x : v) {
        if (rng() % 7 == 0) position = 0;  // a new sequence starts
        x = static_cast<double>(std::min(position++, p.max_position()));
      }
    } else {
      for (auto& x : v) x = static_cast<double>(rng() % static_cast<std::uint64_t>(p.max_position() + 1));
    }
    p.ids->set_values(v);
  }
  if (p.inv_freq) {
    std::vector<double> v(static_cast<std::size_t>(p.c.half()));
    for (std::size_t i = 0; i < v.size(); ++i)
      v[i] = std::pow(500000.0 * 4.0, -2.0 * static_cast<double>(i) / (2.0 * static_cast<double>(v.size())));
    p.inv_freq->set_values(v);
  }
  if (p.cos) {
    std::vector<double> c(static_cast<std::size_t>(p.cos->numel())), s(c.size());
    std::uniform_real_distribution<double> angle(-100.0, 100.0);
    for (std::size_t i = 0; i < c.size(); ++i) {
      const double a = angle(rng);
      c[i] = std::cos(a), s[i] = std::sin(a);
    }
    p.cos->set_values(c);
    p.sin->set_values(s);
  }
}

void copy_inputs(const Problem& from, Problem& to) {
  to.q.set_values(from.q.values());
  if (from.k) to.k->set_values(from.k->values());
  if (from.ids) to.ids->set_values(from.ids->values());
  if (from.inv_freq) to.inv_freq->set_values(from.inv_freq->values());
  if (from.cos) to.cos->set_values(from.cos->values()), to.sin->set_values(from.sin->values());
}

// The case on the CPU with plain layouts, out of place: the reference.
Case reference_case(Case c) {
  c.q_layout = c.k_layout = c.q_out_layout = c.k_out_layout = Layout{};
  c.in_place = false;
  return c;
}

// ---- the documented definition, written independently of the reference ----------------------

// out for one case from its inputs: pairs as complex numbers times m e^{+-i a}.
void definition(const Problem& p, bool backward, std::vector<double>& q_ref, std::vector<double>& k_ref) {
  const Case& c = p.c;
  const std::int64_t r = c.config.rotary_dim ? c.config.rotary_dim : c.d, half = r / 2;
  const std::vector<double> ids = p.ids ? p.ids->values() : std::vector<double>{};
  const std::vector<double> invf = p.inv_freq ? p.inv_freq->values() : std::vector<double>{};
  const std::vector<double> cosv = p.cos ? p.cos->values() : std::vector<double>{};
  const std::vector<double> sinv = p.sin ? p.sin->values() : std::vector<double>{};
  auto rotate = [&](const std::vector<double>& in, std::int64_t heads) {
    std::vector<double> out = in;
    for (std::int64_t b = 0; b < c.b; ++b)
      for (std::int64_t s = 0; s < c.s; ++s) {
        std::int64_t pos = s;
        if (c.positions == Positions::ids || c.positions == Positions::packed)
          pos = static_cast<std::int64_t>(ids[b * c.s + s]);
        if (c.positions == Positions::shared_ids) pos = static_cast<std::int64_t>(ids[s]);
        for (std::int64_t h = 0; h < heads; ++h)
          for (std::int64_t i = 0; i < half; ++i) {
            std::complex<double> e;
            if (c.source == Source::cos_sin) {
              e = {cosv[pos * half + i], sinv[pos * half + i]};
            } else {
              const float f = c.source == Source::inv_freq
                                  ? static_cast<float>(invf[i])
                                  : static_cast<float>(std::pow(static_cast<double>(c.config.theta), -2.0 * i / r) /
                                                       c.config.linear_scaling);
              const float angle = static_cast<float>(pos) * f;  // the float32 angle
              e = std::polar(1.0, static_cast<double>(angle));
            }
            e *= static_cast<double>(c.config.attention_scaling);
            if (backward) e = std::conj(e);
            const std::int64_t base = ((b * c.s + s) * heads + h) * c.d;
            const std::int64_t first = c.config.style == RopeStyle::rotate_half ? i : 2 * i;
            const std::int64_t second = c.config.style == RopeStyle::rotate_half ? i + half : 2 * i + 1;
            const std::complex<double> z = std::complex<double>(in[base + first], in[base + second]) * e;
            out[base + first] = z.real();
            out[base + second] = z.imag();
          }
      }
    return out;
  };
  q_ref = rotate(p.q.values(), c.hq);
  if (p.k) k_ref = rotate(p.k->values(), c.hk);
}

// Values rounded through float32 and then the dtype, as the op stores them.
std::vector<double> rounded(const std::vector<double>& v, DType dtype) {
  std::vector<double> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = detail::round_to(dtype, v[i]);
  return out;
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

// ---- CPU reference ----------------------------------------------------------------------------

TEST(RopeCpu, FollowsTheDefinition) {
  auto rng = testing::make_rng(1);
  int salt = 0;
  for (RopeStyle style : {RopeStyle::rotate_half, RopeStyle::interleaved})
    for (Source source : {Source::theta, Source::inv_freq, Source::cos_sin})
      for (Positions positions : {Positions::implicit, Positions::ids, Positions::shared_ids, Positions::packed})
        for (std::int64_t r : {0, 6}) {
          Case c;
          c.dtype = DType::f32;
          c.b = positions == Positions::packed ? 1 : 3;
          c.s = 9, c.hq = 3, c.hk = 2, c.d = 10;
          c.positions = positions;
          c.position_dtype = salt % 2 ? DType::i32 : DType::i64;
          // Formed angles up to 7e4 rad, where their float32 rounding matters; small tables.
          c.max_position = source == Source::cos_sin ? 60 : 70000;
          c.source = source;
          c.config.style = style;
          c.config.rotary_dim = r;
          c.config.theta = 10000.0f;
          c.config.linear_scaling = source == Source::theta && salt % 3 == 0 ? 4.0f : 1.0f;
          c.config.attention_scaling = salt % 4 == 0 ? 1.25f : 1.0f;
          SCOPED_TRACE(c.str());
          ++salt;
          Problem p(c, Device::cpu());
          fill_inputs(p, rng);
          for (bool backward : {false, true}) {
            p.poison_outputs();
            backward ? p.backward() : p.forward();
            std::vector<double> q_ref, k_ref;
            definition(p, backward, q_ref, k_ref);
            EXPECT_LE(max_abs_diff(p.q_result(), rounded(q_ref, c.dtype)), 1e-6) << (backward ? "dq" : "q_out");
            EXPECT_LE(max_abs_diff(p.k_result(), rounded(k_ref, c.dtype)), 1e-6) << (backward ? "dk" : "k_out");
          }
        }
}

TEST(RopeCpu, BackwardIsTheTransposeAndUndoesTheForward) {
  auto rng = testing::make_rng(2);
  for (RopeStyle style : {RopeStyle::rotate_half, RopeStyle::interleaved}) {
    Case c;
    c.dtype = DType::f32;
    c.b = 2, c.s = 7, c.hq = 3, c.hk = 1, c.d = 16;
    c.config.style = style;
    c.config.rotary_dim = 12;
    c.positions = Positions::ids;
    c.max_position = 5000;
    SCOPED_TRACE(c.str());
    Problem x(c, Device::cpu()), y(c, Device::cpu());
    fill_inputs(x, rng);
    fill_inputs(y, rng);
    y.ids->set_values(x.ids->values());
    // <R x, y> = <x, R^T y>
    x.forward();
    y.backward();
    auto dot = [](const std::vector<double>& a, const std::vector<double>& b) {
      double s = 0;
      for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
      return s;
    };
    const double lhs = dot(x.q_out.values(), y.q.values()) + dot(x.k_out->values(), y.k->values());
    const double rhs = dot(x.q.values(), y.q_out.values()) + dot(x.k->values(), y.k_out->values());
    EXPECT_NEAR(lhs, rhs, 1e-4 * std::abs(lhs) + 1e-4);
    // R^T R x = x (m = 1).
    Problem back(c, Device::cpu());
    back.q.set_values(x.q_out.values());
    back.k->set_values(x.k_out->values());
    back.ids->set_values(x.ids->values());
    back.backward();
    EXPECT_LE(max_abs_diff(back.q_out.values(), x.q.values()), 1e-5);
    EXPECT_LE(max_abs_diff(back.k_out->values(), x.k->values()), 1e-5);
  }
}

TEST(RopeCpu, AngleSourcesAgree) {
  // theta, the same inv_freq as a table (bitwise the same angles), and cos / sin tables of those
  // angles (the same up to float32 tables).
  auto rng = testing::make_rng(3);
  for (RopeStyle style : {RopeStyle::rotate_half, RopeStyle::interleaved}) {
    Case c;
    c.dtype = DType::f32;
    c.b = 2, c.s = 11, c.hq = 2, c.hk = 2, c.d = 32;
    c.config.style = style;
    c.config.theta = 500000.0f;
    c.config.linear_scaling = 8.0f;
    c.positions = Positions::ids;
    c.max_position = 40000;
    Problem theta(c, Device::cpu());
    fill_inputs(theta, rng);
    theta.forward();
    const std::int64_t half = c.half();
    std::vector<double> inv(half);
    for (std::int64_t i = 0; i < half; ++i)
      inv[i] = static_cast<float>(std::pow(500000.0, -2.0 * i / (2.0 * half)) / 8.0);
    Case ct = c;
    ct.source = Source::inv_freq;
    ct.config.linear_scaling = 1.0f;
    Problem table(ct, Device::cpu());
    copy_inputs(theta, table);
    table.inv_freq->set_values(inv);
    table.forward();
    EXPECT_EQ(table.q_out.values(), theta.q_out.values());
    EXPECT_EQ(table.k_out->values(), theta.k_out->values());
    Case cc = ct;
    cc.source = Source::cos_sin;
    Problem cs(cc, Device::cpu());
    copy_inputs(theta, cs);
    std::vector<double> cv(cs.cos->numel()), sv(cv.size());
    for (std::int64_t p = 0; p < cs.table_rows(); ++p)
      for (std::int64_t i = 0; i < half; ++i) {
        const float a = static_cast<float>(p) * static_cast<float>(inv[i]);
        cv[p * half + i] = std::cos(static_cast<double>(a));
        sv[p * half + i] = std::sin(static_cast<double>(a));
      }
    cs.cos->set_values(cv);
    cs.sin->set_values(sv);
    cs.forward();
    EXPECT_TRUE(close_to_reference(cs.q_out.values(), theta.q_out.values(), DType::f32, "q_out from cos/sin"));
    EXPECT_TRUE(close_to_reference(cs.k_out->values(), theta.k_out->values(), DType::f32, "k_out from cos/sin"));
  }
}

TEST(RopeCpu, PositionsImplicitGivenSharedAndPackedAgree) {
  auto rng = testing::make_rng(4);
  Case c;
  c.dtype = DType::bf16;
  c.b = 3, c.s = 6, c.hq = 4, c.hk = 2, c.d = 16;
  Problem implicit(c, Device::cpu());
  fill_inputs(implicit, rng);
  implicit.forward();
  // Explicit 0 .. S - 1 per batch, as (B, S) and as (1, S), int32 and int64.
  for (Positions positions : {Positions::ids, Positions::shared_ids})
    for (DType dt : {DType::i32, DType::i64}) {
      Case ce = c;
      ce.positions = positions;
      ce.position_dtype = dt;
      Problem explicit_ids(ce, Device::cpu());
      copy_inputs(implicit, explicit_ids);
      std::vector<double> ids(explicit_ids.ids->numel());
      for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<double>(i % c.s);
      explicit_ids.ids->set_values(ids);
      explicit_ids.forward();
      EXPECT_EQ(explicit_ids.q_out.values(), implicit.q_out.values()) << positions_name(positions);
      EXPECT_EQ(explicit_ids.k_out->values(), implicit.k_out->values()) << positions_name(positions);
    }
  // The batch packed into one (T, H, D) sequence of tokens whose positions restart per sequence.
  Case cp = c;
  cp.positions = Positions::packed;
  cp.s = c.b * c.s;
  cp.b = 1;
  Problem packed(cp, Device::cpu());
  packed.q.set_values(implicit.q.values());
  packed.k->set_values(implicit.k->values());
  std::vector<double> ids(cp.s);
  for (std::int64_t t = 0; t < cp.s; ++t) ids[t] = static_cast<double>(t % c.s);
  packed.ids->set_values(ids);
  packed.forward();
  EXPECT_EQ(packed.q_out.values(), implicit.q_out.values());
  EXPECT_EQ(packed.k_out->values(), implicit.k_out->values());
}

TEST(RopeCpu, LayoutsAndInPlaceChangeNothing) {
  auto rng = testing::make_rng(5);
  Case c;
  c.dtype = DType::f16;
  c.b = 2, c.s = 5, c.hq = 4, c.hk = 3, c.d = 24;
  c.config.rotary_dim = 16;
  c.positions = Positions::ids;
  Problem plain(c, Device::cpu());
  fill_inputs(plain, rng);
  plain.forward();
  for (bool in_place : {false, true}) {
    Case cl = c;
    cl.q_layout = {true, 8, 3};
    cl.k_layout = {false, 5, 1};
    cl.q_out_layout = {false, 2, 0};
    cl.k_out_layout = {true, 0, 0};
    cl.in_place = in_place;
    SCOPED_TRACE(cl.str());
    Problem strided(cl, Device::cpu());
    copy_inputs(plain, strided);
    strided.poison_outputs();
    strided.forward();
    EXPECT_EQ(strided.q_result(), plain.q_out.values());
    EXPECT_EQ(strided.k_result(), plain.k_out->values());
    if (!in_place) {
      EXPECT_EQ(strided.q_out.poisoned_outside(), strided.q_out.outside());
      EXPECT_EQ(strided.k_out->poisoned_outside(), strided.k_out->outside());
    }
  }
}

TEST(RopeCpu, PartialRotaryPassesDimsThroughAndScalingScalesTheRest) {
  auto rng = testing::make_rng(6);
  for (RopeStyle style : {RopeStyle::rotate_half, RopeStyle::interleaved}) {
    Case c;
    c.dtype = DType::bf16;
    c.b = 1, c.s = 8, c.hq = 2, c.hk = 1, c.d = 20;
    c.config.style = style;
    c.config.rotary_dim = 8;
    c.config.attention_scaling = 2.0f;  // exact in every dtype: the norms of the pairs double
    Problem p(c, Device::cpu());
    fill_inputs(p, rng);
    p.forward();
    const auto in = p.q.values(), out = p.q_out.values();
    const std::int64_t r = 8;
    for (std::int64_t row = 0; row < c.s * c.hq; ++row) {
      for (std::int64_t j = r; j < c.d; ++j) ASSERT_EQ(out[row * c.d + j], in[row * c.d + j]);
      double in_norm = 0, out_norm = 0;
      for (std::int64_t j = 0; j < r; ++j) {
        in_norm += in[row * c.d + j] * in[row * c.d + j];
        out_norm += out[row * c.d + j] * out[row * c.d + j];
      }
      EXPECT_NEAR(std::sqrt(out_norm), 2.0 * std::sqrt(in_norm), 2e-2 * std::sqrt(in_norm));
    }
    // Position 0 is the identity times m.
    for (std::int64_t j = 0; j < r; ++j) ASSERT_EQ(out[j], 2.0 * in[j]);
  }
}

// ---- argument errors (CPU tensors; the checks run before any backend) -------------------------

TEST(RopeErrors, EachBadArgumentIsNamed) {
  const Device cpu = Device::cpu();
  std::vector<float> qb(2 * 3 * 4 * 8, 0.5f), kb(2 * 3 * 2 * 8, 0.5f), qo(qb.size()), ko(kb.size());
  std::vector<std::uint16_t> hb(qb.size());
  std::vector<std::int64_t> ids(6, 1);
  std::vector<float> table(40, 0.5f), table2(40, 0.5f);
  const TensorView q(qb.data(), DType::f32, cpu, {2, 3, 4, 8}), k(kb.data(), DType::f32, cpu, {2, 3, 2, 8});
  const TensorView q_out(qo.data(), DType::f32, cpu, {2, 3, 4, 8}), k_out(ko.data(), DType::f32, cpu, {2, 3, 2, 8});
  const RopeConfig ok;
  const std::string fwd = "fusekit.rope_forward: ", bwd = "fusekit.rope_backward: ";
  auto forward = [&](const TensorView& qv, const OptionalTensor& kv, const OptionalTensor& pos, const RopeConfig& cfg,
                     const TensorView& qov, const OptionalTensor& kov, const RopeTables& t = {}) {
    return error_of([&] { rope_forward(qv, kv, pos, cfg, qov, kov, t); });
  };
  EXPECT_EQ(forward(q, k, std::nullopt, ok, q_out, k_out), "no error");

  // Dtypes and dims of q.
  std::vector<double> qd(qb.size());
  const TensorView q64(qd.data(), DType::f64, cpu, {2, 3, 4, 8});
  EXPECT_EQ(forward(q64, std::nullopt, std::nullopt, ok, q64, std::nullopt),
            fwd + "argument 'q': expected dtype f32, f16 or bf16, got f64");
  EXPECT_EQ(forward(TensorView(qb.data(), DType::f32, cpu, {24, 8}), std::nullopt, std::nullopt, ok, q_out, std::nullopt),
            fwd + "argument 'q': expected 4 dimensions (batch, seq, heads, head_dim) or 3 (tokens, heads, head_dim), "
                  "got 2 dimensions, shape (24, 8)");
  const TensorView q_d1(qb.data(), DType::f32, cpu, {2, 3, 32, 1});
  EXPECT_EQ(forward(q_d1, std::nullopt, std::nullopt, ok, q_d1, std::nullopt),
            fwd + "argument 'q': expected a head dim in 2..512, got 1");
  const TensorView q_strided(qb.data(), DType::f32, cpu, {2, 3, 4, 4}, {96, 32, 8, 2});
  EXPECT_EQ(forward(q_strided, std::nullopt, std::nullopt, ok, TensorView(qo.data(), DType::f32, cpu, {2, 3, 4, 4}),
                    std::nullopt),
            fwd + "argument 'q': expected a contiguous head dim (stride 1), got strides (96, 32, 8, 2)");
  // Config.
  RopeConfig bad = ok;
  bad.rotary_dim = 5;
  EXPECT_EQ(forward(q, k, std::nullopt, bad, q_out, k_out),
            fwd + "argument 'rotary_dim': expected an even rotary dim in 2..head_dim = 8 (0: the whole head dim), got 5");
  bad.rotary_dim = 10;
  EXPECT_NE(forward(q, k, std::nullopt, bad, q_out, k_out).find("argument 'rotary_dim'"), std::string::npos);
  const TensorView q_d7(qb.data(), DType::f32, cpu, {2, 3, 4, 7}), qo_d7(qo.data(), DType::f32, cpu, {2, 3, 4, 7});
  EXPECT_EQ(forward(q_d7, std::nullopt, std::nullopt, ok, qo_d7, std::nullopt),
            fwd + "argument 'rotary_dim': expected an even rotary dim in 2..head_dim = 7 (0: the whole head dim), got "
                  "0, i.e. the head dim 7");
  bad = ok;
  bad.theta = 0.0f;
  EXPECT_EQ(forward(q, k, std::nullopt, bad, q_out, k_out), fwd + "argument 'theta': expected a finite base > 0, got 0");
  bad = ok;
  bad.linear_scaling = -1.0f;
  EXPECT_EQ(forward(q, k, std::nullopt, bad, q_out, k_out),
            fwd + "argument 'linear_scaling': expected a finite factor > 0, got -1");
  bad = ok;
  bad.attention_scaling = INFINITY;
  EXPECT_EQ(forward(q, k, std::nullopt, bad, q_out, k_out),
            fwd + "argument 'attention_scaling': expected a finite factor, got inf");
  bad = ok;
  bad.style = static_cast<RopeStyle>(7);
  EXPECT_EQ(forward(q, k, std::nullopt, bad, q_out, k_out),
            fwd + "argument 'style': expected rotate_half or interleaved, got value 7");
  // Outputs.
  EXPECT_EQ(forward(q, k, std::nullopt, ok, TensorView(qo.data(), DType::f32, cpu, {2, 3, 4, 6}), k_out),
            fwd + "argument 'q_out': expected shape (2, 3, 4, 8) (as 'q'), got (2, 3, 4, 6)");
  EXPECT_EQ(forward(q, k, std::nullopt, ok, TensorView(hb.data(), DType::f16, cpu, {2, 3, 4, 8}), k_out),
            fwd + "argument 'q_out': expected dtype f32 (as 'q'), got f16");
  // k.
  EXPECT_EQ(forward(q, k, std::nullopt, ok, q_out, std::nullopt),
            fwd + "argument 'k_out': expected a tensor since 'k' is given, got none");
  EXPECT_EQ(forward(q, std::nullopt, std::nullopt, ok, q_out, k_out),
            fwd + "argument 'k': expected a tensor since 'k_out' is given, got none");
  const TensorView k_bad(kb.data(), DType::f32, cpu, {2, 4, 1, 8});
  EXPECT_EQ(forward(q, k_bad, std::nullopt, ok, q_out, k_bad),
            fwd + "argument 'k': expected shape (2, 3, Hk, 8) (q's batch, sequence and head dim), got (2, 4, 1, 8)");
  const TensorView k16(hb.data(), DType::f16, cpu, {2, 3, 2, 8});
  EXPECT_EQ(forward(q, k16, std::nullopt, ok, q_out, k16), fwd + "argument 'k': expected dtype f32 (as 'q'), got f16");
  EXPECT_EQ(forward(q, k, std::nullopt, ok, q_out, TensorView(ko.data(), DType::f32, cpu, {2, 3, 1, 8})),
            fwd + "argument 'k_out': expected shape (2, 3, 2, 8) (as 'k'), got (2, 3, 1, 8)");
  // Positions.
  const TensorView ids_ok(ids.data(), DType::i64, cpu, {2, 3});
  EXPECT_EQ(forward(q, k, ids_ok, ok, q_out, k_out), "no error");
  EXPECT_EQ(forward(q, k, TensorView(table.data(), DType::f32, cpu, {2, 3}), ok, q_out, k_out),
            fwd + "argument 'position_ids': expected dtype i32 or i64, got f32");
  EXPECT_EQ(forward(q, k, TensorView(ids.data(), DType::i64, cpu, {3}), ok, q_out, k_out),
            fwd + "argument 'position_ids': expected shape (2, 3) or (1, 3) (q's batch and sequence), got (3)");
  const TensorView q3(qb.data(), DType::f32, cpu, {6, 4, 8}), qo3(qo.data(), DType::f32, cpu, {6, 4, 8});
  EXPECT_EQ(forward(q3, std::nullopt, ids_ok, ok, qo3, std::nullopt),
            fwd + "argument 'position_ids': expected shape (6) (q's tokens), got (2, 3)");
  EXPECT_EQ(forward(q3, std::nullopt, TensorView(ids.data(), DType::i64, cpu, {6}), ok, qo3, std::nullopt), "no error");
  // Tables.
  RopeTables t;
  t.inv_freq = TensorView(table.data(), DType::f32, cpu, {8});
  EXPECT_EQ(forward(q, k, std::nullopt, ok, q_out, k_out, t), fwd + "argument 'inv_freq': expected shape (4), got (8)");
  t.inv_freq = TensorView(hb.data(), DType::f16, cpu, {4});
  EXPECT_EQ(forward(q, k, std::nullopt, ok, q_out, k_out, t),
            fwd + "argument 'inv_freq': expected dtype f32 (the angles' float32 frequencies), got f16");
  t.inv_freq = TensorView(table.data(), DType::f32, cpu, {4});
  EXPECT_EQ(forward(q, k, std::nullopt, ok, q_out, k_out, t), "no error");
  bad = ok;
  bad.linear_scaling = 2.0f;
  EXPECT_EQ(forward(q, k, std::nullopt, bad, q_out, k_out, t),
            fwd + "argument 'linear_scaling': expected 1 with an inv_freq or cos / sin table (fold the scaling into "
                  "the table), got 2");
  t = {};
  t.cos = TensorView(table.data(), DType::f32, cpu, {10, 4});
  EXPECT_EQ(forward(q, k, std::nullopt, ok, q_out, k_out, t),
            fwd + "argument 'sin': expected a table since 'cos' is given, got none");
  t.sin = TensorView(table2.data(), DType::f32, cpu, {9, 4});
  EXPECT_EQ(forward(q, k, std::nullopt, ok, q_out, k_out, t),
            fwd + "argument 'sin': expected shape (10, 4) (as 'cos'), got (9, 4)");
  t.sin = TensorView(table2.data(), DType::f32, cpu, {5, 8});
  EXPECT_EQ(forward(q, k, std::nullopt, ok, q_out, k_out, t),
            fwd + "argument 'sin': expected shape (P, 4) with P >= 1 positions (rotary_dim / 2 columns), got (5, 8)");
  t.sin = TensorView(table2.data(), DType::f32, cpu, {10, 4});
  EXPECT_EQ(forward(q, k, std::nullopt, ok, q_out, k_out, t), "no error");
  t.inv_freq = TensorView(table.data(), DType::f32, cpu, {4});
  EXPECT_EQ(forward(q, k, std::nullopt, ok, q_out, k_out, t),
            fwd + "argument 'inv_freq': expected no inv_freq table when cos and sin are given (one angle source), got "
                  "a tensor");
  t.inv_freq.reset();
  std::vector<std::int64_t> far(6, 1);
  far[5] = 12;
  EXPECT_EQ(forward(q, k, TensorView(far.data(), DType::i64, cpu, {2, 3}), ok, q_out, k_out, t),
            fwd + "argument 'position_ids': expected positions in [0, 10) (the rows of cos and sin), got 12 at (1, 2)");
  t.cos = TensorView(table.data(), DType::f32, cpu, {2, 4});
  t.sin = TensorView(table2.data(), DType::f32, cpu, {2, 4});
  EXPECT_EQ(forward(q, k, std::nullopt, ok, q_out, k_out, t),
            fwd + "argument 'cos': expected at least 3 rows (one per sequence position), got 2 rows");
  // Overlaps: in place is allowed, partial overlap is not.
  EXPECT_EQ(forward(q, k, std::nullopt, ok, q, k), "no error");
  EXPECT_EQ(forward(q, k, std::nullopt, ok, q, k_out), "no error");
  std::vector<float> big(qb.size() + 8);
  const TensorView in_big(big.data(), DType::f32, cpu, {2, 3, 4, 8}), out_big(big.data() + 8, DType::f32, cpu, {2, 3, 4, 8});
  EXPECT_EQ(forward(in_big, std::nullopt, std::nullopt, ok, out_big, std::nullopt),
            fwd + "argument 'q_out': expected memory that does not overlap 'q', got a view sharing bytes with 'q'");
  EXPECT_EQ(forward(q, k, std::nullopt, ok, q_out, TensorView(qo.data(), DType::f32, cpu, {2, 3, 2, 8})),
            fwd + "argument 'k_out': expected memory that does not overlap 'q_out', got a view sharing bytes with "
                  "'q_out'");
  EXPECT_EQ(forward(q, k, std::nullopt, ok, q, TensorView(qb.data(), DType::f32, cpu, {2, 3, 2, 8})),
            fwd + "argument 'k_out': expected memory that does not overlap 'q', got a view sharing bytes with 'q'");
  const TensorView q_expanded(qo.data(), DType::f32, cpu, {2, 3, 4, 8}, {0, 32, 8, 1});
  EXPECT_NE(forward(q, std::nullopt, std::nullopt, ok, q_expanded, std::nullopt)
                .find(fwd + "argument 'q_out': expected a view whose elements do not overlap"),
            std::string::npos);
  // Devices: only the views' metadata is read, no GPU needed.
  const TensorView k_gpu(kb.data(), DType::f32, Device::cuda(0), {2, 3, 2, 8});
  EXPECT_EQ(forward(q, k_gpu, std::nullopt, ok, q_out, k_out),
            fwd + "argument 'k': expected a tensor on cpu (where 'q' is), got a tensor on cuda:0");
  // The backward names its own arguments.
  EXPECT_EQ(error_of([&] { rope_backward(q, k, std::nullopt, ok, q_out, std::nullopt); }),
            bwd + "argument 'dk': expected a tensor since 'dk_out' is given, got none");
  EXPECT_EQ(error_of([&] { rope_backward(q64, std::nullopt, std::nullopt, ok, q64, std::nullopt); }),
            bwd + "argument 'dq_out': expected dtype f32, f16 or bf16, got f64");
  EXPECT_EQ(error_of([&] { rope_backward(q, k, std::nullopt, ok, q, k); }), "no error");
}

TEST(RopeErrors, EmptyProblemsAreNoOps) {
  std::vector<float> none;
  const TensorView q(none.data(), DType::f32, Device::cpu(), {0, 3, 4, 8});
  EXPECT_EQ(error_of([&] { rope_forward(q, std::nullopt, std::nullopt, {}, q, std::nullopt); }), "no error");
  std::vector<float> qb(3 * 8, 1.0f), qo(qb.size());
  const TensorView k0(none.data(), DType::f32, Device::cpu(), {1, 3, 0, 8});
  EXPECT_EQ(error_of([&] {
              rope_forward(TensorView(qb.data(), DType::f32, Device::cpu(), {1, 3, 1, 8}), k0, std::nullopt, {},
                           TensorView(qo.data(), DType::f32, Device::cpu(), {1, 3, 1, 8}), k0);
            }),
            "no error");
  EXPECT_EQ(qo[0], 1.0f);  // position 0: identity
}

// ---- GPU ---------------------------------------------------------------------------------------

// Runs a case forward and backward on the GPU and on the CPU reference (plain layouts, out of
// place) and compares every output; checks the storage outside the outputs' views stays poisoned.
void check_gpu_against_cpu(const Case& c, std::uint64_t salt) {
  SCOPED_TRACE(c.str());
  auto rng = testing::make_rng(salt);
  Problem cpu(reference_case(c), Device::cpu());
  fill_inputs(cpu, rng);
  for (bool backward : {false, true}) {
    SCOPED_TRACE(backward ? "backward" : "forward");
    Problem gpu(c, Device::cuda(0));
    copy_inputs(cpu, gpu);
    gpu.poison_outputs();
    cpu.poison_outputs();
    if (backward) {
      cpu.backward();
      gpu.backward();
    } else {
      cpu.forward();
      gpu.forward();
    }
    EXPECT_TRUE(close_to_reference(gpu.q_result(), cpu.q_out.values(), c.dtype, backward ? "dq" : "q_out"));
    if (c.with_k && c.hk > 0) {
      EXPECT_TRUE(close_to_reference(gpu.k_result(), cpu.k_out->values(), c.dtype, backward ? "dk" : "k_out"));
    }
    if (!c.in_place) {
      EXPECT_EQ(gpu.q_out.poisoned_outside(), gpu.q_out.outside());
      if (c.with_k) {
        EXPECT_EQ(gpu.k_out->poisoned_outside(), gpu.k_out->outside());
      }
    }
  }
}

Layout random_layout(std::mt19937_64& rng, DType dtype) {
  const std::int64_t v = 16 / static_cast<std::int64_t>(dtype_size(dtype));
  Layout l;
  l.bhsd = rng() % 3 == 0;
  switch (rng() % 4) {
    case 0: break;                                          // aligned
    case 1: l.pad = v * (1 + rng() % 2); break;             // padded rows, aligned
    case 2: l.pad = 1 + rng() % 5; l.shift = rng() % (l.pad + 1); break;  // any alignment
    case 3: l.pad = v; l.shift = v / 2; break;              // half a vector off
  }
  return l;
}

TEST(RopeGpu, RandomizedProblemsMatchCpuReference) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(100);
  const std::int64_t head_dims[] = {2, 4, 6, 8, 16, 24, 32, 40, 64, 80, 96, 128, 130, 160, 256, 512};
  const DType dtypes[] = {DType::f32, DType::f16, DType::bf16};
  int cases = 0;
  for (std::int64_t d : head_dims)
    for (RopeStyle style : {RopeStyle::rotate_half, RopeStyle::interleaved})
      for (int trial = 0; trial < 3; ++trial) {
        Case c;
        c.dtype = dtypes[rng() % 3];
        c.positions = static_cast<Positions>(rng() % 4);
        c.b = c.positions == Positions::packed ? 1 : 1 + rng() % 3;
        c.s = 1 + rng() % (d >= 256 ? 40 : 120);
        c.hq = 1 + rng() % 12;
        c.with_k = rng() % 6 != 0;
        c.hk = rng() % 5 == 0 ? 0 : 1 + rng() % 6;
        c.d = d;
        c.position_dtype = rng() % 2 ? DType::i32 : DType::i64;
        c.max_position = rng() % 2 ? 0 : 1 + static_cast<std::int64_t>(rng() % 200000);
        c.source = static_cast<Source>(rng() % 3);
        if (c.source == Source::cos_sin) c.max_position = std::min<std::int64_t>(c.max_position, 5000);
        c.config.style = style;
        c.config.rotary_dim = rng() % 2 ? 0 : 2 * (1 + static_cast<std::int64_t>(rng() % (d / 2)));
        c.config.theta = rng() % 2 ? 10000.0f : 500000.0f;
        c.config.linear_scaling = c.source == Source::theta && rng() % 4 == 0 ? 4.0f : 1.0f;
        c.config.attention_scaling = rng() % 4 == 0 ? 1.1f : 1.0f;
        c.q_layout = random_layout(rng, c.dtype);
        c.k_layout = random_layout(rng, c.dtype);
        c.q_out_layout = random_layout(rng, c.dtype);
        c.k_out_layout = random_layout(rng, c.dtype);
        c.in_place = rng() % 4 == 0;
        check_gpu_against_cpu(c, 1000 + cases);
        ++cases;
      }
  EXPECT_EQ(cases, 16 * 2 * 3);
}

TEST(RopeGpu, LlamaShapesMatchCpuReference) {
  FUSEKIT_REQUIRE_GPU();
  struct Shape {
    std::int64_t d, r;
    RopeStyle style;
  };
  int salt = 0;
  for (Shape sh : {Shape{128, 0, RopeStyle::rotate_half}, Shape{64, 0, RopeStyle::rotate_half},
                   Shape{128, 32, RopeStyle::rotate_half}, Shape{128, 0, RopeStyle::interleaved}})
    for (DType dtype : {DType::bf16, DType::f32}) {
      Case c;
      c.dtype = dtype;
      c.b = 2, c.s = 1024, c.hq = 32, c.hk = 8, c.d = sh.d;
      c.config.style = sh.style;
      c.config.rotary_dim = sh.r;
      c.config.theta = 500000.0f;
      c.in_place = salt % 2 == 1;
      check_gpu_against_cpu(c, 2000 + salt++);
    }
}

// More rows per token than one batch of the block's row groups holds (several batches per lane),
// and rows of more units than a row group has lanes (several units per lane).
TEST(RopeGpu, ManyHeadsAndWideRowsMatchCpuReference) {
  FUSEKIT_REQUIRE_GPU();
  struct Shape {
    DType dtype;
    std::int64_t d, r, hq, hk;
    RopeStyle style;
    bool in_place;
  };
  int salt = 0;
  for (Shape sh : {Shape{DType::bf16, 512, 0, 40, 8, RopeStyle::rotate_half, false},
                   Shape{DType::f32, 256, 0, 50, 30, RopeStyle::interleaved, false},
                   Shape{DType::f32, 256, 64, 33, 0, RopeStyle::rotate_half, false},
                   Shape{DType::f16, 512, 128, 70, 10, RopeStyle::interleaved, true}}) {
    Case c;
    c.dtype = sh.dtype;
    c.b = 2, c.s = 19, c.hq = sh.hq, c.hk = sh.hk, c.d = sh.d;
    c.with_k = sh.hk > 0;
    c.positions = Positions::ids;
    c.config.style = sh.style;
    c.config.rotary_dim = sh.r;
    c.in_place = sh.in_place;
    check_gpu_against_cpu(c, 2500 + salt++);
  }
}

// Every access width on the same data gives bitwise the same result (the same float32 math), and
// that result matches the reference.
TEST(RopeGpu, EveryAccessWidthGivesTheSameBits) {
  FUSEKIT_REQUIRE_GPU();
  struct Guard {
    ~Guard() { detail::set_override("rope.max_access_bytes", ""); }
  } guard;
  auto rng = testing::make_rng(101);
  int salt = 0;
  for (DType dtype : {DType::f32, DType::f16, DType::bf16})
    for (RopeStyle style : {RopeStyle::rotate_half, RopeStyle::interleaved})
      for (std::int64_t r : {0, 48}) {
        Case c;
        c.dtype = dtype;
        c.b = 2, c.s = 37, c.hq = 5, c.hk = 3, c.d = 64;
        c.positions = Positions::ids;
        c.max_position = 100000;
        c.config.style = style;
        c.config.rotary_dim = r;
        SCOPED_TRACE(c.str());
        std::optional<std::vector<double>> first_q, first_k;
        Problem cpu(c, Device::cpu());
        fill_inputs(cpu, rng);
        cpu.forward();
        for (const char* width : {"16", "8", "4", "element"}) {
          detail::set_override("rope.max_access_bytes", width);
          Problem gpu(c, Device::cuda(0));
          copy_inputs(cpu, gpu);
          gpu.poison_outputs();
          gpu.forward();
          const auto q = gpu.q_out.values(), k = gpu.k_out->values();
          EXPECT_TRUE(close_to_reference(q, cpu.q_out.values(), dtype, std::string("q_out at ") + width));
          if (!first_q) {
            first_q = q, first_k = k;
          } else {
            EXPECT_EQ(q, *first_q) << width;
            EXPECT_EQ(k, *first_k) << width;
          }
        }
        ++salt;
      }
}

TEST(RopeGpu, TokensPerBlockDoesNotChangeTheResult) {
  FUSEKIT_REQUIRE_GPU();
  struct Guard {
    ~Guard() { detail::set_override("rope.tokens_per_block", ""); }
  } guard;
  auto rng = testing::make_rng(102);
  Case c;
  c.dtype = DType::bf16;
  c.b = 3, c.s = 101, c.hq = 6, c.hk = 2, c.d = 128;
  c.positions = Positions::ids;
  Problem cpu(c, Device::cpu());
  fill_inputs(cpu, rng);
  std::optional<std::vector<double>> first;
  for (const char* tpb : {"1", "2", "5", "16"}) {
    detail::set_override("rope.tokens_per_block", tpb);
    Problem gpu(c, Device::cuda(0));
    copy_inputs(cpu, gpu);
    gpu.poison_outputs();
    gpu.backward();
    const auto q = gpu.q_out.values();
    if (!first) first = q;
    else EXPECT_EQ(q, *first) << tpb;
  }
  cpu.backward();
  EXPECT_TRUE(close_to_reference(*first, cpu.q_out.values(), c.dtype, "dq"));
}

// Positions up to 10^6 with theta = 10^4: angles far beyond the range where the fast sine and
// cosine intrinsics are accurate. f32 outputs make the bar tight.
TEST(RopeGpu, LongPositionsUseAccurateSineAndCosine) {
  FUSEKIT_REQUIRE_GPU();
  for (RopeStyle style : {RopeStyle::rotate_half, RopeStyle::interleaved}) {
    Case c;
    c.dtype = DType::f32;
    c.b = 2, c.s = 300, c.hq = 4, c.hk = 4, c.d = 128;
    c.positions = Positions::ids;
    c.max_position = 1000000;
    c.config.style = style;
    check_gpu_against_cpu(c, 3000 + static_cast<int>(style));
  }
}

// With cos / sin tables a position outside the tables gives NaN in the token's rotated dims (and
// nothing else changes); the CPU refuses such positions.
TEST(RopeGpu, PositionsOutsideTheTablesGiveNaN) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(103);
  Case c;
  c.dtype = DType::bf16;
  c.b = 1, c.s = 4, c.hq = 2, c.hk = 1, c.d = 16;
  c.config.rotary_dim = 8;
  c.positions = Positions::ids;
  c.source = Source::cos_sin;
  c.max_position = 10;
  Problem gpu(c, Device::cuda(0));
  fill_inputs(gpu, rng);
  gpu.ids->set_values({0, 11, -1, 3});
  gpu.forward();
  const auto in = gpu.q.values(), out = gpu.q_out.values();
  for (std::int64_t s = 0; s < c.s; ++s)
    for (std::int64_t h = 0; h < c.hq; ++h)
      for (std::int64_t j = 0; j < c.d; ++j) {
        const double v = out[(s * c.hq + h) * c.d + j];
        if (j >= 8) ASSERT_EQ(v, in[(s * c.hq + h) * c.d + j]);
        else ASSERT_EQ(std::isnan(v), s == 1 || s == 2) << s << " " << j;
      }
}

}  // namespace
}  // namespace fusekit
