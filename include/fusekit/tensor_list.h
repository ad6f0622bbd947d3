// A read-only list of tensor views, for the ops that take any number of tensors (the optimizer's).
//
// What std::span<const TensorView> would be, kept to C++17 so that every public header compiles
// for C++17 consumers. It does not own the views: the vector or array behind it must outlive the
// call.
#pragma once

#include <cstddef>
#include <vector>

#include "fusekit/tensor.h"

namespace fusekit {

class TensorList {
 public:
  constexpr TensorList() = default;
  constexpr TensorList(const TensorView* data, std::size_t size) : data_(data), size_(size) {}
  // Implicit, so a std::vector<TensorView> passes where a list is expected.
  TensorList(const std::vector<TensorView>& views) : data_(views.data()), size_(views.size()) {}

  constexpr const TensorView* begin() const { return data_; }
  constexpr const TensorView* end() const { return data_ + size_; }
  constexpr const TensorView& operator[](std::size_t i) const { return data_[i]; }
  constexpr std::size_t size() const { return size_; }
  constexpr bool empty() const { return size_ == 0; }

 private:
  const TensorView* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace fusekit
