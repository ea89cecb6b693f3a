// Prints launch_epoch (csrc/cuda/persistent_args.h) for the cases given on the command line:
// `requested nranks last_0 last_1 ...` per argument group separated by "--".
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "persistent_args.h"

int main(int argc, char** argv) {
  int i = 1;
  while (i < argc) {
    ultracomm::DeviceState s{};
    const uint64_t requested = std::strtoull(argv[i++], nullptr, 10);
    const int32_t nranks = static_cast<int32_t>(std::strtol(argv[i++], nullptr, 10));
    for (int r = 0; i < argc && std::strcmp(argv[i], "--") != 0; ++r)
      s.ranks[r].last_epoch = std::strtoull(argv[i++], nullptr, 10);
    if (i < argc) ++i;  // "--"
    std::printf("%llu\n", static_cast<unsigned long long>(ultracomm::launch_epoch(s, requested, nranks)));
  }
  return 0;
}
