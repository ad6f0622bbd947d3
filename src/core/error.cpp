#include "fusekit/error.h"

#include <utility>

namespace fusekit {

static std::string format_argument_error(const std::string& op, const std::string& argument,
                                         const std::string& expected, const std::string& got) {
  return "fusekit." + op + ": argument '" + argument + "': expected " + expected + ", got " + got;
}

Error::Error(ErrorKind kind, std::string op, std::string argument, std::string expected,
             std::string got)
    : std::runtime_error(format_argument_error(op, argument, expected, got)),
      kind_(kind),
      op_(std::move(op)),
      argument_(std::move(argument)),
      expected_(std::move(expected)),
      got_(std::move(got)) {}

Error::Error(ErrorKind kind, std::string op, std::string detail)
    : std::runtime_error("fusekit." + op + ": " + detail), kind_(kind), op_(std::move(op)) {}

}  // namespace fusekit
