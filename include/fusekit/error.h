// The one exception type fusekit throws.
//
// Every message names the op and, for bad arguments, the argument, what was expected and what
// came, e.g.
//   fusekit.layer_norm_forward: argument 'weight': expected shape (1024), got (1000)
#pragma once

#include <stdexcept>
#include <string>

namespace fusekit {

enum class ErrorKind {
  invalid_argument,  // shape, dtype, stride, alignment, device, null data, size limits
  unsupported,       // a valid request this build, this GPU or this host cannot serve (e.g. the
                     // CPU reference's scratch memory could not be allocated)
  cuda,              // a CUDA runtime or library call failed
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, std::string op, std::string argument, std::string expected,
        std::string got);
  Error(ErrorKind kind, std::string op, std::string detail);

  ErrorKind kind() const { return kind_; }
  const std::string& op() const { return op_; }
  const std::string& argument() const { return argument_; }  // empty when not about one argument
  const std::string& expected() const { return expected_; }
  const std::string& got() const { return got_; }

 private:
  ErrorKind kind_;
  std::string op_, argument_, expected_, got_;
};

}  // namespace fusekit
