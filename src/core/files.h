// Whole files read with errors that name them: a missing file, a folder where a file is expected
// (which std::ifstream opens and then fails to read with a library message), a file that cannot be
// opened or read, each with the reason.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

namespace kcpp {

// The bytes of the regular file `path`; `what` names it in errors ("the model's config.json").
std::string read_whole_file(const std::filesystem::path& path, std::string_view what);

// Throws the error read_whole_file would for `path` if it is not a readable regular file.
void check_readable_file(const std::filesystem::path& path, std::string_view what);

}  // namespace kcpp
