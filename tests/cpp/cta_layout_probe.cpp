// Prints what the persistent kernel's prologue makes of a CTA layout (csrc/cuda/persistent_args.h
// set_cta_layout, cta_rank, launch_grid, shared_ring), for the layouts given on the command line:
// `sms c_0 c_1 ... --` per layout (c_r: rank r's CTAs, sms: the device's SM count).  Per layout:
//   grid <grid> uniform <ctas_per_rank> ring <0|1>
//   fast <rank>:<ctas> ...      cta_rank of every block, as the launch sets the arguments
//   search <rank>:<ctas> ...    the same with the uniform fast path off (ctas_per_rank = 0)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "persistent_args.h"

using ultracomm::PersistentArgs;

static void blocks(const char* name, const PersistentArgs& a) {
  std::printf("%s", name);
  for (int32_t b = 0; b < ultracomm::launch_grid(a); ++b) {
    const ultracomm::CtaRank c = ultracomm::cta_rank(a, b);
    std::printf(" %d:%d", c.rank, c.ctas);
  }
  std::printf("\n");
}

int main(int argc, char** argv) {
  int i = 1;
  while (i < argc) {
    const int32_t sms = static_cast<int32_t>(std::strtol(argv[i++], nullptr, 10));
    std::vector<int32_t> ctas;
    while (i < argc && std::strcmp(argv[i], "--") != 0) ctas.push_back(static_cast<int32_t>(std::atoi(argv[i++])));
    if (i < argc) ++i;  // "--"
    PersistentArgs a{};
    std::memset(&a.cta_end, 0x7f, sizeof a.cta_end);  // set_cta_layout must write every entry it reads
    const int64_t grid = ultracomm::set_cta_layout(a, ctas.data(), static_cast<int32_t>(ctas.size()));
    std::printf("grid %lld launch_grid %lld uniform %d ring %d\n", static_cast<long long>(grid),
                static_cast<long long>(ultracomm::launch_grid(a)), a.ctas_per_rank,
                ultracomm::shared_ring(a, sms) ? 1 : 0);
    blocks("fast", a);
    a.ctas_per_rank = 0;
    blocks("search", a);
  }
  return 0;
}
