// Leveled logging of the native core to stderr, as "spark_hvd LEVEL: message".
//
// The threshold comes from SPARK_HVD_LOG_LEVEL, else HOROVOD_LOG_LEVEL (Horovod's names TRACE,
// DEBUG, INFO, WARNING, ERROR, FATAL, any case; default WARNING), read once on first use: the
// same variables the launcher and the Python side read, so one setting controls every layer.
#pragma once

namespace shvd {

enum class LogLevel : int { kTrace = 0, kDebug, kInfo, kWarning, kError, kFatal };

// True when a message of `level` would be written: lets a caller skip building one.
bool log_enabled(LogLevel level);

// Writes one line (printf-style format, no trailing newline needed) when `level` is enabled.
void log_message(LogLevel level, const char* format, ...) __attribute__((format(printf, 2, 3)));

}  // namespace shvd
