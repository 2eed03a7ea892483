#include "shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

#include "../common/hmac.h"

namespace shvd {

GroupSegment map_group_segment(const std::vector<Link*>& links, int me,
                               const std::string& name_prefix, void* params,
                               size_t params_bytes, const std::function<size_t()>& bytes_for,
                               size_t zeroed_bytes, const std::function<void(void*)>& on_mapped) {
  const int members = int(links.size());
  void* base = MAP_FAILED;
  size_t bytes = 0;
  uint8_t ok = 1;
  if (me == 0) {
    bytes = bytes_for();
    uint8_t rnd[8];
    random_bytes(rnd, sizeof rnd);
    char hex[17];
    for (int i = 0; i < 8; ++i) snprintf(hex + 2 * i, 3, "%02x", rnd[i]);
    const std::string name = name_prefix + hex;
    int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd >= 0 && posix_fallocate(fd, 0, off_t(bytes)) == 0)
      base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (fd >= 0) close(fd);
    ok = base != MAP_FAILED;
    if (ok) {
      std::memset(base, 0, zeroed_bytes);
      on_mapped(base);
    }
    const uint32_t len = ok ? uint32_t(name.size()) : 0;
    for (int m = 1; m < members; ++m) {
      links[m]->send(&len, sizeof len);
      if (len) {
        links[m]->send(params, params_bytes);
        links[m]->send(name.data(), len);
      }
    }
    for (int m = 1; m < members; ++m) {
      uint8_t ack = 0;
      links[m]->recv(&ack, 1);
      ok = ok && ack;
    }
    if (base != MAP_FAILED) shm_unlink(name.c_str());
    for (int m = 1; m < members; ++m) links[m]->send(&ok, 1);
  } else {
    uint32_t len = 0;
    links[0]->recv(&len, sizeof len);
    std::string name(len, '\0');
    if (len) {
      links[0]->recv(params, params_bytes);
      links[0]->recv(&name[0], len);
      bytes = bytes_for();
      int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
      if (fd >= 0) {
        base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
      }
      if (base != MAP_FAILED) on_mapped(base);
    }
    uint8_t ack = base != MAP_FAILED;
    links[0]->send(&ack, 1);
    links[0]->recv(&ok, 1);  // everyone must have mapped it, or nobody uses it
  }
  if (!ok) {
    if (base != MAP_FAILED) munmap(base, bytes);
    return {};
  }
  return {base, bytes};
}

bool all_members_agree(const std::vector<Link*>& links, int me, bool mine) {
  uint8_t all = mine;
  if (me == 0) {
    for (size_t m = 1; m < links.size(); ++m) {
      uint8_t theirs = 0;
      links[m]->recv(&theirs, 1);
      all = all && theirs;
    }
    for (size_t m = 1; m < links.size(); ++m) links[m]->send(&all, 1);
  } else {
    links[0]->send(&all, 1);
    links[0]->recv(&all, 1);
  }
  return all != 0;
}

}  // namespace shvd
