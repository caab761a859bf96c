// The one exception core/ and step/ throw for a bad argument or value. It names the argument
// and says what is wrong; what() is "<argument>: <message>". The Python binding turns it into
// ValueError with that text.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

namespace deepinfer {

class InvalidArgument : public std::invalid_argument {
 public:
  InvalidArgument(std::string argument, std::string message)
      : std::invalid_argument(argument + ": " + message), argument_(std::move(argument)), message_(std::move(message)) {}
  const std::string& argument() const noexcept { return argument_; }
  const std::string& message() const noexcept { return message_; }

 private:
  std::string argument_, message_;
};

}  // namespace deepinfer
