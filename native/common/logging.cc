#include "logging.h"

#include <strings.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace shvd {

namespace {

const char* const kNames[] = {"TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"};
const char* const kLevelVars[] = {"SPARK_HVD_LOG_LEVEL", "HOROVOD_LOG_LEVEL"};  // ours wins

LogLevel level_from_env() {
  for (const char* var : kLevelVars) {
    const char* value = std::getenv(var);
    if (value == nullptr || *value == '\0') continue;
    for (int i = 0; i <= int(LogLevel::kFatal); ++i) {
      if (strcasecmp(value, kNames[i]) == 0) return LogLevel(i);
    }
    // The Python side warns about an unknown name once; here it just means the default.
    return LogLevel::kWarning;
  }
  return LogLevel::kWarning;
}

LogLevel threshold() {
  static const LogLevel level = level_from_env();  // thread-safe one-time init
  return level;
}

}  // namespace

bool log_enabled(LogLevel level) { return int(level) >= int(threshold()); }

void log_message(LogLevel level, const char* format, ...) {
  if (!log_enabled(level)) return;
  va_list args, again;
  va_start(args, format);
  va_copy(again, args);
  char small[512];
  int n = std::vsnprintf(small, sizeof small, format, args);
  va_end(args);
  std::string text;
  if (n >= int(sizeof small)) {  // long messages (a stall report's tensor list) are not cut
    text.resize(size_t(n) + 1);
    std::vsnprintf(&text[0], text.size(), format, again);
    text.resize(size_t(n));
  } else {
    text.assign(small, n > 0 ? size_t(n) : 0);
  }
  va_end(again);
  // One fprintf per line, so lines of concurrent threads do not interleave mid-line.
  std::fprintf(stderr, "spark_hvd %s: %s\n", kNames[int(level)], text.c_str());
}

}  // namespace shvd
