// mxmla command-line tool — option parsing. Every option is accepted as `--opt value` and as
// `--opt=value`; a flag takes no value. Bad input throws UsageError, which the tool prints with a
// pointer to the command's --help and turns into exit status 2.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <unistd.h>

namespace mxmla::tool {

// Bad command-line input: `command` is e.g. "mxmla run", the message names the option and the rule.
class UsageError : public std::invalid_argument {
 public:
  UsageError(const std::string& command, const std::string& message)
      : std::invalid_argument(message), command_(command) {}
  const std::string& command() const { return command_; }

 private:
  std::string command_;
};

struct OptionSpec {
  std::string name;     // "--tokens"
  std::string metavar;  // "T"; empty for a flag
  std::string help;     // one line or more (wrapped by the caller with "\n")
  std::function<void(const std::string& value)> set;  // flags are called with ""
};

// One subcommand: its usage text and options. parse() returns false when --help was printed.
struct Command {
  std::string name;         // "mxmla run"
  std::string description;  // the paragraph(s) printed by --help above the options
  std::vector<OptionSpec> options;

  void print_help(FILE* f) const {
    std::fprintf(f, "usage: %s%s\n\n%s\noptions%s:\n", name.c_str(), options.empty() ? "" : " [options]",
                 description.c_str(), options.empty() ? "" : " (each as '--opt value' or '--opt=value')");
    for (const OptionSpec& o : options) {
      std::string left = "  " + o.name + (o.metavar.empty() ? "" : " " + o.metavar);
      if (left.size() < 20) left.resize(20, ' ');
      else left += "\n" + std::string(20, ' ');
      std::string help = o.help;
      for (size_t p = help.find('\n'); p != std::string::npos; p = help.find('\n', p + 21))
        help.replace(p, 1, "\n" + std::string(20, ' '));
      std::fprintf(f, "%s%s\n", left.c_str(), help.c_str());
    }
    std::fprintf(f, "  -h, --help        this text\n");
  }

  bool parse(int argc, char** argv, int first) const {
    for (int i = first; i < argc; ++i) {
      std::string arg = argv[i];
      if (arg == "-h" || arg == "--help") {
        print_help(stdout);
        return false;
      }
      std::string value;
      bool has_value = false;
      if (const size_t eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
        value = arg.substr(eq + 1), arg = arg.substr(0, eq), has_value = true;
      }
      const OptionSpec* spec = nullptr;
      for (const OptionSpec& o : options)
        if (o.name == arg) spec = &o;
      if (spec == nullptr) {
        if (arg.rfind("-", 0) == 0) throw UsageError(name, "unknown option '" + arg + "'");
        throw UsageError(name, "unexpected argument '" + arg + "' (" + name + " takes only options)");
      }
      if (spec->metavar.empty()) {
        if (has_value) throw UsageError(name, "option '" + arg + "' takes no value");
      } else if (!has_value) {
        if (i + 1 >= argc) throw UsageError(name, "option '" + arg + "' needs a value (" + spec->metavar + ")");
        value = argv[++i];
      }
      spec->set(value);
    }
    return true;
  }
};

// An integer option's value: a plain decimal integer in [lo, hi], else a UsageError that names
// the option and the rule.
inline int64_t parse_int(const std::string& command, const std::string& opt, const std::string& v, int64_t lo,
                         int64_t hi = std::numeric_limits<int32_t>::max()) {
  const std::string rule = "must be an integer from " + std::to_string(lo) + " to " +
                           (hi == std::numeric_limits<int64_t>::max() ? std::string("2^63 - 1") : std::to_string(hi));
  errno = 0;
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  const bool digits = !v.empty() && v.find_first_not_of("+-0123456789") == std::string::npos;
  if (!digits || *end != '\0' || errno == ERANGE || x < lo || x > hi)
    throw UsageError(command, "option '" + opt + "' " + rule + ", got '" + v + "'");
  return x;
}

// A choice among fixed names.
inline std::string parse_choice(const std::string& command, const std::string& opt, const std::string& v,
                                const std::vector<std::string>& names) {
  for (const std::string& n : names)
    if (v == n) return v;
  std::string list;
  for (size_t i = 0; i < names.size(); ++i) list += (i ? (i + 1 == names.size() ? " or " : ", ") : "") + names[i];
  throw UsageError(command, "option '" + opt + "' must be " + list + ", got '" + v + "'");
}

// Rejects a size whose host buffers would not fit in this machine's memory (before allocating
// them, so that a typo gets a message rather than the out-of-memory killer).
inline void check_host_memory(const std::string& command, double bytes, const std::string& sizes) {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0) return;
  const double have = double(pages) * double(page);
  if (bytes > 0.9 * have) {
    char msg[256];
    std::snprintf(msg, sizeof msg, "needs about %.1f GiB of host memory; this machine has %.1f GiB", bytes / 1073741824.0,
                  have / 1073741824.0);
    throw UsageError(command, sizes + " " + msg);
  }
}

}  // namespace mxmla::tool
