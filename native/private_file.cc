#include "private_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace unison {

std::FILE* create_private_file(const std::string& path, std::string* why) {
  // O_NONBLOCK: opening a FIFO for writing would otherwise wait for a reader.
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK, 0600);
  if (fd < 0) {
    // ENXIO: a FIFO nobody reads, which O_NONBLOCK turned into an error.
    *why = errno == ELOOP   ? "it is a symbolic link, which is not followed"
           : errno == ENXIO ? "it is not a regular file"
                            : std::strerror(errno);
    return nullptr;
  }
  // A FIFO or a device under the name would take the writes somewhere
  // else, or block the rank.
  struct stat info;
  const bool regular = fstat(fd, &info) == 0 && S_ISREG(info.st_mode);
  if (!regular || fchmod(fd, 0600) != 0) {
    *why = !regular ? "it is not a regular file" : std::strerror(errno);
    close(fd);
    return nullptr;
  }
  std::FILE* file = fdopen(fd, "w");
  if (file == nullptr) {
    *why = std::strerror(errno);
    close(fd);
  }
  return file;
}

}  // namespace unison
