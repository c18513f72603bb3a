// private_file.h: the files a rank writes for its user (the timeline, the
// autotune log). They show the model's tensors, sizes and timing, so only
// their owner may read them (0600); and a name in a shared folder may be a
// link another user planted to make the job overwrite a file of its owner's,
// so a link is refused rather than followed.
#pragma once

#include <cstdio>
#include <string>

namespace unison {

// Opens `path` for writing, emptied, mode 0600 (an existing file is set to
// it too), refusing a symbolic link as the last part of the name. nullptr
// on failure, with *why saying what the system said.
std::FILE* create_private_file(const std::string& path, std::string* why);

}  // namespace unison
